"""Metrics to MLflow without making training wait: MLflow's asynchronous logging,
and the small outage buffer it does not have.

A hook call whose run is known, while the server answers, hands its metrics to
``MlflowClient.log_batch(..., synchronous=False)``: MLflow's ``AsyncLoggingQueue``
puts them in its queue, a thread of its own hands each batch to a pool of ten
threads that send it, and the call returns a ``RunOperations``. What that queue
does when the server is slow or away (found by experiment with
``benchmarks/bench_tracking.py``; the MLflow version it was found with is in
docs/design.md, "Facts about the libraries", the times in docs/results.md,
"Tracking: what a worker step pays"):

- the call never blocks and never raises, also with nothing listening;
- a batch that fails (after the HTTP client's own retries: seconds when the port
  refuses, the request timeout times the attempts when nothing answers) is dropped
  for good, with an error in the log per batch; nothing is retried later, not even
  once the server is back; only ``RunOperations.wait()`` raises;
- the queue has no bound, and its flush (``set_terminated`` runs one) waits for
  every batch in it, as does the process's exit: with the server down, a long
  queue takes long to flush;
- with ``MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS`` set it merges queued batches,
  but reports a failure only on the first batch of a merge (the others' wait()
  returns as if logged): leave it unset, so that every failed batch is seen.

So this module adds: a window (``window`` batches at most in MLflow's queue,
which bounds what a process exit waits for to one round of requests); `confirm`,
which waits on each ``RunOperations`` from the hooks' thread and brings a failed
batch back; and a bounded buffer (``max_buffer`` metrics, oldest dropped and
counted) for metrics of a run not created yet, past the window, and during an
outage. `resend` sends that buffer synchronously from the hooks' thread, up to
1000 metrics a request: the answer tells a dead server (retry later, with
backoff) from a refusal (count and drop).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tracking.runs import is_permanent
from tracking.settings import clip

log = logging.getLogger(__name__)

#: Metrics of one synchronous request when the buffer is sent again (MLflow's limit).
RESEND_BATCH = 1000


@dataclass
class Held:
    """Metrics waiting in the buffer: ``build()`` makes them when they are sent (a
    round's step needs the schedule, which its run's resolution reads); ``n`` is
    how many, for the bound and the counts."""

    key: str
    build: Callable[[], list[Any]]
    n: int


class MetricSender:
    """The metrics of one hooks object, by run key ("worker:a", "aggregator")."""

    def __init__(self, max_buffer: int, window: int = 10) -> None:
        self.max_buffer = max_buffer
        self.window = window
        self.client: Any = None  # set by the hooks' thread once it has one
        self.outage = False  # set by the hooks' thread: buffer everything meanwhile
        self.dropped = 0
        self._lock = threading.Lock()
        self._held: deque[Held] = deque()
        self._held_n = 0
        self._sent: deque[tuple[str, list[Any], Any]] = deque()  # key, metrics, RunOperations
        self._sent_n = 0
        self._sending: list[Held] = []
        self._keys: set[str] = set()  # every key that has had metrics buffered
        self._routes: dict[str, str] = {}  # run key -> run id
        self._dead: dict[str, str] = {}  # run key -> why it cannot be logged to

    # -- the hook side: microseconds ------------------------------------------------

    def log(self, key: str, build: Callable[[], list[Any]], n: int) -> None:
        run_id = self._routes.get(key)
        if (run_id is not None and self.client is not None and not self.outage
                and len(self._sent) < self.window):
            metrics = build()
            if not metrics:
                return
            try:
                ops = self.client.log_batch(run_id, metrics=metrics, synchronous=False)
            except Exception:  # noqa: BLE001 - MLflow's queue refused it: keep it
                self._hold(Held(key, lambda: metrics, len(metrics)))
                return
            with self._lock:
                self._sent.append((key, metrics, ops))
                self._sent_n += len(metrics)
            return
        self._hold(Held(key, build, n))

    def _hold(self, item: Held, *, oldest: bool = False) -> None:
        with self._lock:
            if oldest:
                self._held.appendleft(item)
            else:
                self._held.append(item)
            self._held_n += item.n
            self._keys.add(item.key)
            while self._held_n > self.max_buffer and self._held:
                gone = self._held.popleft()
                self._held_n -= gone.n
                self.dropped += gone.n

    # -- the hooks' thread -------------------------------------------------------------

    def route(self, key: str, run_id: str) -> None:
        self._routes[key] = run_id

    def dead(self, key: str, why: str) -> None:
        self._dead[key] = why

    def unrouted(self) -> list[str]:
        """Keys with buffered metrics and no run yet (the hooks resolve them)."""
        with self._lock:
            keys = set(self._keys)
        return sorted(keys - set(self._routes) - set(self._dead))

    def confirm(self) -> None:
        """Wait for the batches in MLflow's queue, oldest first; one that MLflow
        could not send comes back to the buffer (`resend` tells why), and everything
        logged from now on is buffered until the hooks' thread clears ``outage``."""
        with self._lock:
            count = len(self._sent)
        for _ in range(count):
            key, metrics, ops = self._sent[0]
            failed = False
            try:
                ops.wait()
            except Exception:  # noqa: BLE001 - MLflow wraps the cause; resend finds it
                failed = True
            with self._lock:
                self._sent.popleft()
                self._sent_n -= len(metrics)
            if failed:
                self.outage = True
                self._hold(Held(key, lambda m=metrics: m, len(metrics)), oldest=True)

    def resend(self, stop: Callable[[], bool] | None = None) -> None:
        """Send the buffer, ``RESEND_BATCH`` metrics of one run at a time, and wait
        for each answer, until ``stop()`` says no more. Raises on a failure a retry
        may fix (the batch stays)."""
        while not (stop is not None and stop()) and (batch := self._take()):
            key = batch[0].key
            run_id = self._routes.get(key)
            if run_id is None:
                self._drop(batch, f"{key}: {self._dead.get(key, 'no run')}")
                continue
            metrics = [m for item in batch for m in item.build()]
            try:
                self.client.log_batch(run_id, metrics=metrics, synchronous=True)
            except Exception as exc:
                if not is_permanent(exc):  # back in front, built (a round's step is set)
                    with self._lock:
                        self._sending = []
                    n = sum(item.n for item in batch)
                    self._hold(Held(key, lambda m=metrics: m, n), oldest=True)
                    raise
                self._drop(batch, f"{key}: {exc}")
            else:
                with self._lock:
                    self._sending = []

    def _take(self) -> list[Held]:
        """The oldest buffered metrics of one run that can be sent (or dropped):
        up to RESEND_BATCH; none when the oldest waits for its run."""
        with self._lock:
            batch: list[Held] = []
            count = 0
            while self._held and count < RESEND_BATCH:
                head = self._held[0]
                if batch and head.key != batch[0].key:
                    break
                if head.key not in self._routes and head.key not in self._dead:
                    break  # keep the order; its run is not there yet
                self._held.popleft()
                self._held_n -= head.n
                batch.append(head)
                count += head.n
            self._sending = batch
            return batch

    def _drop(self, batch: list[Held], why: str) -> None:
        n = sum(item.n for item in batch)
        with self._lock:
            self._sending = []
            self.dropped += n
        log.warning("MLflow tracking: %d metrics not logged: %s", n, clip(why, 300))

    def not_logged(self) -> int:
        """Metrics dropped, buffered, or not confirmed by MLflow's queue."""
        with self._lock:
            return (self.dropped + self._held_n + self._sent_n
                    + sum(item.n for item in self._sending))

    def queued(self) -> bool:
        """Batches are in MLflow's queue, not confirmed yet."""
        return bool(self._sent)

    def idle(self) -> bool:
        with self._lock:
            return not self._held and not self._sent and not self._sending
