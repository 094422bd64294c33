"""One small key/value API over every store the exchange runs on.

The bucket is the only channel between regions (docs/design.md, principle 1), and
the same code must run on a laptop and across clouds (principle 5). `ObjectStore` is the
narrow waist that makes both true: the exchange protocol above it only ever puts,
gets, lists and create-only-writes keys, and the three backends below it behave the
same way:

- ``s3://bucket/prefix``: S3, MinIO, or any S3-compatible server, through s3fs.
  Create-only writes send ``If-None-Match: *``.
- ``file:///abs/path`` or a plain path: a local or shared directory. Writes go to a
  temp file in the same directory and are renamed (put) or hard-linked
  (create-only) into place, so nobody ever reads a half-written object.
- ``memory://root``: fsspec's process-global memory filesystem, for tests that run
  several workers as threads of one process.

Every operation retries transient faults (5xx, throttling, connection resets)
under a `RetryPolicy` (storage/retry.py, on tenacity), then raises
`TransientStoreError`; every attempt is counted in a `TrafficCounter`, because
bytes moved are a result the project reports. Opening a URL and the rules for keys
are in storage/backends.py. Nothing here imports torch.

Example::

    store = ObjectStore("s3://my-bucket/runs", name="worker-eu")
    run = store.child("run-42")
    if run.put_if_absent("run.json", manifest_bytes):
        ...  # we created the run
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import nullcontext, suppress
from typing import Any, TypeVar

import fsspec
from tenacity import RetryCallState

from storage.backends import (
    MEMORY_LOCK,
    TMP_MARK,
    bucket_found,
    file_temp,
    is_precondition_failed,
    open_backend,
    s3_delete,
    validate_key,
)
from storage.errors import ObjectMissing, TransientStoreError
from storage.multipart import LargeObjects, Tally, first_bytes, gather, read, run, upload
from storage.retry import RetryPolicy, is_transient, log_retry
from storage.traffic import TrafficCounter

log = logging.getLogger(__name__)

T = TypeVar("T")
#: How often a memory listing is copied again when another writer changed the dict.
_MEMORY_LIST_TRIES = 50


class ObjectStore:
    """Keys and bytes on memory://, file:// (or a plain path) or s3:// storage.

    Safe to use from several threads at once. ``name`` (e.g. the worker id) appears
    in log lines. See the module docstring for the guarantees of each backend.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict | None = None,
        retry: RetryPolicy | None = None,
        traffic: TrafficCounter | None = None,
        name: str = "",
    ) -> None:
        self.large, storage_options = LargeObjects.from_options(storage_options)
        backend = open_backend(url, storage_options)
        self._kind, self.url, self._fs, self._root = (
            backend.kind, backend.url, backend.fs, backend.root
        )
        self.retry = retry or RetryPolicy()
        self.traffic = traffic if traffic is not None else TrafficCounter()
        self.name = name
        self._traffic_prefix = ""

    # -- views ------------------------------------------------------------------

    def child(self, prefix: str) -> ObjectStore:
        """A view rooted at ``url/prefix`` that shares this store's filesystem,
        retry policy and traffic counter (its keys are counted under the full key
        from this store's root, so one counter reads the same from every view)."""
        prefix = validate_key(prefix.rstrip("/"), what="prefix")
        view = object.__new__(ObjectStore)
        view._kind = self._kind
        view.url = f"{self.url}/{prefix}"
        view.retry, view.large = self.retry, self.large
        view.traffic = self.traffic
        view.name = self.name
        view._traffic_prefix = f"{self._traffic_prefix}{prefix}/"
        view._fs = self._fs
        view._root = self._join(prefix)
        return view

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem underneath (for zarr and other fsspec users)."""
        return self._fs

    def fs_path(self, key: str) -> str:
        """The path of ``key`` in `fs` (no protocol), for fsspec-based readers."""
        return self._join(validate_key(key))

    def full_url(self, key: str) -> str:
        """The URL of ``key``, without credentials; used in every error message."""
        return f"{self.url}/{validate_key(key)}"

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r}, name={self.name!r})"

    @property
    def bucket(self) -> str | None:
        """The S3 bucket of this store (None for file:// and memory://)."""
        return self._root.split("/", 1)[0] if self._kind == "s3" else None

    def bucket_exists(self) -> bool:
        """False only if the store's S3 bucket is known not to exist (True for the
        other backends); see `storage.backends.bucket_found`."""
        if self._kind != "s3":
            return True
        return self._run("head_bucket", "", lambda _attempt: bucket_found(self._fs, self.bucket))

    # -- single objects -----------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key``, replacing any object there.

        The protocol writes every key once (docs/design.md, principle 2), so "replace" only
        ever happens when a retry repeats a write that may already have landed.
        """
        path = self._join(validate_key(key))
        if self._kind == "s3" and self.large.is_large(len(data)):  # in parts, not copied
            return run(self._fs, upload(self._fs, path, data, self.large, self._tally(path)))
        data = bytes(data)
        self._run("put", key, lambda _attempt: self._put_raw(path, data))
        self.traffic.record("put", self._tkey(key), up=len(data), stored=True)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data`` only if no object is there; True if we created it.

        This is the commit primitive: of several writers racing on one key exactly
        one gets True, and the bytes of that one stay. If an attempt failed in a way
        that may still have created the object (a reset after the body was sent)
        and the retry then finds the key taken, the stored bytes are compared with
        ``data``: equal bytes mean it was our own write, and we return True.
        """
        path = self._join(validate_key(key))
        data = bytes(data)

        def create(attempt: int) -> bool:
            created = self._create_raw(path, data)
            if not created and attempt > 1:
                return self._read_raw(path) == data
            return created

        created = self._run("put_if_absent", key, create)
        self.traffic.record("put_if_absent", self._tkey(key), up=len(data), stored=created)
        return created

    def get(self, key: str) -> bytes:
        """The bytes at ``key``; `ObjectMissing` (naming the URL) if there are none."""
        path = self._join(validate_key(key))
        try:
            data = self._run("get", key, lambda _attempt: self._read_raw(path))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise ObjectMissing(f"no object at {self.full_url(key)}") from exc
        self.traffic.record("get", self._tkey(key), down=len(data), fetched=True)
        return data

    def exists(self, key: str) -> bool:
        """True if an object (not merely a prefix) is stored at ``key``."""
        path = self._join(validate_key(key))
        found = self._run("exists", key, lambda _attempt: self._size_raw(path) is not None)
        self.traffic.record("exists", self._tkey(key))
        return found

    def size(self, key: str) -> int:
        """Size in bytes of the object at ``key``; `ObjectMissing` if there is none."""
        path = self._join(validate_key(key))
        size = self._run("size", key, lambda _attempt: self._size_raw(path))
        self.traffic.record("size", self._tkey(key))
        if size is None:
            raise ObjectMissing(f"no object at {self.full_url(key)}")
        return size

    # -- many objects -------------------------------------------------------------

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        """The bytes of every key in ``keys``, fetched concurrently on S3.

        Raises `ObjectMissing` naming the first missing key. Only the keys that hit
        a transient error are fetched again, so one throttled chunk does not cost a
        second download of all the others.
        """
        keys = list(dict.fromkeys(validate_key(k) for k in keys))
        paths = {k: self._join(k) for k in keys}
        try:
            out = self._run_many(
                "get",
                keys,
                lambda todo: self._read_many_raw([paths[k] for k in todo]),
            )
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            missing = getattr(exc, "store_key", "?")
            raise ObjectMissing(f"no object at {self.url}/{missing}") from exc
        for key in keys:
            self.traffic.record("get", self._tkey(key), down=len(out[key]), fetched=True)
        return {k: out[k] for k in keys}

    def put_many(self, items: dict[str, bytes]) -> None:
        """Write every ``key: data`` pair, concurrently on S3 (overwrite allowed)."""
        data = {validate_key(k): bytes(v) for k, v in items.items()}
        for key in [k for k, v in data.items() if self._kind == "s3" and self.large.is_large(len(v))]:
            self.put(key, data.pop(key))  # in parts, each in parallel
        paths = {k: self._join(k) for k in data}
        self._run_many(
            "put",
            list(data),
            lambda todo: self._put_many_raw({paths[k]: data[k] for k in todo}),
        )
        for key, body in data.items():
            self.traffic.record("put", self._tkey(key), up=len(body), stored=True)

    def list(self, prefix: str = "") -> list[str]:
        """All keys under ``prefix/`` (recursively), relative to this store's root,
        sorted; ``[]`` if there are none. ``""`` lists the whole store."""
        return sorted(self._listing(prefix, detail=False))

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """Every key under ``prefix/`` with its size in bytes, from one listing (what
        ``diloco status`` and ``diloco gc`` add up); ``{}`` if there are none."""
        return dict(sorted(self._listing(prefix, detail=True).items()))

    def _listing(self, prefix: str, *, detail: bool) -> dict[str, int]:
        """{key: size} (size 0 unless ``detail``) of the objects under ``prefix/``."""
        prefix = prefix.rstrip("/")
        if prefix:
            validate_key(prefix, what="prefix")
        base = self._join(prefix) if prefix else self._root
        want = f"{prefix}/" if prefix else ""
        found = self._run("list", want, lambda _attempt: self._find_raw(base, detail))
        self.traffic.record("list", self._tkey(want))
        root = self._root.rstrip("/") + "/"
        keys = {}
        for path in found:
            info = found[path] if detail else {}
            key = path[len(root):]
            if (path.startswith(root) and key.startswith(want) and not key.endswith("/")
                    and TMP_MARK not in key and info.get("type", "file") == "file"):
                keys[key] = int(info.get("size") or 0)
        return keys

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix/``. Missing prefixes are fine.

        The prefix may not be empty: wiping a whole store takes an explicit choice
        of what to wipe (delete from the parent view instead).
        """
        prefix = validate_key(prefix.rstrip("/"), what="prefix")
        keys = self.list(prefix)
        if not keys:
            return
        paths = [self._join(k) for k in keys]
        base = self._join(prefix)
        self._run("delete", f"{prefix}/", lambda _attempt: self._delete_raw(base, paths))
        self.traffic.record("delete", self._tkey(f"{prefix}/"))

    def delete(self, key: str) -> None:
        """Delete one object. A missing key is fine (deletes are retried)."""
        key = validate_key(key)
        path = self._join(key)

        def remove(_attempt: int) -> None:
            if self._kind == "s3":
                s3_delete(self._fs, [path])
                return
            with suppress(FileNotFoundError):
                self._fs.rm(path)

        self._run("delete", key, remove)
        self.traffic.record("delete", self._tkey(key))

    # -- retries ------------------------------------------------------------------

    def _run(self, op: str, key: str, fn: Callable[[int], T]) -> T:
        """Call ``fn(attempt)`` until it succeeds, retrying transient errors under
        `retry` (tenacity does the loop, the backoff and the giving up).

        Every failed attempt counts as a request (the caller counts the one that
        succeeds, with its bytes). Non-transient errors propagate unchanged, with a
        note naming the URL, so callers can still tell FileNotFoundError from
        PermissionError.
        """
        url = f"{self.url}/{key}"
        retrying = self.retry.retrying(
            describe=lambda _exc: f"{op} {url}",
            before_sleep=lambda state: self._before_retry(op, [key], state),
        )
        try:
            for attempt in retrying:
                with attempt:
                    try:
                        with self._backend_lock():
                            return fn(attempt.retry_state.attempt_number)
                    except Exception:
                        self.traffic.record(op, self._tkey(key))
                        raise
        except TransientStoreError:
            raise
        except Exception as exc:
            exc.add_note(f"while {op} {url}")
            raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _run_many(
        self,
        op: str,
        keys: list[str],
        fn: Callable[[list[str]], list[Any]],
    ) -> dict[str, Any]:
        """Like `_run` for a batch: ``fn(todo)`` returns one result or exception per
        key, and only the keys that failed transiently are tried again. A key's
        non-transient error is raised at once, tagged with ``store_key``; the
        retries and the final `TransientStoreError` name the first failed key."""
        done: dict[str, Any] = {}
        todo = list(keys)
        failed: list[tuple[str, Exception]] = []

        def one_attempt(number: int) -> None:
            nonlocal todo
            with self._backend_lock():
                results = fn(todo)
            failed.clear()
            for key, result in zip(todo, results, strict=True):
                if isinstance(result, BaseException):
                    result.store_key = key  # type: ignore[attr-defined]
                    failed.append((key, result))
                    self.traffic.record(op, self._tkey(key))
                else:
                    done[key] = result
            last = number >= self.retry.attempts
            for _key, exc in failed:
                if last or not is_transient(exc):
                    raise exc  # tenacity re-raises it, or gives up on it
            if failed:
                todo = [k for k, _ in failed]
                raise failed[0][1]

        retrying = self.retry.retrying(
            describe=lambda exc: f"{op} {self.url}/{exc.store_key}",  # type: ignore[attr-defined]
            before_sleep=lambda state: self._before_retry(op, [k for k, _ in failed], state),
            # an error of the whole batch (not of one key) is not ours to retry
            retry_on=lambda exc: hasattr(exc, "store_key") and is_transient(exc),
        )
        try:
            for attempt in retrying:
                with attempt:
                    one_attempt(attempt.retry_state.attempt_number)
        except Exception as exc:
            if hasattr(exc, "store_key") and not isinstance(exc, TransientStoreError):
                exc.add_note(f"while {op} {self.url}/{exc.store_key}")
            raise
        return done

    def _before_retry(self, op: str, keys: list[str], state: RetryCallState) -> None:
        """Count and log one retry of ``keys`` (tenacity's ``before_sleep``). Logs
        name the URL and the error, never the storage options (they hold the
        credentials)."""
        for key in keys:
            self.traffic.record_retry(op, self._tkey(key))
        more = f" (and {len(keys) - 1} more keys)" if len(keys) > 1 else ""
        log_retry(log, self.name, f"{op} {self.url}/{keys[0]}{more}", self.retry.attempts, state)

    # -- backends -----------------------------------------------------------------

    def _join(self, key: str) -> str:
        return f"{self._root.rstrip('/')}/{key}"

    def _tkey(self, key: str) -> str:
        return f"{self._traffic_prefix}{key}"

    def _backend_lock(self) -> Any:
        return MEMORY_LOCK if self._kind == "memory" else nullcontext()

    def _put_raw(self, path: str, data: bytes) -> None:
        if self._kind == "file":
            with file_temp(path, data) as tmp:
                os.replace(tmp, path)
        else:
            self._fs.pipe_file(path, data)

    def _create_raw(self, path: str, data: bytes) -> bool:
        if self._kind == "s3":
            try:
                self._fs.pipe_file(path, data, mode="create")
            except Exception as exc:
                if is_precondition_failed(exc):
                    return False
                raise
            return True
        if self._kind == "file":
            with file_temp(path, data) as tmp:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    return False
            return True
        # memory: the caller holds MEMORY_LOCK, so check-then-write is atomic
        if self._fs.isfile(path):
            return False
        self._fs.pipe_file(path, data)
        return True

    def _read_raw(self, path: str) -> bytes:
        if self._kind != "s3":
            return self._fs.cat_file(path)
        head = first_bytes(self._fs, path, self.large)
        return run(self._fs, read(self._fs, path, self.large, self._tally(path), head))

    def _tally(self, path: str) -> Tally:
        key = path[len(self._root.rstrip("/")) + 1:]
        return Tally(self.retry, self.traffic, self._tkey(key), self.full_url(key), self.name)

    def _size_raw(self, path: str) -> int | None:
        """Size of the object at ``path``, or None if there is none (one HEAD on S3,
        where fs.info would add a listing to tell a missing key from a prefix)."""
        if self._kind == "s3":
            bucket, key, _ = self._fs.split_path(path)
            try:
                head = self._fs.call_s3("head_object", Bucket=bucket, Key=key)
            except FileNotFoundError:
                return None
            return int(head["ContentLength"])
        try:
            info = self._fs.info(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return int(info["size"]) if info.get("type") == "file" else None

    def _find_raw(self, base: str, detail: bool = False) -> Any:
        for _ in range(_MEMORY_LIST_TRIES):
            try:
                return self._fs.find(base, detail=True) if detail else list(self._fs.find(base))
            except (FileNotFoundError, NotADirectoryError):
                return {} if detail else []
            except RuntimeError as exc:
                # fsspec's memory listing copies the process-wide dict; a writer that
                # does not go through this class (torch DCP's fsspec writer, zarr)
                # can change it meanwhile. The copy is retried, never half-used.
                if self._kind != "memory" or "changed size during iteration" not in str(exc):
                    raise
        raise RuntimeError(f"listing {base} in memory kept changing under it")

    def _delete_raw(self, base: str, paths: list[str]) -> None:
        try:
            if self._kind == "s3":
                s3_delete(self._fs, paths)
            else:
                self._fs.rm(base, recursive=True)
        except FileNotFoundError:
            pass

    def _read_many_raw(self, paths: list[str]) -> list[bytes | Exception]:
        if self._kind == "s3":
            return self._s3_gather([read(self._fs, p, self.large, self._tally(p)) for p in paths])
        return [_capture(lambda p=p: self._read_raw(p)) for p in paths]

    def _put_many_raw(self, items: dict[str, bytes]) -> list[None | Exception]:
        if self._kind == "s3":
            return self._s3_gather([self._fs._pipe_file(p, d) for p, d in items.items()])
        return [_capture(lambda p=p, d=d: self._put_raw(p, d)) for p, d in items.items()]

    def _s3_gather(self, coros: list[Any]) -> list[Any]:
        """Run s3fs coroutines on its IO loop, at most ``max_concurrency`` at once,
        returning each result or exception in order."""
        return gather(self._fs, coros, max(1, int(getattr(self._fs, "max_concurrency", 10))))


def _capture(fn: Callable[[], T]) -> T | Exception:
    try:
        return fn()
    except Exception as exc:
        return exc

