"""Reaching a store before anything is written: what every command and job does first.

Before launching anything, the store is reached with a short retry policy: an
unreachable store, or an S3 bucket that does not exist, fails in seconds, with its
URL (never its credentials) in the message, instead of after every worker has
started. A job started on an existing run rides out a store outage instead
(`JOB_START_PATIENCE_S`): the command fails fast because a user waits; a job runs
unattended.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from storage.backends import refuse_credentials
from storage.errors import TransientStoreError
from storage.objectstore import ObjectStore
from storage.retry import OutagePolicy, RetryPolicy, is_transient, never_connected

T = TypeVar("T")
log = logging.getLogger(__name__)

#: how long a job (not the command) rides out a store outage while it starts
JOB_START_PATIENCE_S = 300.0

#: A few quick attempts: enough for a hiccup, short enough to fail fast.
REACH_POLICY = RetryPolicy(attempts=3, base_delay=0.2, max_delay=1.0)


class StoreUnreachable(Exception):
    """The store cannot be read or written."""


class BucketMissing(StoreUnreachable):
    """The store's S3 bucket does not exist; the message says how to create it."""


def is_url(ref: str) -> bool:
    return "://" in ref


def store_outage(exc: BaseException | None) -> bool:
    """Whether a store that answers but fails (5xx, throttling, a reset mid-request)
    is behind ``exc``. A store that never accepts a connection (a wrong endpoint, a
    refused port) is not ridden out at start-up: that is far likelier a mistake in
    the URL than an outage, and the job should say so at once."""
    found = False
    while exc is not None:
        if never_connected(exc):
            return False
        found = found or isinstance(exc, TransientStoreError) or is_transient(exc)
        exc = exc.__cause__ or exc.__context__
    return found


def patiently(fn: Callable[[], T], patience_s: float, what: str) -> T:
    """``fn()``, tried again for up to ``patience_s`` while a store outage is why it
    fails (0: the first failure is the last)."""
    policy = OutagePolicy(patience_s=patience_s, pause_s=min(5.0, max(0.5, patience_s / 20)))
    return policy.retrying(retry_on=store_outage, what=f"{what}: the store keeps failing",
                           log=log)(fn)


def reach_store(url: str, storage_options: dict | None = None, *,
                what: str = "store URL", patience_s: float = 0.0) -> None:
    """Raise StoreUnreachable unless the store at ``url`` answers (a local folder:
    unless it can be created and written; S3: unless its bucket exists), and
    `CredentialsInURL` (naming ``what``) if the URL carries credentials."""
    refuse_credentials(url, what=what)
    if not is_url(url) or url.startswith("file://"):
        path = Path(url.removeprefix("file://")).expanduser().resolve()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnreachable(f"store {url}: cannot create the folder {path}: "
                                   f"{exc.strerror or exc}") from exc
        if not os.access(path, os.W_OK | os.X_OK):
            raise StoreUnreachable(f"store {url}: the folder {path} is not writable")
        return
    quiet = logging.getLogger("storage.objectstore")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the retries' warnings; the error below says it all
    try:
        store = ObjectStore(url, storage_options=storage_options, retry=REACH_POLICY,
                            name="probe")

        def probe() -> bool:
            store.exists("run.json")
            return store.bucket_exists()

        found = patiently(probe, patience_s, f"reach the store {safe_url(url)}")
    except Exception as exc:  # noqa: BLE001 - StoreError, OSError, botocore's credential errors
        raise StoreUnreachable(f"cannot reach the store {safe_url(url)}: {_reason(exc)}"
                               ) from exc
    finally:
        quiet.setLevel(level)
    if not found:
        options = storage_options or {}
        endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get(
            "endpoint_url")
        where = f"--endpoint {endpoint} " if endpoint else ""
        raise BucketMissing(
            f"the bucket {store.bucket!r} of {safe_url(url)} does not exist; create it (with "
            f"its per-role policies) using: diloco bucket setup s3://{store.bucket}/PREFIX "
            f"--workers NAMES {where}(PREFIX: where the runs live; same AWS_* environment), "
            f"or fix the store URL")


def safe_url(url: str) -> str:
    """``url`` without credentials (never print a secret)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    return f"{scheme}://{netloc.rpartition('@')[2]}{slash}{path}"


def _reason(exc: BaseException) -> str:
    """The root cause, in one line."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}"
