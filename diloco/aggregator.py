"""The aggregator: reduce the workers' outer gradients and step the canonical model.

For each fragment, round after round: list the committed contributions, wait for
the members it expects (`diloco.membership.Roster`: admitted, holding a live lease,
not left) or, once a quorum is in, for an adaptive grace window
(`diloco.grace.Grace`); fetch and verify each (a corrupt, partial, non-finite or
wrong-shaped one is rejected, recorded and never applied); take the token-weighted
float32 mean, together with the late contributions of earlier rounds of the
fragment (each applied exactly once, or dropped past ``max_staleness``); publish it
encoded (with the aggregator's own error feedback) with the decision recorded in its
commit (expected, participants, late, dropped, owed); apply the outer step with the
decoded published mean, and checkpoint the canonical state.

All state is in the store. Killed at any point and restarted, the aggregator loads
each fragment's newest checkpoint and replays later rounds from their committed
means, reaching the same bits; what late contributions are still owed is read from
the newest commit. Two aggregators on one run race only on create-only commits: one
mean per (fragment, round); the loser adopts the winner's mean.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import numpy as np
import torch

from diloco.config import SyncConfig
from diloco.gate import Gate, Inbox
from diloco.membership import Roster
from diloco.outer import OuterState
from diloco.pacing import Pacer
from diloco.run import latest_global, load_initial
from diloco.trust import Trust
from storage import layout
from storage.arrays import Coded
from storage.checkpoints import read_checkpoint, write_checkpoint
from storage.errors import BAD_CONTRIBUTION, ObjectMissing
from storage.exchange import Exchange, contribution_of, weighted_sum
from storage.retry import outlast

log = logging.getLogger(__name__)
#: ``late: decay``: a contribution's token weight is multiplied by this for every round
#: it is late
LATE_DECAY = 0.5


def _utc_now() -> str:
    return datetime.now(UTC).isoformat()


@dataclass
class RoundReport:
    """What happened in one (fragment, round)."""

    fragment: int
    round: int
    weights: dict[str, float]
    rejected: dict[str, str]
    adopted: bool
    seconds: float
    grad_norm: float
    late: int = 0  # contributions of earlier rounds applied in this mean
    dropped: int = 0  # contributions dropped as too stale
    expected: int = 0  # members the round waited for
    absent: int = 0  # contributions of earlier rounds now known never to come

    @property
    def on_time(self) -> int:
        """Members whose contribution to this very round is in its mean."""
        return sum(1 for w in self.weights if "@" not in w)


@dataclass
class Stall:
    """A round that has waited ``waited_s`` seconds with no round of the run applied
    since ``since`` (UTC, ISO 8601): who it still waits for."""

    fragment: int
    round: int
    missing: list[str]
    since: str
    waited_s: float

    def describe(self) -> str:
        who = ", ".join(self.missing) if self.missing else "no one (it is being reduced)"
        return (f"fragment {self.fragment} round {self.round} waits for {who} "
                f"since {self.since[11:19]} UTC ({self.waited_s:.0f} s)")


def restore_outer(state: OuterState, arrays: dict) -> torch.Tensor | None:
    """Load a canonical checkpoint's arrays (params, momentum if any) into ``state``;
    returns its error-feedback residual, if it has one (the whole aggregator and
    each shard of a sharded one resume the same way)."""
    momentum = arrays.get("momentum")
    state.load(torch.from_numpy(arrays["params"].copy()),
               None if momentum is None else torch.from_numpy(momentum.copy()))
    residual = arrays.get("residual")
    return None if residual is None else torch.from_numpy(residual.copy())


@dataclass
class AggregatorStats:
    rounds: list[RoundReport] = field(default_factory=list)
    rejected: int = 0
    late: int = 0
    dropped: int = 0


class Aggregator:
    """Reduces contributions and keeps the canonical outer state of one run."""

    def __init__(
        self,
        exchange: Exchange,
        *,
        name: str = "aggregator",
        config: SyncConfig | None = None,
        fault: Callable[[str, int, int], None] | None = None,
        on_round: Callable[[RoundReport], None] | None = None,
        on_stall: Callable[[list[Stall]], None] | None = None,
        keep_checkpoints: int = 0,
        slots: int | None = None,
        hold_back: Callable[[int, int, str], bool] | None = None,
    ):
        """``keep_checkpoints``: round checkpoints of the canonical state kept per
        fragment (0 keeps all). Each is the fragment's float32 parameters and
        momentum, so a long run of a large model needs a bound; resuming reads only
        the newest. ``slots``: the run's data slots, one per member (default: twice
        the manifest's workers)."""
        layout.check_name("aggregator", name)
        if keep_checkpoints < 0:
            raise ValueError(f"keep_checkpoints must be >= 0 (0 keeps all), got {keep_checkpoints}")
        self.keep_checkpoints = keep_checkpoints
        #: benchmarks only: ``hold_back(p, r, worker)`` keeps that contribution out of
        #: its round, so it is settled as late (benchmarks.bench_late)
        self.hold_back = hold_back
        self.exchange = exchange
        self.manifest = exchange.manifest
        self.name = name
        self.config = config or SyncConfig.stored(self.manifest.sync)
        self.fault = fault or (lambda stage, p, r: None)
        self.on_round = on_round
        #: told the stalled rounds when no round has been applied for
        #: ``stall_after_s`` (again every ``stall_after_s``), and [] when one is again
        self.on_stall = on_stall
        self.stats = AggregatorStats()
        self.roster = Roster(exchange.store, self.manifest, lease_s=self.config.liveness.lease_s,
                             slots=slots or 2 * len(self.manifest.workers))
        self.gate = Gate(exchange, self.config, self.roster, name,
                         reduced=lambda p, r: r < self.next_round[p])
        self.pacer = Pacer(len(self.manifest.rounds))
        # a peers mean is never encoded: nothing is lost on the way down to feed back
        self.feedback = (self.config.codec.feedback_down
                         and not exchange.from_peers)
        self._norms: dict[tuple[int, int], list[float]] = {}
        self._progress_at = time.monotonic()
        self._progress_wall = _utc_now()
        self._stall_reported = 0.0
        self.stalled: list[Stall] = []
        self._resume()
        self._theta: dict[tuple[int, int], float] = {}
        self.trust = Trust(self.config, self.roster, send_step=self.gate.send_step,
                           theta_norm=self.theta_norm, fragments=len(self.outer),
                           norms_of=self._norms_of, record=self.exchange.record_rejection,
                           name=self.name)

    # -- state ---------------------------------------------------------------------
    def _resume(self) -> None:
        """Load each fragment's newest canonical checkpoint (or the initial params)."""
        init = load_initial(self.exchange, len(self.manifest.fragments))
        self.theta_norms = [float(v.norm()) for v in init]  # the norm guard's yardstick
        self.outer: list[OuterState] = []
        self.residual: list[torch.Tensor | None] = []
        self.next_round: list[int] = []
        for p, params in enumerate(init):
            state = OuterState(params, self.config.outer.lr, self.config.outer.momentum)
            residual = None
            latest = latest_global(self.exchange, p)
            if latest is None:
                self.next_round.append(0)
            else:
                arrays, _meta = read_checkpoint(self.exchange.store, latest[1])
                residual = restore_outer(state, arrays)
                self.next_round.append(latest[0] + 1)
                self.gate.restore(p, self.exchange.mean_commit(p, latest[0]))
                log.info("aggregator %s: fragment %d resumes at round %d",
                         self.name, p, latest[0] + 1)
            self.outer.append(state)
            self.residual.append(residual)

    @property
    def done(self) -> bool:
        return all(r >= n for r, n in zip(self.next_round, self.manifest.rounds, strict=True))

    def canonical(self, fragment: int) -> torch.Tensor:
        """The canonical outer parameters of ``fragment`` (flat float32)."""
        return self.outer[fragment].params

    def momentum(self, fragment: int) -> torch.Tensor | None:
        return self.outer[fragment].momentum_buffer

    # -- the loop ------------------------------------------------------------------
    def run(
        self,
        stop: threading.Event | None = None,
        timeout: float | None = None,
        poll_interval: float | None = None,
    ) -> AggregatorStats:
        """Process rounds until every fragment has all its rounds, ``stop`` is set,
        or ``timeout`` seconds pass (then TimeoutError)."""
        stop = stop or threading.Event()
        start = time.monotonic()
        base = poll_interval if poll_interval is not None else self.config.liveness.poll_interval_s
        delay = base
        while not self.done:
            if stop.is_set():
                break
            if outlast(self.poll_once, patience_s=self.config.liveness.outage_s, log=log,
                       what=f"aggregator {self.name}", stop=stop.is_set,
                       pause_s=self.config.liveness.poll_max_s):
                delay = base
                continue
            self._check_stall()
            if timeout is not None and time.monotonic() - start > timeout:
                raise TimeoutError(
                    f"aggregator {self.name}: rounds still open after {timeout:.0f} s: "
                    f"next rounds {self.next_round} of {self.manifest.rounds}"
                )
            stop.wait(self.pacer.delay(time.monotonic(), self.open_rounds(), delay, base))
            delay = min(delay * 1.5, self.config.liveness.poll_max_s)
        return self.stats

    def open_rounds(self) -> list[tuple[int, int]]:
        """(fragment, round) of each fragment's next round not applied yet."""
        return [(p, r) for p, r in enumerate(self.next_round) if r < self.manifest.rounds[p]]

    def poll_once(self) -> bool:
        """Try to complete the next round of every fragment; True if any progressed."""
        progressed = False
        self.roster.refresh()  # admits joiners, renews leases (rate-limited)
        for p in range(len(self.outer)):
            while self.next_round[p] < self.manifest.rounds[p] and self._try_round(p):
                progressed = True
        if progressed:
            self._progress_at, self._progress_wall = time.monotonic(), _utc_now()
            if self.stalled:
                log.info("aggregator %s: rounds are applied again", self.name)
                self.stalled = []
                if self.on_stall is not None:
                    self.on_stall([])
        return progressed

    def _check_stall(self) -> None:
        """Say which rounds wait for whom once nothing was applied for a while, so a
        run never waits silently (again every ``stall_after_s`` while it lasts)."""
        now = time.monotonic()
        waited = now - self._progress_at
        if waited < self.config.liveness.stall_after_s or now - self._stall_reported < self.config.liveness.stall_after_s:
            return
        self._stall_reported = now
        self.stalled = [
            Stall(p, r, sorted(self.gate.expected(p, r) - self.gate.inbox(p, r).arrived),
                  self._progress_wall, waited)
            for p, r in self.open_rounds()
        ]
        log.warning("aggregator %s: stalled: no round applied for %.0f s; %s", self.name,
                    waited, "; ".join(s.describe() for s in self.stalled))
        if self.on_stall is not None:
            self.on_stall(list(self.stalled))

    # -- one round -----------------------------------------------------------------
    def _collect(self, p: int, r: int, committed: list[str]) -> Inbox:
        """Read and verify the contributions of (p, r) committed since the last poll:
        a bad one is rejected (and the reason recorded) as soon as it is seen. Any
        member's contribution counts, expected or not (a returning worker's)."""
        inbox = self.gate.inbox(p, r)
        for w in committed:
            if w in inbox.arrived or not self.roster.takes_part(w, p, r):
                continue
            if self.hold_back is not None and self.hold_back(p, r, w):
                inbox.withheld.add(w)  # a benchmark's lateness: seen only in a later mean
                continue
            # a contribution renews its member's lease and is progress: a member that
            # writes no status (the Python API) is live while it contributes
            self.roster.contributed(w, self.gate.send_step(p, r))
            got = self._fetch(p, r, w, inbox.rejected)
            if got is not None:
                inbox.values[w], inbox.tokens[w], inbox.norms[w] = got
            inbox.last = self.roster.clock()
        return inbox

    def _fetch(self, p: int, k: int, w: str,
               rejected: dict[str, str], key: str | None = None
               ) -> tuple[Coded, int, float] | None:
        """One contribution, verified and guarded; None (and a recorded rejection)
        when it is bad. It is kept encoded: a first pass decodes it a chunk at a time
        for its norm (and finds a chunk that does not decode or holds NaN/Inf), and
        the mean decodes it again into its sum, so the aggregator never holds a
        decoded copy of each contribution (nor a float64 one for the norm)."""
        try:
            value, commit = self.exchange.hold_delta(p, k, w)
            tokens = int(commit.get("tokens", 0))
            self.trust.claim(p, k, w, tokens)
            norm = math.sqrt(value.sumsq())
            self.trust.guard(p, k, w, norm)
        except BAD_CONTRIBUTION as exc:  # anything else (the store down) propagates
            rejected[key or w] = f"{type(exc).__name__}: {exc}"
            log.warning("aggregator %s: rejected %s", self.name, exc)
            self.exchange.record_rejection(p, k, w, rejected[key or w])
            return None
        return value, tokens, norm

    def theta_norm(self, p: int) -> float:
        """The norm guard's yardstick for fragment ``p``: the larger of the norm of its
        initial parameters and of its canonical ones now (after the rounds applied:
        the same at a restart, so the same decisions), once per round."""
        key = (p, self.next_round[p])
        if key not in self._theta:
            self._theta = {k: v for k, v in self._theta.items() if k[0] != p}
            self._theta[key] = max(self.theta_norms[p], self._current_norm(p))
        return self._theta[key]

    def _current_norm(self, p: int) -> float:
        return float(self.outer[p].params.norm())

    def _norms_of(self, p: int, k: int) -> list[float]:
        if (p, k) not in self._norms:
            commit = self.exchange.mean_commit(p, k) or {}
            self._norms[(p, k)] = [float(v) for v in (commit.get("norms") or {}).values()]
        return self._norms[(p, k)]

    def _mean(self, p: int, values: dict[str, Coded],
              weights: dict[str, float]) -> torch.Tensor:
        """The weighted float32 mean of ``values`` (zeros when there are none): the
        exchange's `weighted_sum`, which peers-mean readers use too, decoding each
        contribution a chunk at a time into the one sum."""
        return torch.from_numpy(weighted_sum(self.manifest.numel(p), values, weights))

    def _weights(self, tokens: dict[str, int], r: int) -> dict[str, float]:
        """Token weights (uniform when no tokens were counted) of round ``r``'s mean;
        with ``late: decay`` a contribution ``s`` rounds late counts ``2**-s`` of its
        tokens (staleness never raises a weight)."""
        scaled = dict(tokens)
        if self.config.membership.late == "decay":
            for key in tokens:
                s = r - contribution_of(key, r)[1]
                scaled[key] = tokens[key] * LATE_DECAY ** s
        total = sum(scaled.values())
        return {w: (scaled[w] / total if total > 0 else 1.0 / len(scaled))
                for w in sorted(scaled)}

    def _try_round(self, p: int) -> bool:
        r = self.next_round[p]
        start = time.perf_counter()
        commit = self.exchange.mean_commit(p, r)
        adopted = commit is not None
        rejected: dict[str, str] = {}
        x = mean = None
        inbox = None
        if commit is None:
            committed = self.exchange.committed_workers(p, r)
            if not committed:
                return False
            self.pacer.arrived(p, r, time.monotonic())
            inbox = self._collect(p, r, committed)
            if not self.gate.ready(p, r, inbox):
                return False
            owed_before = set(self.gate.owed[p])
            late, dropped, absent = self.gate.settle(p, r, inbox, self._fetch)
            self.trust.peers(p, r, inbox)
            rejected = dict(inbox.rejected)
            self.stats.rejected += len(rejected)
            weights = self._weights(inbox.tokens, r)
            acc = self._mean(p, inbox.values, weights)
            x = self._with_residual(p, acc) if weights else acc
            published = self.exchange.publish_mean(
                p, r, self.name, x.numpy(), weights=weights,
                extra={"rejected": rejected,
                       "participants": sorted(w for w in weights if "@" not in w),
                       "expected": sorted(inbox.expected),
                       "late": late, "dropped": dropped, "absent": absent,
                       "owed": sorted([w, k] for w, k in self.gate.owed[p]),
                       "grace_s": round(self.gate.grace.seconds(), 3),
                       "norms": {w: inbox.norms[w] for w in sorted(weights)}},
            )
            self.fault("published", p, r)
            if published.created:
                mean = torch.from_numpy(np.asarray(published.decoded))
            else:
                self.gate.owed[p] = owed_before
                adopted, commit = True, published.commit
        if adopted:
            mean, x = self._replay(p, r, commit)
            weights = commit["weights"]
            self.gate.restore(p, commit)
            late, dropped = commit.get("late", []), commit.get("dropped", [])
            absent = commit.get("absent", [])
        # a checkpoint write that fails (an outage) is retried by the next poll, which
        # adopts the committed mean: the step must not have happened twice by then
        before = self.outer[p].state_dict(), self.residual[p]
        try:
            if weights:
                if self.feedback:
                    self.residual[p] = x - mean
                self.outer[p].step(mean)
            else:  # every contribution rejected: the round is recorded, never a step
                log.warning("aggregator %s: fragment %d round %d: no usable contribution; "
                            "the outer state is not stepped", self.name, p, r)
            self.trust.halt_check(p, r, weights, rejected or (commit or {}).get("rejected") or {},
                                  self.outer[p].params)
            self.fault("stepped", p, r)
            self._checkpoint(p, r, weights)
            self.fault("checkpointed", p, r)
        except BaseException:
            self.outer[p].load(before[0]["params"], before[0]["momentum"])
            self.residual[p] = before[1]
            raise
        self.stats.late += len(late)
        self.stats.dropped += len(dropped)
        grad_norm = float(mean.norm())
        self.next_round[p] = r + 1
        self.gate.reduced(p, r, None if adopted else inbox)
        self._norms[(p, r)] = [float(v) for v in (commit or {}).get("norms", {}).values()] \
            if adopted else [inbox.norms[w] for w in sorted(weights)]
        report = RoundReport(p, r, dict(weights), rejected, adopted,
                             time.perf_counter() - start, grad_norm,
                             late=len(late), dropped=len(dropped), absent=len(absent),
                             expected=len(commit.get("expected", [])) if adopted
                             else len(inbox.expected))
        self.stats.rounds.append(report)
        if self.on_round is not None:
            self.on_round(report)
        log.info("aggregator %s: fragment %d round %d applied (%d contributions%s%s)", self.name,
                 p, r, len(weights), f", {len(late)} late" if late else "",
                 ", adopted" if adopted else "")
        return True

    def _replay(self, p: int, r: int, commit: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed mean and what this aggregator's pre-quantisation value would
        have been, so its error-feedback residual continues exactly."""
        got = self.exchange.fetch_mean(p, r)
        if got is None:  # pragma: no cover - commit was read a moment ago
            raise ObjectMissing(f"mean of fragment {p} round {r} vanished")
        mean = torch.from_numpy(np.asarray(got[0]))
        weights = commit["weights"]
        if not self.feedback or not weights:
            return mean, mean
        values = {}
        for key in sorted(weights):  # a contribution the committed mean used must be readable
            w, k = contribution_of(key, r)
            values[key] = self.exchange.hold_delta(p, k, w)[0]
        return mean, self._with_residual(p, self._mean(p, values, weights))

    def _with_residual(self, p: int, acc: torch.Tensor) -> torch.Tensor:
        """The value to publish: the mean plus the error-feedback residual (if on),
        added in place (``acc`` is a fresh sum no one else holds: one fragment-sized
        array less at the aggregator's peak, the same float32 additions)."""
        if not self.feedback or self.residual[p] is None:
            return acc
        return acc.add_(self.residual[p])

    def _checkpoint(self, p: int, r: int, weights: dict[str, float]) -> None:
        arrays = {"params": self.outer[p].params.numpy()}
        momentum = self.outer[p].momentum_buffer
        if momentum is not None:
            arrays["momentum"] = momentum.numpy()
        if self.residual[p] is not None:
            arrays["residual"] = self.residual[p].numpy()
        write_checkpoint(
            self.exchange.store,
            layout.global_state(p, r),
            layout.global_commit(p, r),
            arrays,
            {"fragment": p, "round": r, "weights": weights, "writer": self.name},
        )
        old = r - self.keep_checkpoints
        if self.keep_checkpoints and old >= 0:
            # the commit first: a half-deleted checkpoint is never found as "newest";
            # deleting what is already gone (a racing aggregator did it) is fine
            self.exchange.store.delete(layout.global_commit(p, old))
            self.exchange.store.delete_prefix(layout.global_state(p, old) + "/")
