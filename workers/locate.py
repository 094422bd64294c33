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
from datetime import datetime
from pathlib import Path

from diloco.run import open_exchange
from storage.backends import refuse_credentials
from storage.errors import ManifestInvalid
from storage.exchange import Exchange
from storage.objectstore import ObjectStore, RetryPolicy
from workers.config import RunConfig

DEFAULT_STORE = "runs"

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


def open_run(run_url: str, storage_options: dict | None = None) -> Exchange:
    """The run at ``run_url`` (RunNotFound if there is no manifest)."""
    try:
        return open_exchange(ObjectStore(run_url, storage_options=storage_options,
                                         retry=REACH_POLICY))
    except ManifestInvalid as exc:
        if "cannot read" in str(exc):
            raise RunNotFound(f"no run at {run_url} (its manifest run.json cannot be read)"
                              ) from exc
        raise


def reach_store(url: str, storage_options: dict | None = None, *,
                what: str = "store URL") -> None:
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
        store.exists("run.json")
        found = store.bucket_exists()
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
            f"the bucket {store.bucket!r} of {_safe(url)} does not exist; create it with: "
            f"python -m infra.bucket {where}create --bucket {store.bucket}  (from the "
            f"repository root, with the same AWS_* environment), or fix the store URL")


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
