"""Naming and finding runs.

A run lives at ``<store>/<name>-<YYYYmmdd-HHMMSS>`` unless it is given a URL. The
embedded default's store is ``runs/`` in the working directory, so ``diloco status
tiny-20260101-120000`` finds ``runs/tiny-20260101-120000``. Local paths are made
absolute, because the jobs of a run may start in another working directory.
Opening a run is `diloco.run.open_run`; reaching its store first, `storage.reach`.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from storage.backends import refuse_credentials
from storage.errors import RunNotFound
from storage.objectstore import ObjectStore
from storage.reach import REACH_POLICY, is_url
from workers.config import RunConfig

DEFAULT_STORE = "runs"

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
