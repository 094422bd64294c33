"""``overlap: auto``: tau sized to the link, decided per merge point and recorded.

A fragment sent ``tau`` steps before its merge has ``tau`` inner steps of time for
its round trip (send, the aggregator's mean, the fetch). When that trip takes longer
the merge waits; when ``tau`` is larger than it needs the merge uses an older
outer gradient than it could. So each worker measures what it needs:

- the exchange latency of its recent rounds, from the send of a round to the moment
  its mean reached this worker (`diloco.inflight` stamps both);
- the inner-step time, wall time between two steps minus the time spent waiting
  for a mean.

Two parts of a measured latency are left out of it. The lag behind the last
peer's send (its contribution's commit was created that long after this worker's):
a larger tau does not hide it for good, since a worker that sends ahead of the
others either waits once and is in step with them again, or runs faster than they do
and has to wait sooner or later whatever tau is; sizing tau to it only made the
merges staler. And the coarse polls of a long wait: while ``overlap: auto`` is on,
a worker polls for a mean at least once per inner step (not every ``poll_max_s``),
so a mean is seen within a step of its commit.

Each worker proposes, at each send, the tau that would hide that latency
(`decide_tau`: the steps that cover a high quantile, ``LATENCY_QUANTILE``, of the
last ``LATENCY_WINDOW`` latencies plus ``overlap_margin`` of it, clamped to
``1 .. H/P - 1``). The proposal rides in the
contribution's commit (``tau_next``). Right after merge point ``k`` every worker
decides the tau of merge point ``k + 1`` the same way: the largest proposal of the
workers the mean of point ``k`` counted on time (its commit names them), or point
``k``'s own tau when it names none. All workers read the same commits, so they agree
and send together: a worker that sent earlier than the others would wait in the
aggregator's inbox for them (its latency would grow with its lead, and its tau with
it) and, past the grace window, leave them out of the round. The send of point
``k + 1`` is at least one step after merge ``k`` (tau < H/P), so the decision always
precedes it. Merge points 1 and 2 use ``overlap_start`` (no proposal has measured
anything yet; by default ``H/P - 1``, so that the first merges do not wait either:
tau comes down to the measured need from point 3 on).

Every decision is kept (`AutoOverlap.state_dict`, in the worker checkpoint), so a
resumed worker replays the decided points exactly: a round already sent is not sent
again and a round not yet sent goes out at the same step as before. Points whose
merge step is past the run's end keep ``overlap_start``: the run's round counts
(`diloco.schedule.Schedule.rounds_in_run`, fixed in the manifest) assume it there.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence

#: recent rounds whose latencies a decision covers
LATENCY_WINDOW = 8
#: the share of those latencies a decision hides (nearest rank: 6 of 8)
LATENCY_QUANTILE = 0.75
#: recent inner steps whose median is the step time
STEP_WINDOW = 16

log = logging.getLogger(__name__)


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (an observed value: the max of up to 3 at 0.75)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def decide_tau(latencies: Sequence[float], step_s: float | None, *, margin: float,
               start: int, most: int, q: float = LATENCY_QUANTILE) -> int:
    """The tau that hides most recent latencies: ``ceil(quantile(latencies, q) * (1 +
    margin) / step_s)``, clamped to ``1 .. most`` (``most`` = H/P - 1, the
    schedule's limit). Not the max: one slow round (a loaded machine, a retried
    request) would make every merge of the next 8 rounds staler, each costing loss,
    to save one wait. Without a latency or a step time yet: ``start``."""
    if not latencies or step_s is None or not step_s > 0:
        return max(1, min(most, start))
    need = quantile(latencies, q) * (1.0 + margin) / step_s
    return max(1, min(most, math.ceil(need)))


class FixedOverlap:
    """A fixed tau (``overlap: N``): the interface of `AutoOverlap`, deciding nothing,
    so that the synchroniser and the pollers treat both alike."""

    #: whether the workers agree on tau from the proposals in each mean's commit
    agrees = False

    def __init__(self, tau: int):
        self.tau = tau

    @property
    def per_point(self) -> Callable[[int], int] | None:
        """The schedule's tau lookup per merge point: None, every point's is ``tau``."""
        return None

    def tau_of(self, k: int) -> int:
        return self.tau

    def current(self, fragments: int) -> list[int]:
        return [self.tau] * fragments

    def stepped(self, waited_s: float) -> None:
        """Nothing to measure."""

    def arrived(self, latency_s: float, lag_s: float = 0.0) -> None:
        """Nothing to measure."""

    def poll_max(self, poll_min_s: float, poll_max_s: float) -> float:
        return poll_max_s

    def propose(self) -> int | None:
        return None

    def merged(self, k: int, agreed: int | None, *, worker: str = "") -> None:
        """Nothing to decide."""

    def ensure(self, k: int) -> None:
        """Nothing to decide."""

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None) -> None:
        """Nothing was decided."""


class AutoOverlap:
    """One worker's tau decisions (per merge point) and the measurements behind them."""

    agrees = True

    def __init__(self, stride: int, total_steps: int, *, start: int, margin: float,
                 clock: Callable[[], float] = time.monotonic):
        self.stride, self.total_steps = stride, total_steps
        self.start, self.margin, self.clock = start, margin, clock
        self.most = stride - 1
        #: taus[k - 1] is the tau of merge point k
        self.taus: list[int] = [self._beyond_end(1, max(1, min(self.most, start)))]
        self.latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.step_times: deque[float] = deque(maxlen=STEP_WINDOW)
        self._last_step: tuple[float, float] | None = None  # (clock, waited so far)
        self._step_s: float | None = None  # read by the pollers' threads

    @property
    def per_point(self) -> Callable[[int], int] | None:
        """The schedule's tau lookup per merge point (`tau_of`)."""
        return self.tau_of

    def tau_of(self, k: int) -> int:
        """The tau decided for merge point ``k`` (which must be decided)."""
        return self.taus[k - 1]

    def current(self, fragments: int) -> list[int]:
        """The newest decided tau of each fragment (for status and metrics)."""
        out = [self.taus[0]] * fragments
        for k, tau in enumerate(self.taus, start=1):
            out[(k - 1) % fragments] = tau
        return out

    # -- measurements ------------------------------------------------------------
    def stepped(self, waited_s: float) -> None:
        """An inner step ended; ``waited_s``: the worker's total wait for means so far
        (not inner-step time)."""
        now = self.clock()
        if self._last_step is not None:
            then, waited_then = self._last_step
            self.step_times.append(max(0.0, (now - then) - (waited_s - waited_then)))
            self._step_s = sorted(self.step_times)[len(self.step_times) // 2]
        self._last_step = (now, waited_s)

    def arrived(self, latency_s: float, lag_s: float = 0.0) -> None:
        """A round's mean reached this worker ``latency_s`` after its send, ``lag_s``
        of it spent waiting for the last peer's send (not what tau hides: module
        docstring)."""
        self.latencies.append(max(0.0, latency_s - max(0.0, lag_s)))

    def step_s(self) -> float | None:
        """The median recent inner-step time (None before two steps)."""
        return self._step_s

    def poll_max(self, poll_min_s: float, poll_max_s: float) -> float:
        """The longest pause between two polls for a mean: one inner step (within
        ``poll_min_s .. poll_max_s``), so a mean is seen within a step of its commit
        and its measured latency is not the poll's backoff."""
        step = self._step_s
        return poll_max_s if step is None else max(poll_min_s, min(poll_max_s, step))

    # -- decisions ---------------------------------------------------------------
    def propose(self) -> int:
        """This worker's tau for the rounds to come, from its own measurements."""
        return decide_tau(list(self.latencies), self.step_s(), margin=self.margin,
                          start=self.start, most=self.most)

    def merged(self, k: int, agreed: int | None, *, worker: str = "") -> None:
        """Merge point ``k`` merged: point ``k + 1`` takes ``agreed`` (the largest
        proposal the mean of point ``k`` counted), else point ``k``'s tau. A point
        decided already (a resumed worker replaying) keeps its decision. A change is
        logged (as ``worker``) with what this worker measured: the latencies a
        decision reads."""
        if len(self.taus) == k:
            tau = self.taus[k - 1] if agreed is None else max(1, min(self.most, agreed))
            self.taus.append(self._beyond_end(k + 1, tau))
            if self.taus[k] != self.taus[k - 1]:
                log.info("worker %s: tau %d for merge point %d (was %d; own latencies %s s, "
                         "inner step %.3f s)", worker, self.taus[k], k + 1, self.taus[k - 1],
                         [round(x, 2) for x in self.latencies], self.step_s() or 0.0)

    def ensure(self, k: int) -> None:
        """Decide every merge point up to ``k`` not decided yet (after a rebase or an
        old checkpoint), with the newest decided tau."""
        while len(self.taus) < k:
            self.taus.append(self._beyond_end(len(self.taus) + 1, self.taus[-1]))

    def _beyond_end(self, k: int, tau: int) -> int:
        """Points merging after the run's last step keep ``start`` (the round counts
        assume it)."""
        return min(self.start, self.most) if k * self.stride > self.total_steps else tau

    # -- checkpoint --------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"taus": list(self.taus), "latencies": list(self.latencies),
                "step_times": list(self.step_times)}

    def load_state_dict(self, state: dict | None) -> None:
        """Take the decisions back (a checkpoint without them: keep the fresh start)."""
        if not state:
            return
        self.taus = [int(t) for t in state["taus"]]
        self.latencies.extend(float(x) for x in state.get("latencies", []))
        self.step_times.extend(float(x) for x in state.get("step_times", []))
        if self.step_times:
            self._step_s = sorted(self.step_times)[len(self.step_times) // 2]

