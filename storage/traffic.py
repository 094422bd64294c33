"""Counting what goes over the wire to the store.

The point of Streaming DiLoCo is to send about a thousand times fewer bytes than
data-parallel training, so the bytes are a result we report, not a detail. Every
`ObjectStore` operation records into a `TrafficCounter`: bodies sent (up), bodies
received (down), and requests, in total and per *category* of key, plus the size of
each object so a benchmark can say how large one fragment delta was.

What is counted, precisely:

- `requests` counts logical store operations on one key (one per object for
  get/put, one per list, exists, size, delete), and every attempt of a retried
  operation counts again. A large object on S3 (storage/multipart.py) is several
  requests: a multipart upload counts one ``put`` for its start, one per part and
  one for its completion; a ranged read one ``get`` per range.
- `bytes_up` / `bytes_down` count object bodies only (no headers, no listings).
  A create-only write that loses the race still sent its body, so it counts up;
  `objects_up` records only objects that were actually stored.
- `retries` counts attempts that failed with a transient error and were tried again.

The counter is shared by a store and all its `child()` views, and is safe to use
from several threads at once.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass


def parent_category(key: str) -> str:
    """The default category: the key with its last path segment removed.

    `frag/0/r3/delta/w1/c/0` counts under `frag/0/r3/delta/w1/c`; a key at the
    root (`run.json`) counts under the empty category `""`.
    """
    head, _, _ = key.rpartition("/")
    return head


@dataclass
class CategoryTraffic:
    """Totals for one category of keys."""

    requests: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


class TrafficCounter:
    """Thread-safe totals of requests and body bytes, overall and per category.

    `category` maps a key to the name it is counted under; pass e.g.
    `lambda k: k.split("/")[0]` to count per top-level folder.
    """

    def __init__(self, category: Callable[[str], str] | None = None) -> None:
        self._category = category or parent_category
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget everything counted so far (e.g. between benchmark phases)."""
        with self._lock:
            self._total = CategoryTraffic()
            self._retries = 0
            self._retries_by_op: dict[str, int] = {}
            self._by_category: dict[str, CategoryTraffic] = {}
            self._by_op: dict[str, int] = {}
            self._objects_up: dict[str, int] = {}
            self._objects_down: dict[str, int] = {}

    def record(
        self,
        op: str,
        key: str,
        *,
        up: int = 0,
        down: int = 0,
        stored: bool = False,
        fetched: bool = False,
        size: int | None = None,
    ) -> None:
        """Count one request of operation `op` on `key`.

        `up`/`down` are body bytes sent/received. `stored` records `up` as the size
        of the object now in the store; `fetched` records `down` as the size of the
        object read; ``size`` instead, when this request's body is not the whole
        object (the completion of a multipart upload).
        """
        cat = self._category(key)
        with self._lock:
            for t in (self._total, self._by_category.setdefault(cat, CategoryTraffic())):
                t.requests += 1
                t.bytes_up += up
                t.bytes_down += down
            self._by_op[op] = self._by_op.get(op, 0) + 1
            if stored:
                self._objects_up[key] = up if size is None else size
            if fetched:
                self._objects_down[key] = down if size is None else size

    def record_retry(self, op: str, key: str) -> None:
        """Count one failed attempt of ``op`` on ``key`` that will be tried again."""
        with self._lock:
            self._retries += 1
            self._retries_by_op[op] = self._retries_by_op.get(op, 0) + 1

    @property
    def requests(self) -> int:
        with self._lock:
            return self._total.requests

    @property
    def bytes_up(self) -> int:
        with self._lock:
            return self._total.bytes_up

    @property
    def bytes_down(self) -> int:
        with self._lock:
            return self._total.bytes_down

    @property
    def retries(self) -> int:
        with self._lock:
            return self._retries

    @property
    def objects_up(self) -> dict[str, int]:
        """Size in bytes of each object this counter saw stored (a copy)."""
        with self._lock:
            return dict(self._objects_up)

    @property
    def objects_down(self) -> dict[str, int]:
        """Size in bytes of each object this counter saw read (a copy)."""
        with self._lock:
            return dict(self._objects_down)

    def by_category(self) -> dict[str, CategoryTraffic]:
        """Totals per category (copies)."""
        with self._lock:
            return {k: CategoryTraffic(**asdict(v)) for k, v in self._by_category.items()}

    def snapshot(self) -> dict:
        """Everything counted, as plain data (JSON-serialisable) for logs and MLflow."""
        with self._lock:
            return {
                "requests": self._total.requests,
                "bytes_up": self._total.bytes_up,
                "bytes_down": self._total.bytes_down,
                "retries": self._retries,
                "retries_by_op": dict(sorted(self._retries_by_op.items())),
                "by_op": dict(sorted(self._by_op.items())),
                "by_category": {k: asdict(v) for k, v in sorted(self._by_category.items())},
                "objects_up": dict(sorted(self._objects_up.items())),
                "objects_down": dict(sorted(self._objects_down.items())),
            }


def human_bytes(n: float | None, digits: int = 1) -> str:
    """``12.3 MB``: decimal units, as links and cloud bills count bytes; ``-`` for an
    unknown (None or NaN) amount, so a table of figures keeps its columns."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.{digits}f} {unit}"
    return f"{n:,.0f} B"
