"""Controlling a run through its store: the cancel request and the launcher record.

Like everything else about a run, control goes through the bucket, so it works
from any region and whether or not Prefect is reachable::

    control/cancel.json        a cancel request (who, when, why); every job polls it
    control/cancelled/<t>.json earlier requests, kept when ``diloco resume`` clears one
    members/launcher.json      how the jobs were launched: local PIDs (host, command,
                               log file) or Prefect flow-run ids

`CancelWatch` is the poller the jobs run beside their work; `ParentWatch` stops a
locally launched job whose launcher died, so no job outlives the command that
started it.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from flows import LAUNCHER_PID
from storage import layout
from storage.errors import ObjectMissing, StoreError
from storage.objectstore import ObjectStore

log = logging.getLogger(__name__)

CANCEL_KEY = layout.CANCEL
LAUNCHER_KEY = layout.LAUNCHER_RECORD



def _who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in some containers
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _read_json(store: ObjectStore, key: str) -> dict[str, Any] | None:
    try:
        return json.loads(store.get(key))
    except ObjectMissing:
        return None
    except ValueError:
        log.warning("%s is not valid JSON; ignoring it", store.full_url(key))
        return None


# -- the cancel request ---------------------------------------------------------------


def shard_board(shard: int) -> str:
    """The status board of aggregator shard ``shard`` >= 1 (``members/aggregator/s{S}/
    status.json``: under the aggregator's own keys, so no worker name can take it)."""
    return f"{layout.AGGREGATOR}/s{shard}"


def request_cancel(store: ObjectStore, reason: str = "") -> dict[str, Any]:
    """Ask every job of the run to stop (they checkpoint first). Idempotent."""
    existing = cancel_request(store)
    if existing is not None:
        return existing
    body = {"requested": layout.utc_now(), "by": _who(), "reason": reason or "cancelled by request"}
    store.put(CANCEL_KEY, json.dumps(body).encode())
    return body


def cancel_request(store: ObjectStore) -> dict[str, Any] | None:
    """The pending cancel request, or None."""
    return _read_json(store, CANCEL_KEY)


def clear_cancel(store: ObjectStore) -> dict[str, Any] | None:
    """Withdraw a pending request (``resume``), keeping it under control/cancelled/."""
    body = cancel_request(store)
    if body is None:
        return None
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    store.put(layout.cancelled(stamp), json.dumps({**body, "cleared": layout.utc_now()}).encode())
    store.delete(CANCEL_KEY)
    return body


# -- the launcher record --------------------------------------------------------------


def write_launcher(store: ObjectStore, record: dict[str, Any]) -> None:
    """Record how the jobs of the run were launched (overwritten on each launch)."""
    body = {"updated": layout.utc_now(), "host": socket.gethostname(), "pid": os.getpid(), **record}
    try:
        store.put(LAUNCHER_KEY, json.dumps(body, indent=1).encode())
    except StoreError as exc:  # the record helps cancel; losing it never stops training
        log.warning("could not write %s: %s", store.full_url(LAUNCHER_KEY), exc)


def read_launcher(store: ObjectStore) -> dict[str, Any] | None:
    return _read_json(store, LAUNCHER_KEY)


# -- watchers -------------------------------------------------------------------------


class _Poller:
    """A daemon thread that calls ``check`` every ``interval`` seconds until it
    returns True or the watcher is stopped."""

    def __init__(self, name: str, interval: float):
        self.interval = interval
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def check(self) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._done.wait(self.interval):
            try:
                if self.check():
                    return
            except Exception as exc:  # noqa: BLE001 - a watcher never kills its job
                log.debug("%s: %s", self._thread.name, exc)

    def start(self) -> _Poller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()

    def __enter__(self) -> _Poller:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def watching(store: ObjectStore, on_cancel: Callable[[dict[str, Any]], None],
             stop: threading.Event, *, interval: float = 2.0,
             exit_with_parent: bool = False) -> Iterator[None]:
    """What every job watches while it works: the run's cancel request (``on_cancel``,
    polled every ``interval`` s) and, with ``exit_with_parent``, its launcher (gone:
    ``stop`` is set)."""
    watchers: list[_Poller] = [CancelWatch(store, on_cancel, interval=interval)]
    if exit_with_parent:
        watchers.append(ParentWatch(stop.set))
    for w in watchers:
        w.start()
    try:
        yield
    finally:
        for w in watchers:
            w.stop()


class CancelWatch(_Poller):
    """Calls ``on_cancel(request)`` once when the run's cancel request appears."""

    def __init__(self, store: ObjectStore, on_cancel: Callable[[dict[str, Any]], None],
                 interval: float = 2.0):
        super().__init__("cancel-watch", interval)
        self.store = store
        self.on_cancel = on_cancel
        self.request: dict[str, Any] | None = None

    def check(self) -> bool:
        found = cancel_request(self.store)
        if found is None:
            return False
        self.request = found
        log.info("cancel requested by %s: %s", found.get("by"), found.get("reason"))
        self.on_cancel(found)
        return True


class ParentWatch(_Poller):
    """Calls ``on_orphaned()`` once if the process that started this one is gone.

    The parent is the launcher's pid noted when the package was imported
    (`flows.LAUNCHER_PID`, before the slow imports), else ``parent``, else this
    process's parent now. The first check is made at `start`, not a second later.
    """

    def __init__(self, on_orphaned: Callable[[], None], interval: float = 1.0,
                 parent: int | None = None):
        super().__init__("parent-watch", interval)
        self.parent = parent or LAUNCHER_PID or os.getppid()
        self.on_orphaned = on_orphaned

    def check(self) -> bool:
        if os.getppid() == self.parent:
            return False
        log.warning("the launcher (pid %d) is gone; stopping", self.parent)
        self.on_orphaned()
        return True

    def start(self) -> _Poller:
        if self.check():
            return self
        return super().start()
