"""One small key/value API over every store the exchange runs on.

The bucket is the only channel between regions (DESIGN.md, principle 1), and the
same code must run on a laptop and across clouds (principle 5). `ObjectStore` is the
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
under a `RetryPolicy`, then raises `TransientStoreError`; every operation is counted
in a `TrafficCounter`, because bytes moved are a result the project reports.
Nothing here imports torch.

Example::

    store = ObjectStore("s3://my-bucket/runs", name="worker-eu")
    run = store.child("run-42")
    if run.put_if_absent("run.json", manifest_bytes):
        ...  # we created the run
"""

from __future__ import annotations

import asyncio
import errno
import http.client
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote

import fsspec
from botocore.exceptions import ClientError, HTTPClientError
from botocore.parsers import ResponseParserError
from fsspec.asyn import sync as fsspec_sync

from storage.errors import ObjectMissing, TransientStoreError
from storage.traffic import TrafficCounter

try:  # aiobotocore speaks aiohttp; its payload/connection errors are transient
    from aiohttp import ClientConnectionError, ClientPayloadError

    _AIOHTTP_TRANSIENT: tuple[type[BaseException], ...] = (
        ClientConnectionError,
        ClientPayloadError,
    )
except ImportError:  # pragma: no cover - aiohttp comes with aiobotocore
    _AIOHTTP_TRANSIENT = ()

log = logging.getLogger(__name__)

SCHEMES = ("memory", "file", "s3")

#: S3 error codes worth another attempt. SlowDown/ServiceUnavailable are 503s,
#: InternalError a 500, the two 409s are documented by AWS as "retry the upload".
TRANSIENT_S3_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "ConditionalRequestConflict",
        "OperationAborted",
    }
)

#: errno values that mean "the network or the server hiccupped". EBUSY and
#: EREMOTEIO are what s3fs.errors.translate_boto_error turns SlowDown/503 and
#: InternalError/500 into when it drops the botocore cause.
TRANSIENT_ERRNOS = frozenset(
    {
        errno.ECONNRESET,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.ECONNREFUSED,
        errno.EAGAIN,
        errno.EBUSY,
        getattr(errno, "EREMOTEIO", errno.EIO + 1000),
    }
)

# Decisive exception types. OSError subclasses first: they are what s3fs makes of
# 404/403/412, and what a retry can never fix.
_NEVER_TRANSIENT: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    PermissionError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    ValueError,
    TypeError,
)
# ConnectionError covers ConnectionResetError/RefusedError/AbortedError and
# BrokenPipeError; TimeoutError is asyncio.TimeoutError and fsspec's FSTimeoutError;
# HTTPClientError covers botocore's EndpointConnectionError, ConnectionClosedError,
# ReadTimeoutError and ConnectTimeoutError, which s3fs lets through untranslated.
# ResponseParserError: throttling responses sometimes carry broken XML (s3fs #484).
_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    ConnectionError,
    TimeoutError,
    HTTPClientError,
    ResponseParserError,
    http.client.IncompleteRead,
    *_AIOHTTP_TRANSIENT,
)

# fsspec's memory filesystem is one dict per process; this lock makes create-only
# writes atomic and keeps listings from iterating a dict another thread is changing.
_MEMORY_LOCK = threading.RLock()

# Marker in the names of in-flight temp files of the file backend; keys may not
# contain it, and listings skip it.
_TMP_MARK = "~tmp~"
_GLOB_CHARS = frozenset("*?[]")

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry transient store errors.

    Attempt ``i`` (counting from 0) that fails waits about
    ``min(max_delay, base_delay * 2**i)`` seconds, scaled by a random factor in
    [0.5, 1] so that workers that failed together do not retry together.
    """

    attempts: int = 6
    base_delay: float = 0.2
    max_delay: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("RetryPolicy delays must be >= 0")

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failed attempt (1-based)."""
        ceiling = min(self.max_delay, self.base_delay * 2 ** (failures - 1))
        return ceiling * random.uniform(0.5, 1.0)


def _client_error_verdict(exc: BaseException) -> bool | None:
    response = getattr(exc, "response", None)
    if not isinstance(exc, ClientError) or not isinstance(response, dict):
        return None
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    if code in TRANSIENT_S3_CODES or code in ("500", "502", "503", "504"):
        return True
    # 501 NotImplemented is a server that lacks a feature: retrying cannot help.
    return status == 429 or (status >= 500 and status != 501)


def is_transient(exc: BaseException) -> bool:
    """True if ``exc`` is a fault worth retrying (5xx, throttling, a dropped
    connection), False for anything a retry cannot fix (missing key, access
    denied, precondition failed, bad request).

    Walks the exception and its causes in order; the first one that says
    something decides. That matters for s3fs, which re-raises botocore's
    ``ClientError`` as an ``OSError`` whose ``__cause__`` is the original.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 16:
        seen.add(id(current))
        if isinstance(current, _NEVER_TRANSIENT):
            return False
        verdict = _client_error_verdict(current)
        if verdict is not None:
            return verdict
        if isinstance(current, _TRANSIENT_TYPES):
            return True
        if isinstance(current, OSError) and current.errno in TRANSIENT_ERRNOS:
            return True
        current = current.__cause__ or current.__context__
    return False


def _is_precondition_failed(exc: BaseException) -> bool:
    """A create-only write found the key present: S3 answers 412 PreconditionFailed,
    which s3fs turns into FileExistsError (or OSError(EINVAL) when the response
    lacks the Condition field)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, FileExistsError):
            return True
        response = getattr(current, "response", None)
        if isinstance(current, ClientError) and isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return code in ("PreconditionFailed", "412") or status == 412
        current = current.__cause__ or current.__context__
    return False


def validate_key(key: str, *, what: str = "key") -> str:
    """Reject keys that could escape the store root or be misread by fsspec.

    Keys are '/'-separated relative paths: no leading '/', no empty, '.' or '..'
    segments, no glob characters (fsspec would expand them), no control characters.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"{what} must be a non-empty string, got {key!r}")
    if key.startswith("/"):
        raise ValueError(f"{what} {key!r} must be relative (no leading '/')")
    for segment in key.split("/"):
        if segment == "":
            raise ValueError(f"{what} {key!r} has an empty path segment")
        if segment in (".", ".."):
            raise ValueError(f"{what} {key!r} may not contain '{segment}' segments")
    bad = sorted({c for c in key if c in _GLOB_CHARS or ord(c) < 32 or c == "\\"})
    if bad:
        raise ValueError(f"{what} {key!r} contains forbidden characters {bad!r}")
    if _TMP_MARK in key:
        raise ValueError(f"{what} {key!r} may not contain {_TMP_MARK!r} (temp-file marker)")
    return key


def _split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """``s3://KEY:SECRET@bucket/p`` -> (``s3://bucket/p``, KEY, SECRET)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url, None, None
    netloc, slash, path = rest.partition("/")
    userinfo, at, host = netloc.rpartition("@")
    if not at:
        return url, None, None
    key, colon, secret = userinfo.partition(":")
    return (
        f"{scheme}://{host}{slash}{path}",
        unquote(key) or None,
        unquote(secret) if colon else None,
    )


def _strip_credentials(url: str) -> str:
    return _split_credentials(url)[0]


def _clean_url(url: str) -> str:
    """Without credentials or trailing slashes (``memory://`` stays as it is)."""
    url = _strip_credentials(url)
    scheme, sep, rest = url.partition("://")
    if sep:
        return f"{scheme}://{rest.rstrip('/')}"
    return url.rstrip("/") or url


def _scheme_of(url: str) -> str:
    if "://" not in url:
        return "file"
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise ValueError(
            f"unsupported store URL {_strip_credentials(url)!r}: scheme {scheme!r} is not "
            f"one of {', '.join(s + '://' for s in SCHEMES)} (or a plain local path)"
        )
    return scheme


def _s3_filesystem(storage_options: dict[str, Any]) -> fsspec.AbstractFileSystem:
    """An s3fs filesystem whose only retry layer is ours.

    botocore retries 5xx by itself and s3fs retries again around it; stacked under
    `RetryPolicy` that would be up to ~150 attempts, hide retries from the traffic
    counter, and make "gave up after N attempts" a lie. So botocore gets
    ``total_max_attempts=1`` (unless the caller configured retries) and s3fs's own
    loop is set to a single attempt.

    The endpoint comes from ``endpoint_url`` or ``client_kwargs``, else from
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``. botocore would read those
    itself (checked with s3fs 2026.9 / aiobotocore 3.10), but fsspec caches
    filesystem instances by their options, so an endpoint left to the environment
    would let a later store with a different environment reuse a client pointed
    at the old endpoint. Writing it into the options makes it part of the key.

    The filesystem instance is fsspec's cached one for these options, shared by all
    stores with the same options: s3fs runs its requests on its own IO thread and is
    safe to call from several threads, and one instance means one connection pool
    (``skip_instance_cache`` would open a new pool per store and leak them).
    """
    options = dict(storage_options)
    options["use_listings_cache"] = False  # listings must always be fresh
    client_kwargs = options.get("client_kwargs") or {}
    ignore_env = os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true"
    if not options.get("endpoint_url") and not client_kwargs.get("endpoint_url") and not ignore_env:
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["endpoint_url"] = endpoint
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"mode": "standard", "total_max_attempts": 1})
    options["config_kwargs"] = config
    fs = fsspec.filesystem("s3", **options)
    fs.retries = 1
    return fs


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
        if not isinstance(url, str) or not url:
            raise ValueError(f"store URL must be a non-empty string, got {url!r}")
        self._kind = _scheme_of(url)
        url, url_key, url_secret = _split_credentials(url)
        self.url = _clean_url(url)
        self.retry = retry or RetryPolicy()
        self.traffic = traffic if traffic is not None else TrafficCounter()
        self.name = name
        self._traffic_prefix = ""
        options = dict(storage_options or {})
        if self._kind == "s3":
            # credentials in the URL count, but never stay in it (or in logs)
            if url_key and not options.get("key"):
                options["key"] = url_key
            if url_secret and not options.get("secret"):
                options["secret"] = url_secret
            self._fs = _s3_filesystem(options)
            root = type(self._fs)._strip_protocol(url).rstrip("/")
            if not root:
                raise ValueError(f"store URL {self.url!r} names no bucket (s3://bucket/prefix)")
        else:
            self._fs = fsspec.filesystem(self._kind, **options)
            root = type(self._fs)._strip_protocol(url).rstrip("/")
            if self._kind == "file":
                root = os.path.abspath(root or "/")
        self._root = root

    # -- views ------------------------------------------------------------------

    def child(self, prefix: str) -> ObjectStore:
        """A view rooted at ``url/prefix`` that shares this store's filesystem,
        retry policy and traffic counter (its keys are counted under the full key
        from this store's root, so one counter reads the same from every view)."""
        prefix = validate_key(prefix.rstrip("/"), what="prefix")
        view = object.__new__(ObjectStore)
        view._kind = self._kind
        view.url = f"{self.url}/{prefix}"
        view.retry = self.retry
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

    # -- single objects -----------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key``, replacing any object there.

        The protocol writes every key once (DESIGN principle 2), so "replace" only
        ever happens when a retry repeats a write that may already have landed.
        """
        path = self._join(validate_key(key))
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
        prefix = prefix.rstrip("/")
        if prefix:
            validate_key(prefix, what="prefix")
        base = self._join(prefix) if prefix else self._root
        where = f"{prefix}/" if prefix else ""
        found = self._run("list", where, lambda _attempt: self._find_raw(base))
        self.traffic.record("list", self._tkey(where))
        root = self._root.rstrip("/") + "/"
        want = f"{prefix}/" if prefix else ""
        keys = []
        for path in found:
            if not path.startswith(root):
                continue
            key = path[len(root) :]
            if not key.startswith(want) or key.endswith("/") or _TMP_MARK in key:
                continue
            keys.append(key)
        return sorted(set(keys))

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
            with suppress(FileNotFoundError):
                self._fs.rm(path) if self._kind != "s3" else self._fs.rm([path])

        self._run("delete", key, remove)
        self.traffic.record("delete", self._tkey(key))

    # -- retries ------------------------------------------------------------------

    def _run(self, op: str, key: str, fn: Callable[[int], T]) -> T:
        """Call ``fn(attempt)`` until it succeeds, retrying transient errors.

        Every failed attempt counts as a request (the caller counts the one that
        succeeds, with its bytes). Non-transient errors propagate unchanged, with a
        note naming the URL, so callers can still tell FileNotFoundError from
        PermissionError.
        """
        for attempt in range(1, self.retry.attempts + 1):
            try:
                with self._backend_lock():
                    return fn(attempt)
            except Exception as exc:
                self.traffic.record(op, self._tkey(key))
                self._raise_if_final(op, key, attempt, exc)
                self._pause(op, key, attempt, exc)
        raise AssertionError("unreachable")  # pragma: no cover

    def _run_many(
        self,
        op: str,
        keys: list[str],
        fn: Callable[[list[str]], list[Any]],
    ) -> dict[str, Any]:
        """Like `_run` for a batch: ``fn(todo)`` returns one result or exception per
        key, and only the keys that failed transiently are tried again. A key's
        non-transient error is raised at once, tagged with ``store_key``."""
        done: dict[str, Any] = {}
        todo = list(keys)
        for attempt in range(1, self.retry.attempts + 1):
            with self._backend_lock():
                results = fn(todo)
            failed: list[tuple[str, Exception]] = []
            for key, result in zip(todo, results, strict=True):
                if isinstance(result, BaseException):
                    failed.append((key, result))
                    self.traffic.record(op, self._tkey(key))
                else:
                    done[key] = result
            for key, exc in failed:
                exc.store_key = key  # type: ignore[attr-defined]
                self._raise_if_final(op, key, attempt, exc)
            if not failed:
                return done
            for key, _ in failed[1:]:
                self.traffic.record_retry(op, self._tkey(key))
            self._pause(op, failed[0][0], attempt, failed[0][1], also=len(failed) - 1)
            todo = [k for k, _ in failed]
        raise AssertionError("unreachable")  # pragma: no cover

    def _raise_if_final(self, op: str, key: str, attempt: int, exc: Exception) -> None:
        """Re-raise ``exc`` if no retry can fix it; `TransientStoreError` if the
        attempts are used up."""
        url = f"{self.url}/{key}"
        if not is_transient(exc):
            exc.add_note(f"while {op} {url}")
            raise exc
        if attempt >= self.retry.attempts:
            raise TransientStoreError(
                f"{op} {url} failed after {self.retry.attempts} attempts; last error: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def _pause(self, op: str, key: str, attempt: int, exc: Exception, *, also: int = 0) -> None:
        """Count, log and wait out one retry. Logs name the URL and the error, never
        the storage options (they hold the credentials)."""
        delay = self.retry.delay(attempt)
        self.traffic.record_retry(op, self._tkey(key))
        more = f" (and {also} more keys)" if also else ""
        log.warning(
            "store %s: %s %s/%s%s failed (attempt %d of %d): %s: %s; retrying in %.2fs",
            self.name or "-",
            op,
            self.url,
            key,
            more,
            attempt,
            self.retry.attempts,
            type(exc).__name__,
            exc,
            delay,
        )
        time.sleep(delay)

    # -- backends -----------------------------------------------------------------

    def _join(self, key: str) -> str:
        return f"{self._root.rstrip('/')}/{key}"

    def _tkey(self, key: str) -> str:
        return f"{self._traffic_prefix}{key}"

    def _backend_lock(self) -> Any:
        return _MEMORY_LOCK if self._kind == "memory" else nullcontext()

    def _put_raw(self, path: str, data: bytes) -> None:
        if self._kind == "file":
            with _file_temp(path, data) as tmp:
                os.replace(tmp, path)
        else:
            self._fs.pipe_file(path, data)

    def _create_raw(self, path: str, data: bytes) -> bool:
        if self._kind == "s3":
            try:
                self._fs.pipe_file(path, data, mode="create")
            except Exception as exc:
                if _is_precondition_failed(exc):
                    return False
                raise
            return True
        if self._kind == "file":
            with _file_temp(path, data) as tmp:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    return False
            return True
        # memory: the caller holds _MEMORY_LOCK, so check-then-write is atomic
        if self._fs.isfile(path):
            return False
        self._fs.pipe_file(path, data)
        return True

    def _read_raw(self, path: str) -> bytes:
        return self._fs.cat_file(path)

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

    def _find_raw(self, base: str) -> list[str]:
        try:
            return list(self._fs.find(base))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _delete_raw(self, base: str, paths: list[str]) -> None:
        try:
            if self._kind == "s3":
                self._fs.rm(paths)
            else:
                self._fs.rm(base, recursive=True)
        except FileNotFoundError:
            pass

    def _read_many_raw(self, paths: list[str]) -> list[bytes | Exception]:
        if self._kind == "s3":
            return self._s3_gather([self._fs._cat_file(p) for p in paths])
        return [_capture(lambda p=p: self._read_raw(p)) for p in paths]

    def _put_many_raw(self, items: dict[str, bytes]) -> list[None | Exception]:
        if self._kind == "s3":
            return self._s3_gather([self._fs._pipe_file(p, d) for p, d in items.items()])
        return [_capture(lambda p=p, d=d: self._put_raw(p, d)) for p, d in items.items()]

    def _s3_gather(self, coros: list[Any]) -> list[Any]:
        """Run s3fs coroutines on its IO loop, at most ``max_concurrency`` at once,
        returning each result or exception in order."""
        limit = max(1, int(getattr(self._fs, "max_concurrency", 10)))

        async def gather() -> list[Any]:
            gate = asyncio.Semaphore(limit)

            async def one(coro: Any) -> Any:
                async with gate:
                    return await coro

            return await asyncio.gather(*(one(c) for c in coros), return_exceptions=True)

        return fsspec_sync(self._fs.loop, gather)


def _capture(fn: Callable[[], T]) -> T | Exception:
    try:
        return fn()
    except Exception as exc:
        return exc


@contextmanager
def _file_temp(path: str, data: bytes) -> Iterator[str]:
    """Write ``data`` to a fresh temp file beside ``path`` and yield its name; the
    temp file is removed afterwards whether or not it was renamed or linked.

    No fsync: the guarantee is against readers seeing half an object and against
    killed processes, not against power loss of the machine.
    """
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{_TMP_MARK}{uuid.uuid4().hex}"
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        yield tmp
    finally:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
