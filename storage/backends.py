"""From a store URL to an open fsspec filesystem, and the rules keys must follow.

`ObjectStore` runs on three backends (see its module docstring); this module
holds what differs between them before the first byte moves: which scheme a URL
names, the refusal of credentials in a URL or in options bound for a stored
parameter (they come from the environment), the s3fs filesystem configured so
that our retry layer is the only one, the key rules that keep every key inside
the store root, and the few pieces the file and memory backends need to make
writes atomic.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import fsspec
from botocore.exceptions import ClientError

SCHEMES = ("memory", "file", "s3")

#: Marker in the names of in-flight temp files of the file backend; keys may not
#: contain it, and listings skip it.
TMP_MARK = "~tmp~"
_GLOB_CHARS = frozenset("*?[]")

#: fsspec's memory filesystem is one dict per process; this lock makes create-only
#: writes atomic and keeps listings from iterating a dict another thread is changing.
MEMORY_LOCK = threading.RLock()


@dataclass(frozen=True)
class Backend:
    """An opened store URL: the scheme, the URL as shown in messages (no
    credentials), the fsspec filesystem and the root path inside it."""

    kind: str
    url: str
    fs: fsspec.AbstractFileSystem
    root: str


def open_backend(url: str, storage_options: dict | None = None) -> Backend:
    """Open ``url`` (``s3://``, ``file://``, ``memory://`` or a plain path).

    A URL carrying credentials (``s3://KEY:SECRET@bucket/p``, ``?secret=...``) is
    refused (`CredentialsInURL`): a run's URL is written into the bucket, onto
    command lines, into MLflow and Prefect, and printed. Credentials come from the
    environment (``AWS_*``) or from ``storage_options``.
    """
    if not isinstance(url, str) or not url:
        raise ValueError(f"store URL must be a non-empty string, got {url!r}")
    refuse_credentials(url)
    kind = _scheme_of(url)
    shown = _clean_url(url)
    options = dict(storage_options or {})
    if kind == "s3":
        fs = s3_filesystem(options)
        root = type(fs)._strip_protocol(url).rstrip("/")
        if not root:
            raise ValueError(f"store URL {shown!r} names no bucket (s3://bucket/prefix)")
    else:
        fs = fsspec.filesystem(kind, **options)
        root = type(fs)._strip_protocol(url).rstrip("/")
        if kind == "file":
            root = os.path.abspath(root or "/")
    return Backend(kind=kind, url=shown, fs=fs, root=root)


# -- credentials: from the environment, never in a URL or a stored parameter ----------

#: What to do instead, in every refusal.
USE_THE_ENVIRONMENT = (
    "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) in the "
    "environment instead, and AWS_ENDPOINT_URL_S3 for a non-AWS endpoint"
)

#: Option or query-parameter names that hold a credential: key, secret, token,
#: password and their spellings (aws_secret_access_key, session_token, ...).
_SECRET_NAME = re.compile(
    r"^(key|secret|token|password|passwd|pwd|sig|signature)$"
    r"|secret|token|passw|access_key|credential|api_?key|signature",
    re.IGNORECASE,
)


class CredentialsInURL(ValueError):
    """A store URL carries credentials (user info, or a query parameter such as
    ``secret``); the message names the URL without them and the variables to use."""


def is_secret_name(name: str) -> bool:
    """Whether an option or query parameter called ``name`` holds a credential."""
    return bool(_SECRET_NAME.search(str(name)))


def refuse_credentials(url: str, *, what: str = "store URL") -> str:
    """``url`` unchanged if it carries no credentials; else `CredentialsInURL`, one
    line naming ``what`` (the field or option it came from) and the URL without
    them. Plain paths are never URLs and pass."""
    if not isinstance(url, str) or "://" not in url:
        return url
    found = _credentials_in(url)
    if found:
        raise CredentialsInURL(
            f"{what} {safe_url(url)}: credentials in a URL ({found}) would be stored "
            f"with the run and shown; remove them and {USE_THE_ENVIRONMENT}"
        )
    return url


def secret_options(options: Any, where: str = "storage_options") -> list[str]:
    """The dotted names of the credentials in ``options`` (nested mappings such as
    ``client_kwargs`` included): ``["storage_options.secret", ...]``."""
    found: list[str] = []
    if isinstance(options, dict):
        for name, value in options.items():
            path = f"{where}.{name}"
            if isinstance(value, dict):
                found += secret_options(value, path)
            elif is_secret_name(name) and value not in (None, "", False):
                found.append(path)
    return found


def _credentials_in(url: str) -> str:
    """What in ``url`` is a credential ("" if nothing): its user info (the first
    path segment holding an '@', or a ':' with an '@' later: a secret may contain
    '/'), or a query parameter with a credential's name."""
    rest = url.split("://", 1)[1]
    rest, _, query = rest.partition("?")
    first = rest.split("/", 1)[0]
    if "@" in first or (":" in first and "@" in rest):
        return "user:password@ before the bucket"
    names = [name for name, _ in parse_qsl(query, keep_blank_values=True) if is_secret_name(name)]
    if names:
        return "query parameter " + ", ".join(repr(n) for n in names)
    return ""


def safe_url(url: str) -> str:
    """``url`` without user info or query, for messages (a secret is never shown)."""
    scheme, _, rest = url.partition("://")
    rest = rest.split("?", 1)[0]
    first = rest.split("/", 1)[0]
    if "@" in first:
        rest = rest[first.rindex("@") + 1:]
    elif ":" in first and "@" in rest:  # a secret with a '/' in it
        rest = rest.split("@", 1)[1]
    return f"{scheme}://{rest}"


def bucket_found(fs: fsspec.AbstractFileSystem, bucket: str) -> bool:
    """One HEAD of an S3 bucket: False if it does not exist (else a missing bucket
    shows up as missing keys, and fails only at the first write). True when the
    credentials may not HEAD it (a role limited to a prefix): then the first write
    says what is wrong."""
    try:
        fs.call_s3("head_bucket", Bucket=bucket)
    except FileNotFoundError:
        return False
    except PermissionError:
        return True
    return True


def s3_delete(fs: Any, paths: list[str]) -> None:
    """Delete S3 objects through s3fs ``fs``, raising when the server refuses any.

    s3fs's ``rm`` sends DeleteObjects in quiet mode and drops the per-key errors
    it returns, so a delete the bucket policy denies would pass silently and the
    key stay (a resume would then keep meeting an old cancel request). Here a
    refused key raises: AccessDenied as PermissionError (never retried), a
    throttled or failed key as a transient OSError; a key already gone is fine
    (deletes are retried).
    """
    from fsspec.asyn import sync  # noqa: PLC0415 - s3 only

    by_bucket: dict[str, list[str]] = {}
    for path in paths:
        bucket, key, _ = fs.split_path(path)
        by_bucket.setdefault(bucket, []).append(key)
        fs.invalidate_cache(path)

    async def delete(bucket: str, keys: list[str]) -> list[dict[str, Any]]:
        out = await fs._call_s3("delete_objects", Bucket=bucket, Delete={
            "Objects": [{"Key": k} for k in keys], "Quiet": True})
        return list(out.get("Errors") or [])

    errors = [e for bucket, keys in by_bucket.items() for i in range(0, len(keys), 1000)
              for e in sync(fs.loop, delete, bucket, keys[i:i + 1000])
              if e.get("Code") != "NoSuchKey"]
    if not errors:
        return
    first = errors[0]
    what = (f"delete refused for {len(errors)} key(s), first {first.get('Key')!r}: "
            f"{first.get('Code')} {first.get('Message', '')}".rstrip())
    if any(e.get("Code") in ("AccessDenied", "AllAccessDisabled") for e in errors):
        raise PermissionError(what)
    raise OSError(errno.EAGAIN, what)


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
    if TMP_MARK in key:
        raise ValueError(f"{what} {key!r} may not contain {TMP_MARK!r} (temp-file marker)")
    return key


def is_precondition_failed(exc: BaseException) -> bool:
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


def _clean_url(url: str) -> str:
    """Without trailing slashes (``memory://`` stays as it is); credentials were
    refused before."""
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
            f"unsupported store URL {safe_url(url)!r}: scheme {scheme!r} is not "
            f"one of {', '.join(s + '://' for s in SCHEMES)} (or a plain local path)"
        )
    return scheme


def s3_filesystem(storage_options: dict[str, Any]) -> fsspec.AbstractFileSystem:
    """An s3fs filesystem whose only retry layer is ours.

    botocore retries 5xx by itself and s3fs retries again around it; stacked under
    `RetryPolicy` that would be up to ~150 attempts, hide retries from the traffic
    counter, and make "gave up after N attempts" a lie. So botocore gets
    ``total_max_attempts=1`` (unless the caller configured retries) and s3fs's own
    loop is set to a single attempt.

    The endpoint comes from ``endpoint_url`` or ``client_kwargs``, else from
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``. botocore would read those
    itself (the versions this was checked with: docs/design.md, "Facts about the
    libraries that the code relies on"), but fsspec caches
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


@contextmanager
def file_temp(path: str, data: bytes) -> Iterator[str]:
    """Write ``data`` to a fresh temp file beside ``path`` and yield its name; the
    temp file is removed afterwards whether or not it was renamed or linked.

    No fsync: the guarantee is against readers seeing half an object and against
    killed processes, not against power loss of the machine.
    """
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{TMP_MARK}{uuid.uuid4().hex}"
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        yield tmp
    finally:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
