"""Where every party of a run says how it is doing, in the run's store.

``members/{name}.json`` is written once when a party first starts (registration:
host, pid, start time). ``members/{name}/status.json`` is the one object of a run
that is overwritten: the newest progress of that party (step, loss, tokens, bytes,
state). It is what ``diloco status`` and the live progress read, from any region,
with nothing but the bucket. Losing a status write never stops training.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

from diloco.membership import read_json
from storage import layout
from storage.errors import StoreError
from storage.objectstore import ObjectStore

log = logging.getLogger(__name__)

STATES = ("joining", "running", "finished", "left", "interrupted", "failed", "cancelled")
#: states whose status is renewed in the background: it is the member's lease
RENEWED = ("joining", "running")



class StatusBoard:
    """Writes one party's registration and status; reads everyone's.

    With ``background=True`` a ``running`` status is handed to a writer thread
    (only the newest one is kept) and ``update`` returns at once: on a slow link a
    status PUT queued behind a fragment upload would otherwise stall the training
    loop for seconds. Any other state (finished, interrupted, ...) is written
    before ``update`` returns, after any background write in flight, and no older
    ``running`` status can land after it.

    ``renew_s``: the status is the member's lease; while it says ``joining`` or
    ``running``, the writer thread writes it again (a fresh ``updated``) whenever
    ``renew_s`` seconds pass without a write, so a worker blocked on a long merge or
    a slow step keeps its lease."""

    def __init__(self, store: ObjectStore, name: str, *, background: bool = False,
                 renew_s: float | None = None):
        self.store = store
        self.name = name
        self.background = background
        self._last_write = 0.0
        self._write_lock = threading.Lock()  # one PUT at a time, in order
        self._pending: bytes | None = None
        self._pending_lock = threading.Lock()
        self._wake = threading.Event()
        self._writer: threading.Thread | None = None
        self.renew_s = renew_s
        self._last: dict[str, Any] | None = None
        self._last_put = time.monotonic()

    def register(self, **extra: Any) -> None:
        """Write the party's registration once: where it runs and which code (the
        interpreter and the installed diloco-flows), so an audit of the run can
        tell a region's image from another's checkout."""
        body = {"name": self.name, "host": socket.gethostname(), "pid": os.getpid(),
                "started": layout.utc_now(), "python": sys.executable, "version": _version(), **extra}
        try:
            self.store.put_if_absent(layout.member(self.name), json.dumps(body).encode())
        except StoreError as exc:  # pragma: no cover - best effort
            log.warning("%s: could not register: %s", self.name, exc)

    def update(self, state: str = "running", *, force: bool = False,
               min_interval: float = 1.0, **fields: Any) -> None:
        """Overwrite this party's status (at most every ``min_interval`` seconds
        unless ``force``)."""
        now = time.monotonic()
        if not force and now - self._last_write < min_interval:
            return
        self._last_write = now
        record = {"name": self.name, "state": state, "updated": layout.utc_now(), **fields}
        self._last = record
        body = json.dumps(record)
        if self.background and state in RENEWED:
            with self._pending_lock:
                self._pending = body.encode()
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                                name=f"status-{self.name}")
                self._writer.start()
            self._wake.set()
            return
        with self._write_lock:
            with self._pending_lock:
                self._pending = None  # superseded
            self._put(body.encode())

    def _put(self, body: bytes) -> None:
        self._last_put = time.monotonic()
        try:
            self.store.put(layout.member_status(self.name), body)
        except StoreError as exc:
            log.warning("%s: could not write its status: %s", self.name, exc)

    def _write_loop(self) -> None:
        while True:
            self._wake.wait(self.renew_s)
            self._wake.clear()
            with self._write_lock:
                with self._pending_lock:
                    body, self._pending = self._pending, None
                last = self._last
                if (body is None and self.renew_s is not None and last is not None
                        and last.get("state") in RENEWED
                        and time.monotonic() - self._last_put >= self.renew_s):
                    last = {**last, "updated": layout.utc_now()}  # a renewal of the lease
                    body = json.dumps(last).encode()
                if body is not None:
                    self._put(body)


def read_status(store: ObjectStore, name: str) -> dict[str, Any] | None:
    return read_json(store, layout.member_status(name))


def read_all(store: ObjectStore, names: list[str]) -> dict[str, dict[str, Any] | None]:
    return {n: read_status(store, n) for n in names}


def _version() -> str | None:
    """The installed diloco-flows version (None when run from sources not installed)."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version("diloco-flows")
    except PackageNotFoundError:
        return None
