"""The per-worker synchroniser: call ``step()`` after every inner optimizer step.

It follows the schedule of docs/algorithms.md section 5 with two verbs. At a fragment's
send step it computes ``delta = theta_out - theta_m`` and hands it to the rounds in
flight (`diloco.inflight`: encode with error feedback, upload, poll for the mean).
At the merge step it collects what its mode needs from them (the mean, waited for
in the blocking modes; the means that have arrived, in eager mode), computes the
outer gradient with a rule of `diloco.rules`, steps the outer state and merges the
live weights. All outer state is float32 on the CPU, as on the aggregator, so in
the non-eager modes every worker holds the canonical outer state bit for bit; with
``sync.outer.device: device`` it is on the model's device instead (on a GPU the
deltas go to the host, and the means to the device, through pinned memory).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from diloco import rules
from diloco.config import SyncConfig
from diloco.fragments import FragmentPlan, to_device, to_host
from diloco.inflight import InFlight, MergeAbandoned, Round
from diloco.outer import OuterState
from diloco.overlap import AutoOverlap, FixedOverlap
from diloco.run import load_initial
from diloco.schedule import Schedule
from storage.errors import TransientStoreError
from storage.exchange import Exchange
from storage.spec import RunManifest

__all__ = ["Behind", "MergeAbandoned", "SyncStats", "Synchronizer"]

log = logging.getLogger(__name__)


@dataclass
class SyncStats:
    """What the synchroniser did, for metrics and benchmarks."""

    steps: int = 0
    rounds_sent: int = 0
    rounds_merged: int = 0
    wait_seconds: float = 0.0
    waits: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    late_means: int = 0
    rebases: int = 0

    _SAVED = ("wait_seconds", "rounds_sent", "rounds_merged", "late_means", "rebases")

    def record_wait(self, seconds: float) -> None:
        self.wait_seconds += seconds
        self.waits.append(seconds)

    def state_dict(self) -> dict:
        """The counters a resumed worker continues from (per-wait lists restart)."""
        return {name: getattr(self, name) for name in self._SAVED}

    def load(self, state: dict) -> None:
        for name in self._SAVED:  # older checkpoints may lack some: they count from 0
            setattr(self, name, type(getattr(self, name))(state.get(name, 0)))


class Behind(RuntimeError):
    """The round this worker was about to send would be dropped as too stale: the
    others are more than ``max_staleness`` rounds ahead. The caller heals: it takes
    the canonical state (`diloco.bootstrap.frontier`) and `Synchronizer.rebase`."""

    def __init__(self, worker: str, fragment: int, round: int):
        super().__init__(f"worker {worker}: fragment {fragment} round {round} is more than "
                         "max_staleness rounds behind the run; healing to the canonical state")
        self.fragment, self.round = fragment, round


def _check_member(manifest: RunManifest, worker: str, plan: FragmentPlan,
                  config: SyncConfig, joined: bool = False) -> None:
    """Refuse a worker the run does not list (unless it joined), or a plan that does
    not cut the model the way the run's manifest and sync config say, before
    anything is read."""
    if worker not in manifest.workers and not joined:
        raise ValueError(
            f"worker {worker!r} is not in run {manifest.run_id!r} (workers: "
            f"{', '.join(manifest.workers)})"
        )
    plan.check_against(manifest.model_dump()["fragments"])
    if len(plan) != config.schedule.fragments:
        raise ValueError(
            f"the plan has {len(plan)} fragments but fragments (P) = {config.schedule.fragments}"
        )


class Synchronizer:
    """Keeps one worker's replica in step with the others through the store."""

    def __init__(
        self,
        model: nn.Module,
        exchange: Exchange,
        worker: str,
        plan: FragmentPlan,
        config: SyncConfig | None = None,
        *,
        initialise: bool = True,
        stop: threading.Event | None = None,
        stop_patience_s: float = 10.0,
        on_stall: Callable[[int, int, float], None] | None = None,
        joined: bool = False,
        heal: bool = True,
    ):
        """``stop``: once set, a merge blocked on a mean waits at most
        ``stop_patience_s`` more seconds (the mean may still come, if the other
        workers are running) and then raises `MergeAbandoned`. Without it a worker
        whose peers have stopped would wait for a mean that never comes.
        ``on_stall(fragment, round, seconds)``: told every ``stall_after_s`` while a
        merge waits for a mean (the worker's status shows it). ``joined``: the worker
        joined mid-run (its membership is checked by the caller). ``heal``: before
        each send, check that the round is not past ``max_staleness`` (one small
        read) and raise `Behind` if it is."""
        manifest = exchange.manifest
        self.model, self.exchange, self.worker, self.plan = model, exchange, worker, plan
        self.config = config or SyncConfig.stored(manifest.sync)
        _check_member(manifest, worker, plan, self.config, joined)
        self.heal = heal
        self.schedule = Schedule(
            self.config.schedule.sync_every, self.config.schedule.fragments, self.config.schedule.send_offset
        )
        self.total_steps = manifest.total_steps
        self.rounds = list(manifest.rounds)
        self.own_weight = 1.0 / len(manifest.workers)
        self.alpha = self.config.schedule.merge_alpha
        self.eager = self.config.schedule.mode == "eager"
        self.stats = SyncStats()
        #: tau: fixed, or per merge point from measured latencies (overlap: auto)
        self.tau: FixedOverlap | AutoOverlap = FixedOverlap(self.schedule.overlap)
        if self.config.schedule.auto:
            self.tau = AutoOverlap(self.schedule.stride, self.total_steps,
                                   start=self.config.schedule.send_offset,
                                   margin=self.config.schedule.overlap_margin)
        init = load_initial(exchange, len(plan))
        #: where the outer state lives (sync.outer.device): the CPU or the model's device
        self.device = torch.device("cpu")
        if self.config.outer.device == "device":
            self.device = next(model.parameters()).device
        self.on_device = self.device.type != "cpu"
        self.outer = [OuterState(v, self.config.outer.lr, self.config.outer.momentum, self.device) for v in init]
        if initialise:
            for p, state in enumerate(self.outer):
                plan.scatter(model, p, state.params)
        self.inflight = InFlight(exchange, worker, len(plan), self.config,
                                 self.stats.record_wait, stop=stop,
                                 stop_patience_s=stop_patience_s, on_stall=on_stall,
                                 tau=self.tau)
        self._next_round = [0] * len(plan)
        self._tokens = 0
        self._tokens_at_send = [0] * len(plan)
        self._finished = False

    @property
    def residual(self) -> list[torch.Tensor | None]:
        """Error-feedback residual per fragment (None until a round left one)."""
        return self.inflight.residual

    @property
    def next_rounds(self) -> tuple[int, ...]:
        """Per fragment, the next round this worker sends (one past its last sent):
        what a starting worker compares with the run's reduced rounds, and what a
        leaving worker records."""
        return tuple(self._next_round)

    @property
    def waiting_for(self) -> tuple[int, int] | None:
        """(fragment, round) of the mean a merge is blocked on, else None."""
        return self.inflight.waiting_for

    # -- the training loop's entry points ------------------------------------------
    def step(self, tokens: int = 0, heal: bool | None = None) -> None:
        """Call after each inner optimizer step; ``tokens`` processed in that step.
        Raises `Behind` (having changed nothing) when a round due now would be too
        stale; ``heal=False`` sends it anyway."""
        heal = self.heal if heal is None else heal
        if self._finished:
            raise RuntimeError("step() after finish()")
        if self.stats.steps >= self.total_steps:
            raise RuntimeError(
                f"worker {self.worker}: step {self.stats.steps + 1} is past the run's "
                f"total_steps = {self.total_steps}"
            )
        events = self.schedule.events(self.stats.steps + 1, self.tau.per_point)
        for event in events:  # before anything moves: the caller may heal and redo
            if event.kind == "send" and heal and self._too_stale(event.fragment, event.round):
                raise Behind(self.worker, event.fragment, event.round)
        self.stats.steps += 1
        self._tokens += tokens
        for event in events:
            if event.kind == "send":
                self._send(event.fragment, event.round)
            else:
                self._merge(event.fragment, event.round)
        self.tau.stepped(self.stats.wait_seconds)
        for event in events:
            if event.kind == "merge":  # after merge point k, decide the tau of k + 1
                self.tau.merged(event.step // self.schedule.stride,
                                self.inflight.agreed_tau(event.fragment, event.round),
                                worker=self.worker)

    @property
    def overlaps(self) -> list[int]:
        """tau per fragment in force: the newest decided (``overlap: auto``), else
        the configured one."""
        return self.tau.current(len(self.plan))

    def _too_stale(self, p: int, r: int) -> bool:
        """Whether round ``r`` of ``p`` would be dropped: the mean ``max_staleness``
        rounds later is committed already."""
        later = r + self.config.membership.max_staleness
        try:
            if later >= self.rounds[p] or self.exchange.mean_commit(p, later) is None:
                return False
            # a worker replaying rounds it had sent before a crash is not behind
            return self.worker not in self.exchange.committed_workers(p, r)
        except TransientStoreError:  # undecided: send (a stale round is still settled)
            return False

    def rebase(self, step: int, rounds: list[int], outer: list[OuterState]) -> None:
        """Start again after inner step ``step`` from the canonical state: ``rounds[p]``
        rounds of fragment p applied, ``outer[p]`` their outer state. Rounds in flight
        are finished uploading (the aggregator may still apply them late) and
        forgotten; the live weights become the outer ones; the error-feedback
        residuals restart (they belonged to the abandoned trajectory)."""
        self.inflight.drain()
        self.inflight.reset()
        for p, state in enumerate(outer):
            self.outer[p].load(state.params, state.momentum_buffer)
            self.plan.scatter(self.model, p, self.outer[p].params)
        self.stats.steps = step
        self._next_round = list(rounds)
        self._tokens_at_send = [self._tokens] * len(self.plan)
        self.tau.ensure(step // self.schedule.stride + 1)
        self.stats.rebases += 1
        log.info("worker %s: rebased to step %d, rounds %s", self.worker, step, rounds)

    def finish(self) -> None:
        """End of training: complete rounds in flight, send the final rounds and apply
        every outstanding mean, so nothing a worker computed is lost."""
        if self._finished:
            return
        if self.stats.steps != self.total_steps:
            raise RuntimeError(
                f"worker {self.worker}: finish() after {self.stats.steps} steps; the run "
                f"has total_steps = {self.total_steps}"
            )
        try:
            for p in range(len(self.plan)):
                for sent in [s for s in self.inflight.of(p) if not s.own_applied]:
                    self._merge(p, sent.round)
                if self._next_round[p] < self.rounds[p]:
                    r = self._next_round[p]
                    self._send(p, r, final=True)
                    self._merge(p, r, final=True)
                if self.eager:
                    self._apply_outstanding(p)
            self.inflight.drain()
        finally:
            self._finished = True
            self.close()

    def close(self) -> None:
        """Stop background threads (without waiting for rounds in flight)."""
        self.inflight.close()

    def mean_arrived(self, p: int, r: int, timeout: float | None = 0.0) -> bool:
        """Whether the mean of fragment ``p`` round ``r`` (already sent) has reached
        this worker, waiting up to ``timeout`` seconds (None: for ever) for it. A
        watcher's wait: not counted in ``stats``."""
        if r >= self._next_round[p]:
            raise ValueError(f"worker {self.worker}: fragment {p} round {r} is not sent yet")
        return self.inflight.wait_arrival(p, r, timeout)

    # -- the two verbs ---------------------------------------------------------------
    def _send(self, p: int, r: int, final: bool = False) -> None:
        """Send fragment ``p``'s round ``r``: its outer gradient joins the rounds in flight."""
        if r != self._next_round[p]:
            raise RuntimeError(f"fragment {p}: sending round {r}, expected {self._next_round[p]}")
        if r >= self.rounds[p]:
            raise RuntimeError(f"fragment {p}: round {r} is past the run's {self.rounds[p]} rounds")
        self._next_round[p] = r + 1
        live = self.plan.gather(self.model, p, on_device=self.on_device)
        # written over the gathered copy: one fragment-sized array per send, not two
        delta = to_host(rules.outer_gradient(self.outer[p].params, live, out=live))
        tokens = self._tokens - self._tokens_at_send[p]
        self._tokens_at_send[p] = self._tokens
        self.inflight.send(p, r, delta, tokens=tokens, final=final, step=self.stats.steps,
                           tau_next=self.tau.propose())
        self.stats.rounds_sent += 1
        log.debug("worker %s: sent fragment %d round %d", self.worker, p, r)

    def _merge(self, p: int, r: int, final: bool = False) -> None:
        """Merge fragment ``p``'s round ``r``: the mode's outer gradient, the outer step,
        the lerp into the live weights (a final round lands on the outer value)."""
        sent = self.inflight.get(p, r)
        if not self.eager:
            mean, commit = self.inflight.wait_mean(sent)
            # a round whose every contribution was rejected is not a step (as on the
            # aggregator): the outer state stays, the live weights still merge into it
            grad = torch.from_numpy(np.asarray(mean)) if commit.get("weights") else None
            sent.own_applied = sent.correction_applied = True
        elif self.config.schedule.eager_rule == "pure" and not final:
            grad = self._pure_eager(sent)
        elif self.config.schedule.eager_rule == "naive":
            grad = self._naive_delayed(sent, final)
        else:
            grad = self._adaptive_eager(sent, wait=final)
        if grad is not None:
            grad = to_device(grad, self.device)
        alpha = 0.0 if final else self.alpha
        live = None if alpha == 0.0 else self.plan.gather(self.model, p, on_device=self.on_device)
        self.plan.scatter(self.model, p, rules.merge(self.outer[p], grad, alpha, live, out=live))
        self.stats.rounds_merged += 1
        self.inflight.forget(p)

    # -- what each eager rule needs, then the rule -----------------------------------
    def _pure_eager(self, sent: Round) -> torch.Tensor:
        own, previous = self.inflight.own(sent), None
        if sent.round > 0:
            prev = self.inflight.get(sent.fragment, sent.round - 1)
            _, commit = self.inflight.wait_mean(prev)  # its weight is in the commit
            w_prev = float(commit["weights"].get(self.worker, 0.0))
            previous = rules.Arrived(self.inflight.mean(prev), self.inflight.own(prev), w_prev)
            prev.correction_applied = True
            self.stats.staleness.append(1)
        sent.own_weight, sent.own_applied = self.own_weight, True
        return rules.pure_eager(own, self.own_weight, previous)

    def _naive_delayed(self, sent: Round, final: bool) -> torch.Tensor | None:
        """The naive delayed rule: the means of the earlier rounds not applied yet
        (normally round ``r - 1`` alone; none in round 0: no step), each its own outer
        step in round order, as the aggregator took them; the final round adds its own
        mean. Nothing of round ``r`` is applied at its merge (``own_weight`` 0), so the
        worker runs the canonical trajectory one round late and ends on it. Returns
        the last mean (the merge's step), the earlier ones already stepped."""
        p, r = sent.fragment, sent.round
        sent.own_weight, sent.own_applied = 0.0, True
        owed = self.inflight.owed(p, upto=r if final else r - 1)
        means = []
        for s in owed:
            self.inflight.wait_mean(s)
            means.append(self.inflight.mean(s))
            s.correction_applied = True
            self.stats.staleness.append(r - s.round)
        for mean in means[:-1]:
            self.outer[p].step(to_device(mean, self.device))
        return means[-1] if means else None

    def _adaptive_eager(self, sent: Round, wait: bool) -> torch.Tensor:
        p, r = sent.fragment, sent.round
        owed = self.inflight.owed(p, upto=r)
        if wait:  # the final round: every mean of the fragment, so all is applied once
            for s in owed:
                self.inflight.wait_mean(s)
        arrived = [s for s in owed if s.arrived]  # decided once, before the arithmetic
        sent.own_weight, sent.own_applied = self.own_weight, True
        earlier = [s for s in arrived if s is not sent]
        if sent in arrived:
            mean, own = self.inflight.mean(sent), None
        else:
            mean, own = None, self.inflight.own(sent)
            self.stats.late_means += 1
        grad = rules.adaptive_eager(mean, own, self.own_weight,
                                    [self.inflight.arrived(s) for s in earlier])
        for s in arrived:
            s.correction_applied = True
        self.stats.staleness.extend(r - s.round for s in earlier)
        return grad

    def _apply_outstanding(self, p: int) -> None:
        """Eager modes at the end, when no final round carried them: wait for every
        mean of fragment ``p``, then apply the others' parts not applied yet as a
        correction (`rules.correct`: no momentum, not a round). The naive rule owes
        whole means: each is an outer step, as on the aggregator."""
        owed = self.inflight.owed(p)
        for s in owed:
            self.inflight.wait_mean(s)
        if self.config.schedule.eager_rule == "naive":
            for s in owed:
                self.outer[p].step(to_device(self.inflight.mean(s), self.device))
                s.correction_applied = True
            if owed:
                self.plan.scatter(self.model, p, self.outer[p].params)
            return
        correction = rules.outstanding([self.inflight.arrived(s) for s in owed])
        for s in owed:
            s.correction_applied = True
        if correction is not None:
            self.plan.scatter(self.model, p,
                              rules.correct(self.outer[p], to_device(correction, self.device)))

    # -- checkpoint and resume -------------------------------------------------------
    def state_dict(self, copy: bool = True) -> dict:
        """The synchroniser's state at a step boundary, for a worker checkpoint.

        Waits until every round sent so far is committed, so that a resumed worker
        can read its own contributions back from the store instead of keeping them
        in the checkpoint. Rounds in flight are recorded and their means awaited
        again after the resume. ``copy=False``: the outer state and residuals
        themselves, not copies (3x the model's float32 size at a worker's
        checkpoint), for a caller that writes them out before the next step.
        """
        self.inflight.drain()
        outer = [o.state_dict() if copy else
                 {"params": o.params, "momentum": o.momentum_buffer} for o in self.outer]
        return {
            "steps": self.stats.steps,
            "tokens": self._tokens,
            "tokens_at_send": list(self._tokens_at_send),
            "next_round": list(self._next_round),
            "outer": outer,
            **self.inflight.state_dict(copy),  # "residual" and "sent"
            **self.stats.state_dict(),
            "overlap_auto": self.tau.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict` (the live weights are the caller's)."""
        if self.stats.steps or len(self.inflight):
            raise RuntimeError("load_state_dict() must come before the first step()")
        self.stats.steps = int(state["steps"])
        self._tokens = int(state["tokens"])
        self._tokens_at_send = [int(x) for x in state["tokens_at_send"]]
        self._next_round = [int(x) for x in state["next_round"]]
        for outer, saved in zip(self.outer, state["outer"], strict=True):
            outer.load(saved["params"], saved["momentum"])
        self.inflight.load_state_dict(state)
        self.stats.load(state)
        # overlap auto: the decided taus are replayed, not decided again
        self.tau.load_state_dict(state.get("overlap_auto"))
        self.tau.ensure(self.stats.steps // self.schedule.stride + 1)

    # -- introspection -------------------------------------------------------------
    def outer_params(self, p: int) -> torch.Tensor:
        return self.outer[p].params

    def outer_momentum(self, p: int) -> torch.Tensor | None:
        return self.outer[p].momentum_buffer
