"""Large objects on S3: multipart uploads and parallel ranged reads, retried per part.

A 1B-parameter model's fragment chunks are 64-256 MiB objects. One PUT or GET of
such an object is one TCP stream (slow across regions) and one failure late in
the body costs the whole object again. Above ``multipart_threshold`` bytes
(`LargeObjects`), `ObjectStore` on S3 therefore:

- uploads in parts of ``part_size`` bytes, at most ``part_concurrency`` in flight,
  each part retried on its own under the store's `RetryPolicy`; the upload is
  aborted when a part (or the completion) finally fails, so no multipart upload is
  left behind to be billed for its parts. The parts are memoryview slices of the
  caller's bytes: nothing is copied.
- reads with a first GET of ``bytes=0-(threshold-1)``: an object smaller than the
  threshold comes whole in that one request (the same single request as a plain
  GET). When the first request fills the threshold, a HEAD gives the object's
  size, a ``bytearray`` of exactly that size is allocated (the first bytes copied
  in), and the remaining ``part_size`` ranges are fetched concurrently, each
  written in place and retried on its own; a body shorter than its range is an
  error (retried). The result is that ``bytearray`` (no copy into ``bytes``).

Create-only writes (`ObjectStore.put_if_absent`: commit records, claims, run
manifests) are small and stay single conditional PUTs: S3 has no create-only
multipart upload that is atomic against a racing writer.

Counting (storage/traffic.py): every request of an upload counts as a ``put``
(create, each part with its bytes, complete: the bill prices each as class A),
an abort as a ``delete``; every range of a read counts as a ``get`` (the bytes are
counted once, on the first request), the HEAD as a ``size``. Failed attempts count as requests and
retries, as everywhere in the store. The file and memory backends accept the same
options and ignore them (a write is one rename, a read one file read).
"""

from __future__ import annotations

import asyncio
import errno
import io
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from botocore.exceptions import ClientError
from fsspec.asyn import sync
from tenacity import RetryCallState

from storage.retry import RetryPolicy, log_retry
from storage.traffic import TrafficCounter

log = logging.getLogger(__name__)

T = TypeVar("T")

MIB = 1 << 20
#: S3's rules for parts: at least 5 MiB (but the last), at most 5 GiB, 10,000 parts.
MIN_PART, MAX_PART, MAX_PARTS = 5 * MIB, 5 << 30, 10_000
#: the storage options this module reads (and takes out before s3fs sees them)
OPTIONS = ("multipart_threshold", "part_size", "part_concurrency")


@dataclass(frozen=True)
class LargeObjects:
    """When an object is large, and how it is moved in parts (storage options
    ``multipart_threshold``, ``part_size``, ``part_concurrency``)."""

    multipart_threshold: int = 64 * MIB
    part_size: int = 16 * MIB
    part_concurrency: int = 4

    def __post_init__(self) -> None:
        _check("part_size", self.part_size, MIN_PART, MAX_PART, "S3's part limits")
        _check("multipart_threshold", self.multipart_threshold, self.part_size, None,
               "part_size")
        _check("part_concurrency", self.part_concurrency, 1, 64, "")

    @classmethod
    def from_options(cls, storage_options: dict | None) -> tuple[LargeObjects, dict]:
        """(the options of this module, the remaining storage options for fsspec).

        Every backend takes them, so one ``storage_options`` works on any store URL."""
        rest = dict(storage_options or {})
        mine = {name: rest.pop(name) for name in OPTIONS if name in rest}
        return cls(**mine), rest

    def is_large(self, size: int) -> bool:
        """Whether an object of ``size`` bytes moves in parts."""
        return size > self.multipart_threshold

    def ranges(self, start: int, total: int) -> list[tuple[int, int]]:
        """[start, end) byte ranges of ``part_size`` covering ``[start, total)``."""
        return [(a, min(a + self.part_size, total)) for a in range(start, total, self.part_size)]


def _check(name: str, value: Any, low: int, high: int | None, why: str) -> None:
    """One-line error naming the storage option and what is allowed."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if ok and (high is None or value <= high):
        return
    allowed = f">= {low}" if high is None else f"between {low} and {high}"
    because = f" ({why})" if why else ""
    raise ValueError(f"storage_options.{name} must be an integer {allowed}{because}, "
                     f"got {value!r}")


@dataclass
class Tally:
    """Counting and retrying the requests of one large object: the store's retry
    policy, traffic counter and name, the key as counted, and its URL for logs."""

    retry: RetryPolicy
    traffic: TrafficCounter
    tkey: str
    url: str
    name: str = ""

    async def retrying(self, op: str, what: str, fn: Callable[[int], Awaitable[T]]) -> T:
        """``await fn(attempt)`` until it succeeds, retrying transient errors under
        the store's `RetryPolicy` (its ``async_retrying``: the same attempts, equal
        jitter backoff and `TransientStoreError` as every store operation).

        Every failed attempt counts as an ``op`` request, every retry as a retry,
        logged like the store's. The final failure is a `TransientStoreError` with
        no exception chain, so that the store's whole-object retry around it (which
        follows causes) does not start the object over."""
        retrying = self.retry.async_retrying(
            describe=lambda _exc: f"{what} of {self.url}",
            before_sleep=lambda state: self._before_retry(op, what, state),
            chain=False,
        )
        async for attempt in retrying:
            with attempt:
                try:
                    return await fn(attempt.retry_state.attempt_number)
                except Exception:
                    self.traffic.record(op, self.tkey)
                    raise
        raise AssertionError("unreachable")  # pragma: no cover - tenacity returns or raises

    def _before_retry(self, op: str, what: str, state: RetryCallState) -> None:
        self.traffic.record_retry(op, self.tkey)
        log_retry(log, self.name, f"{what} of {self.url}", self.retry.attempts, state)


async def _bounded(limit: int, coros: list[Awaitable[T]]) -> list[T]:
    """Await ``coros`` with at most ``limit`` running; the first error cancels the
    rest (so an abort does not race parts still uploading) and is raised."""
    gate = asyncio.Semaphore(limit)

    async def one(coro: Awaitable[T]) -> T:
        async with gate:
            return await coro

    tasks = [asyncio.ensure_future(one(c)) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for coro in coros:  # those cancelled before they started were never awaited
            if asyncio.iscoroutine(coro):
                coro.close()
        raise


# -- uploads --------------------------------------------------------------------------


class PartBody(io.RawIOBase):
    """A read-only file over a memoryview slice, for botocore's ``Body``: botocore
    and aiohttp take bytes or an ``io.IOBase`` file, not a memoryview, and
    ``bytes(view)`` would copy the part. Reads hand out chunks (aiohttp sends 64 KiB
    at a time); seeks let botocore checksum the part and then send it."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view, 0

    def __len__(self) -> int:
        return len(self._view)

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n is None or n < 0 else min(len(self._view), self._pos + n)
        out = self._view[self._pos:end].tobytes()
        self._pos = end
        return out

    def readinto(self, out: Any) -> int:
        n = min(len(out), len(self._view) - self._pos)
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._view)}[whence]
        self._pos = max(0, min(len(self._view), base + pos))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


async def upload(fs: Any, path: str, data: bytes | bytearray | memoryview,
                 opts: LargeObjects, tally: Tally) -> None:
    """Write ``data`` at ``path`` as an S3 multipart upload (see the module
    docstring): the stored object is byte for byte what one PUT would store."""
    view = memoryview(data).cast("B")
    bucket, key, _ = fs.split_path(path)
    ranges = opts.ranges(0, len(view))
    if len(ranges) > MAX_PARTS:
        raise ValueError(f"{tally.url}: {len(view)} bytes need {len(ranges)} parts of "
                         f"storage_options.part_size={opts.part_size}; S3 allows {MAX_PARTS}")

    async def create(_attempt: int) -> str:
        out = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
        return out["UploadId"]

    upload_id = await tally.retrying("put", "create multipart upload", create)
    tally.traffic.record("put", tally.tkey)

    async def part(number: int, start: int, end: int) -> dict[str, Any]:
        async def send(_attempt: int) -> str:
            out = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id,
                                    PartNumber=number, Body=PartBody(view[start:end]))
            return out["ETag"]

        etag = await tally.retrying("put", f"part {number}", send)
        tally.traffic.record("put", tally.tkey, up=end - start)
        return {"PartNumber": number, "ETag": etag}

    async def complete(attempt: int) -> None:
        try:
            await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key,
                              UploadId=upload_id, MultipartUpload={"Parts": parts})
        except FileNotFoundError:
            # NoSuchUpload after a completion whose answer was lost: it is done if
            # the object is there with our size
            if attempt == 1 or await _size(fs, bucket, key) != len(view):
                raise

    try:
        parts = await _bounded(opts.part_concurrency,
                               [part(i + 1, a, b) for i, (a, b) in enumerate(ranges)])
        await tally.retrying("put", "complete multipart upload", complete)
    except BaseException:
        await _abort(fs, bucket, key, upload_id, tally)
        raise
    fs.invalidate_cache(path)
    tally.traffic.record("put", tally.tkey, stored=True, size=len(view))


async def _abort(fs: Any, bucket: str, key: str, upload_id: str, tally: Tally) -> None:
    """Abort the upload (its parts are billed storage until then); a failed abort
    is logged, never raised over the error that caused it."""

    async def abort(_attempt: int) -> None:
        await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)

    try:
        await tally.retrying("delete", "abort multipart upload", abort)
        tally.traffic.record("delete", tally.tkey)
    except Exception as exc:
        log.error("store %s: could not abort multipart upload %s of %s: %s (it stays "
                  "until a lifecycle rule removes it)", tally.name or "-", upload_id,
                  tally.url, exc)


async def _size(fs: Any, bucket: str, key: str) -> int | None:
    try:
        head = await fs._call_s3("head_object", Bucket=bucket, Key=key)
    except FileNotFoundError:
        return None
    return int(head["ContentLength"])


# -- reads ------------------------------------------------------------------------------


async def read(fs: Any, path: str, opts: LargeObjects, tally: Tally,
               head: bytes | None = None) -> bytes | bytearray:
    """The object at ``path``: one GET if it is no larger than the threshold, else
    parallel ranged GETs into one preallocated ``bytearray`` (module docstring).

    ``head``: the object's first bytes, if the caller read them already (with
    s3fs's sync ``cat_file``). That first request is the caller's to retry and
    count (it is the store's ``get``); the ranges after it are retried here, one by
    one, and the HEAD that gives the size counts as a ``size``."""
    first = opts.multipart_threshold
    if head is None:
        try:
            head = await fs._cat_file(path, start=0, end=first)
        except OSError as exc:
            if not _invalid_range(exc):
                raise
            return await fs._cat_file(path)  # an empty object has no byte 0
    if len(head) < first:
        return head
    bucket, key, _ = fs.split_path(path)

    async def size(_attempt: int) -> int | None:
        return await _size(fs, bucket, key)

    total = await tally.retrying("size", "HEAD", size)
    tally.traffic.record("size", tally.tkey)
    if total is None or total < len(head):
        raise FileNotFoundError(f"{tally.url} was replaced while it was read")
    if total == len(head):
        return head
    buf = bytearray(total)
    view = memoryview(buf)
    view[:first] = head
    del head

    async def fetch(start: int, end: int) -> None:
        async def attempt(_number: int) -> None:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key,
                                     Range=f"bytes={start}-{end - 1}")
            async with resp["Body"] as stream:
                await _read_into(stream, view[start:end], tally.url)

        await tally.retrying("get", f"bytes {start}-{end - 1}", attempt)
        tally.traffic.record("get", tally.tkey)  # its bytes count with the first request

    await _bounded(opts.part_concurrency, [fetch(a, b) for a, b in opts.ranges(first, total)])
    return buf


def first_bytes(fs: Any, path: str, opts: LargeObjects) -> bytes:
    """The first ``multipart_threshold`` bytes of the object at ``path`` (all of a
    smaller one) with s3fs's sync ``cat_file``: the first request of `read`."""
    try:
        return fs.cat_file(path, start=0, end=opts.multipart_threshold)
    except OSError as exc:
        if not _invalid_range(exc):
            raise
        return fs.cat_file(path)  # an empty object has no byte 0


async def _read_into(stream: Any, out: memoryview, url: str) -> None:
    """Fill ``out`` from a response body, 1 MiB at most at a time: aiohttp hands a
    read its buffered chunks joined into one new ``bytes`` of up to the size asked,
    and allocations of many MiB that are freed at once stay in the allocator's
    arenas: reads of many MiB at a time left a large read's peak RSS well above the
    object's size (measured: docs/design.md, "Facts about the libraries that the
    code relies on")."""
    pos = 0
    while pos < len(out):
        n = await stream.readinto(out[pos:pos + MIB])
        if n == 0:
            raise OSError(errno.ECONNRESET, f"{url}: body ended after {pos} of {len(out)} bytes")
        pos += n


def _invalid_range(exc: BaseException) -> bool:
    """S3's 416 InvalidRange (a range read of an empty object)."""
    current: BaseException | None = exc
    for _ in range(8):
        if current is None:
            return False
        if isinstance(current, ClientError):
            err = current.response.get("Error", {})
            status = current.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return err.get("Code") in ("InvalidRange", "416") or status == 416
        current = current.__cause__ or current.__context__
    return False


def run(fs: Any, coro: Awaitable[T]) -> T:
    """Run one of this module's coroutines on s3fs's IO loop from a plain thread."""

    async def wrapped() -> T:
        return await coro

    return sync(fs.loop, wrapped)


def gather(fs: Any, coros: list[Awaitable[Any]], limit: int) -> list[Any]:
    """Run coroutines on s3fs's IO loop, at most ``limit`` at once, returning each
    result or exception in order (`ObjectStore`'s batches)."""

    async def all_of() -> list[Any]:
        gate = asyncio.Semaphore(limit)

        async def one(coro: Awaitable[Any]) -> Any:
            async with gate:
                return await coro

        return await asyncio.gather(*(one(c) for c in coros), return_exceptions=True)

    return sync(fs.loop, all_of)
