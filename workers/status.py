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
import time
from datetime import UTC, datetime
from typing import Any

from storage.errors import ObjectMissing, StoreError
from storage.objectstore import ObjectStore

log = logging.getLogger(__name__)

STATES = ("running", "finished", "interrupted", "failed", "cancelled")


def _now() -> str:
    return datetime.now(UTC).isoformat()


class StatusBoard:
    """Writes one party's registration and status; reads everyone's."""

    def __init__(self, store: ObjectStore, name: str):
        self.store = store
        self.name = name
        self._last_write = 0.0

    def register(self, **extra: Any) -> None:
        body = {"name": self.name, "host": socket.gethostname(), "pid": os.getpid(),
                "started": _now(), **extra}
        try:
            self.store.put_if_absent(f"members/{self.name}.json", json.dumps(body).encode())
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
        body = {"name": self.name, "state": state, "updated": _now(), **fields}
        try:
            self.store.put(f"members/{self.name}/status.json", json.dumps(body).encode())
        except StoreError as exc:
            log.warning("%s: could not write its status: %s", self.name, exc)


def read_status(store: ObjectStore, name: str) -> dict[str, Any] | None:
    try:
        return json.loads(store.get(f"members/{name}/status.json"))
    except (ObjectMissing, ValueError):
        return None


def read_all(store: ObjectStore, names: list[str]) -> dict[str, dict[str, Any] | None]:
    return {n: read_status(store, n) for n in names}
