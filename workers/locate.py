"""Naming, finding and reaching runs: what every command does before anything else.

A run lives at ``<store>/<name>-<YYYYmmdd-HHMMSS>`` unless it is given a URL. The
embedded default's store is ``runs/`` in the working directory, so ``diloco status
tiny-20260101-120000`` finds ``runs/tiny-20260101-120000``. Local paths are made
absolute, because the jobs of a run may start in another working directory.

Before launching anything, the store is reached with a short retry policy: an
unreachable store, or an S3 bucket that does not exist, fails in seconds, with its
URL in the message, instead of after every worker has started. A URL carrying
credentials is refused here too (`storage.backends.refuse_credentials`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TypeVar

from diloco.run import open_exchange
from storage.backends import refuse_credentials
from storage.errors import ManifestInvalid, TransientStoreError
from storage.exchange import Exchange
from storage.objectstore import ObjectStore, RetryPolicy
from storage.retry import is_transient, never_connected
from workers.config import RunConfig

DEFAULT_STORE = "runs"
T = TypeVar("T")
log = logging.getLogger(__name__)
#: how long a job (not the command) rides out a store outage while it starts
JOB_START_PATIENCE_S = 300.0

#: A few quick attempts: enough for a hiccup, short enough to fail fast.
REACH_POLICY = RetryPolicy(attempts=3, base_delay=0.2, max_delay=1.0)


class RunNotFound(Exception):
    """No run at the URL or under the name given."""


class StoreUnreachable(Exception):
    """The store cannot be read or written."""


class BucketMissing(StoreUnreachable):
    """The store's S3 bucket does not exist; the message says how to create it."""


def is_url(ref: str) -> bool:
    return "://" in ref


def absolute(url: str) -> str:
    """``url`` with a local path made absolute (URLs are returned as they are)."""
    if is_url(url):
        return url
    return str(Path(url).expanduser().resolve())


def new_run_url(cfg: RunConfig, when: datetime | None = None,
                storage_options: dict | None = None) -> str:
    """``<store>/<name>-<YYYYmmdd-HHMMSS>``, with ``-2``, ``-3``... if taken."""
    stamp = (when or datetime.now()).strftime("%Y%m%d-%H%M%S")
    base = f"{absolute(cfg.store).rstrip('/')}/{cfg.name}-{stamp}"
    url, n = base, 1
    while _taken(url, storage_options):
        n += 1
        url = f"{base}-{n}"
    return url


def _taken(url: str, storage_options: dict | None) -> bool:
    if not is_url(url) or url.startswith("file://"):
        return Path(url.removeprefix("file://")).exists()
    try:
        return ObjectStore(url, storage_options=storage_options, retry=REACH_POLICY).exists(
            "run.json")
    except Exception:  # noqa: BLE001 - reach_store reports it properly
        return False


def resolve_run(ref: str, store: str = DEFAULT_STORE) -> str:
    """The URL of the run ``ref``: a URL, a path, or a run name under ``store``."""
    if is_url(ref):
        return refuse_credentials(ref, what="run")
    path = Path(ref).expanduser()
    if path.is_dir():
        return str(path.resolve())
    under = Path(store) / ref
    if under.is_dir():
        return str(under.resolve())
    known = sorted(p.parent.name for p in Path(store).glob("*/run.json"))
    hint = f"; runs under {store}/: {', '.join(known[-5:])}" if known else (
        f"; there are no runs under {store}/")
    raise RunNotFound(f"no run {ref!r}: not a URL, not a directory, and not a run under "
                      f"{store}/{hint}")


def _transient(exc: BaseException | None) -> bool:
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


def _patiently(fn: Callable[[], T], patience_s: float, what: str) -> T:
    """``fn()``, tried again for up to ``patience_s`` while a store outage is why it
    fails. The command fails fast (0: a user waits); a job started on an existing
    run rides out an outage instead of exiting with a usage error."""
    start = time.monotonic()
    while True:
        try:
            return fn()
        except Exception as exc:
            if not _transient(exc) or time.monotonic() - start >= patience_s:
                raise
            log.warning("%s: the store keeps failing (%.0f s of at most %.0f s): %s", what,
                        time.monotonic() - start, patience_s, exc)
            time.sleep(min(5.0, max(0.5, patience_s / 20)))


def open_run(run_url: str, storage_options: dict | None = None, *,
             patience_s: float = 0.0) -> Exchange:
    """The run at ``run_url`` (RunNotFound if there is no manifest); ``patience_s``
    as for a job: how long a store outage is ridden out."""
    try:
        return _patiently(lambda: open_exchange(ObjectStore(
            run_url, storage_options=storage_options, retry=REACH_POLICY)), patience_s,
            f"open the run {_safe(run_url)}")
    except ManifestInvalid as exc:
        if "cannot read" in str(exc):
            raise RunNotFound(f"no run at {run_url} (its manifest run.json cannot be read)"
                              ) from exc
        raise


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

        found = _patiently(probe, patience_s, f"reach the store {_safe(url)}")
    except Exception as exc:  # noqa: BLE001 - StoreError, OSError, botocore's credential errors
        raise StoreUnreachable(f"cannot reach the store {_safe(url)}: {_reason(exc)}") from exc
    finally:
        quiet.setLevel(level)
    if not found:
        options = storage_options or {}
        endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get(
            "endpoint_url")
        where = f"--endpoint {endpoint} " if endpoint else ""
        raise BucketMissing(
            f"the bucket {store.bucket!r} of {_safe(url)} does not exist; create it (with "
            f"its per-role policies) using: diloco bucket setup s3://{store.bucket}/PREFIX "
            f"--workers NAMES {where}(PREFIX: where the runs live; same AWS_* environment), "
            f"or fix the store URL")


def _safe(url: str) -> str:
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
