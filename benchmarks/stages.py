"""Where a party's exchange time goes in a real run: encode, upload, download, decode,
reduce, the worker's send (its outer gradient) and merge, and its wait for means,
split by thread.

``install()`` wraps, process-wide, the calls that make up a round (the worker's
`Exchange` and `Synchronizer` methods, the aggregator's reduce) and the
`ObjectStore` reads and writes. A stage's seconds are its *own* time on the thread
that ran it: a stage called inside another (a wait inside a merge) counts for
itself only, and store calls inside a stage count as its I/O. A stage with I/O
reports it apart: ``fetch_delta`` becomes ``download`` (store reads) and ``decode``
(the rest), ``publish_mean`` becomes ``mean_upload`` and ``mean_encode``,
``fetch_mean`` becomes ``fetch_download`` and ``fetch_decode`` (only the calls that
found the mean: the polls before it count as ``poll``). Stages called from inside
``Synchronizer.finish`` (the final rounds) are named ``drain:<stage>``, so that a
short run's drain does not pass for its steady state.

The worker processes of a benchmark (``benchmarks.timed_worker``) install it when
their environment has ``BENCH_STAGES=1`` and print ``StageClock.report()``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

ENV = "BENCH_STAGES"
STORE_CALLS = ("get", "get_many", "exists", "size", "sizes", "list", "put", "put_many",
               "put_if_absent")
#: stage -> (name of its store time, name of the rest), for the stages that do I/O
SPLIT = {"fetch_delta": ("download", "decode"), "publish_mean": ("mean_upload", "mean_encode"),
         "fetch_mean": ("fetch_download", "fetch_decode"), "publish_prepared": ("upload", "")}


class StageClock:
    """Own seconds and calls per stage; see the module docstring."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def _stack(self) -> list[list[Any]]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def _add(self, name: str, seconds: float, calls: int = 0) -> None:
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
            self.calls[name] = self.calls.get(name, 0) + calls

    def timed(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` timed as ``stage``: its own time, less the nested stages' time."""
        def call(*args: Any, **kwargs: Any) -> Any:
            stack = self._stack()
            drain = any(frame[0] == "drain" for frame in stack)
            # frame: [stage, nested seconds, store seconds]
            frame: list[Any] = [stage, 0.0, 0.0]
            stack.append(frame)
            t0 = time.perf_counter()
            result: Any = None
            try:
                result = fn(*args, **kwargs)
                return result
            finally:
                total = time.perf_counter() - t0
                stack.pop()
                if stack:
                    stack[-1][1] += total
                self._record(stage, total - frame[1], frame[2], result, drain)
        return call

    def _record(self, stage: str, own: float, io: float, result: Any, drain: bool) -> None:
        prefix = "drain:" if drain and stage != "drain" else ""
        if stage == "fetch_mean" and result is None:
            self._add(prefix + "poll", own, 1)
            return
        if stage not in SPLIT:
            self._add(prefix + stage, own, 1)
            return
        io_name, rest = SPLIT[stage]
        self._add(prefix + io_name, io, 1)
        if rest:
            self._add(prefix + rest, own - io, 1)

    def store_call(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """An ObjectStore method whose time counts as the running stage's I/O (once,
        however the store's methods call each other)."""
        def call(*args: Any, **kwargs: Any) -> Any:
            local = self._local
            if getattr(local, "in_store", False):
                return fn(*args, **kwargs)
            local.in_store = True
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                local.in_store = False
                stack = self._stack()
                if stack:
                    stack[-1][2] += time.perf_counter() - t0
        return call

    def report(self) -> dict[str, dict[str, float]]:
        """``{stage: {"seconds": total, "calls": n}}``, sorted by stage."""
        with self._lock:
            return {k: {"seconds": round(self.seconds[k], 4), "calls": self.calls[k]}
                    for k in sorted(self.seconds)}


def install() -> StageClock:
    """Wrap the round's calls in this process (for good: a benchmark's own process)."""
    from diloco import aggregator, inflight, synchronizer  # noqa: PLC0415
    from storage import arrays, exchange, objectstore  # noqa: PLC0415

    clock = StageClock()
    for cls, name, stage in (
            (exchange.Exchange, "prepare_delta", "encode"),
            (exchange.Exchange, "publish_prepared", "publish_prepared"),
            (exchange.Exchange, "fetch_mean", "fetch_mean"),
            (exchange.Exchange, "fetch_delta", "fetch_delta"),
            # an aggregator that keeps contributions encoded reads them with hold_delta
            # and decodes them a chunk at a time (the norm's pass, then into the mean's
            # sum: the reduce then includes that decode)
            (exchange.Exchange, "hold_delta", "fetch_delta"),
            (getattr(arrays, "Coded", None), "sumsq", "decode"),
            (exchange.Exchange, "publish_mean", "publish_mean"),
            (aggregator.Aggregator, "_mean", "reduce"),
            (synchronizer.Synchronizer, "_send", "send"),  # the outer gradient, on the loop
            (synchronizer.Synchronizer, "_merge", "merge"),
            (synchronizer.Synchronizer, "finish", "drain"),
            (inflight.InFlight, "wait_mean", "wait")):
        if cls is not None and hasattr(cls, name):
            setattr(cls, name, clock.timed(stage, getattr(cls, name)))
    for name in STORE_CALLS:
        setattr(objectstore.ObjectStore, name,
                clock.store_call(getattr(objectstore.ObjectStore, name)))
    return clock


def from_env() -> StageClock | None:
    """The installed clock if ``BENCH_STAGES=1`` is set, else None."""
    return install() if os.environ.get(ENV) == "1" else None


def peak_rss() -> dict[str, int]:
    """This process's peak and current resident set (bytes, Linux ``/proc``)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                out["peak" if line.startswith("VmHWM") else "rss"] = int(line.split()[1]) * 1024
    return out
