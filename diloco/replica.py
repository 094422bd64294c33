"""The per-worker synchroniser: call ``step()`` after every inner optimizer step.

It follows the schedule of ALGORITHMS.md section 3: at a fragment's send step it
computes the outer gradient ``delta = theta_out - theta_m`` (plus the error-feedback
residual), hands it to a background thread that encodes and uploads it, and keeps
training; at the merge step it applies the outer step and merges into the live
weights with ``torch.lerp(theta_new, theta_m, alpha)``.

Modes:
- ``diloco`` / ``streaming``: the merge waits for the round's true mean; the time
  spent waiting is measured (``stats.wait_seconds``).
- ``eager`` with the ``adaptive`` rule (default): the merge never waits. It applies
  the worker's own fresh part ``w * delta_m^(r)`` plus, for every round whose true
  mean has arrived, the others' part ``delta^(k) - w * delta_m^(k)`` not applied
  yet, so each contribution is applied exactly once (section 4).
- ``eager`` with the ``pure`` rule: the paper's estimate
  ``(delta^(r-1) - w_m * delta_m^(r-1)) + w * delta_m^(r)``, blocking only if the
  previous round's mean has not arrived.

``w`` for the fresh part is ``1 / M`` (the weight a worker has when all process the
same number of tokens); the correction of each round uses the same ``w``, so a
worker whose true weight differs, or whose contribution was not used, is corrected
exactly when the mean arrives.

All outer state (outer parameters, momentum, residuals) is float32 on the CPU, as
on the aggregator, so in the non-eager modes every worker holds the aggregator's
canonical outer state bit for bit.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from diloco.config import SyncConfig
from diloco.fragments import FragmentPlan
from diloco.outer import OuterState
from diloco.run import load_initial
from diloco.schedule import Schedule
from storage.exchange import Exchange, Prepared, Published

log = logging.getLogger(__name__)


class MergeAbandoned(RuntimeError):
    """A merge stopped waiting for a round's mean because the caller asked to stop.

    The replica is then between an inner step and that step's merge, a state no
    checkpoint can describe: the worker should end without saving and resume from
    its last checkpoint, as after a crash."""

    def __init__(self, worker: str, fragment: int, round: int, waited: float):
        super().__init__(
            f"worker {worker}: stopped while waiting {waited:.0f} s for the mean of "
            f"fragment {fragment} round {round}"
        )
        self.fragment, self.round, self.waited = fragment, round, waited


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


@dataclass
class _Sent:
    """One round this worker sent: its own decoded value and what became of it."""

    fragment: int
    round: int
    encoded: Future  # -> Prepared
    uploaded: Future  # -> Published
    mean: Future  # -> (np.ndarray, commit)
    own_applied: bool = False
    correction_applied: bool = False
    own_weight: float = 0.0


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
    ):
        """``stop``: once set, a merge blocked on a mean waits at most
        ``stop_patience_s`` more seconds (the mean may still come, if the other
        workers are running) and then raises `MergeAbandoned`. Without it a worker
        whose peers have stopped would wait for a mean that never comes."""
        manifest = exchange.manifest
        if worker not in manifest.workers:
            raise ValueError(
                f"worker {worker!r} is not in run {manifest.run_id!r} (workers: "
                f"{', '.join(manifest.workers)})"
            )
        plan.check_against(manifest.model_dump()["fragments"])
        self.model = model
        self.exchange = exchange
        self.worker = worker
        self.plan = plan
        self.config = config or SyncConfig(**manifest.sync)
        self.schedule = Schedule(
            self.config.sync_every, self.config.fragments, self.config.send_offset
        )
        if len(plan) != self.config.fragments:
            raise ValueError(
                f"the plan has {len(plan)} fragments but fragments (P) = "
                f"{self.config.fragments}"
            )
        self.total_steps = manifest.total_steps
        self.rounds = list(manifest.rounds)
        self.own_weight = 1.0 / len(manifest.workers)
        self.alpha = self.config.merge_alpha
        self.eager = self.config.mode == "eager"
        self.stats = SyncStats()

        init = load_initial(exchange, len(plan))
        self.outer = [OuterState(v, self.config.eta, self.config.mu) for v in init]
        self.residual: list[torch.Tensor | None] = [None] * len(plan)
        if initialise:
            for p, state in enumerate(self.outer):
                plan.scatter(model, p, state.params)
        self._sent: dict[tuple[int, int], _Sent] = {}
        self._next_round = [0] * len(plan)
        self._tokens = 0
        self._tokens_at_send = [0] * len(plan)
        self._stop = threading.Event()
        self._abandon = stop
        self.stop_patience_s = stop_patience_s
        #: (fragment, round) of the mean a merge is blocked on, else None
        self.waiting_for: tuple[int, int] | None = None
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix=f"enc-{worker}")
        self._uploader = ThreadPoolExecutor(2, thread_name_prefix=f"up-{worker}")
        self._poller = ThreadPoolExecutor(len(plan) + 2, thread_name_prefix=f"poll-{worker}")
        self._finished = False

    # -- the training loop's entry points ------------------------------------------
    def step(self, tokens: int = 0) -> None:
        """Call after each inner optimizer step; ``tokens`` processed in that step."""
        if self._finished:
            raise RuntimeError("step() after finish()")
        if self.stats.steps >= self.total_steps:
            raise RuntimeError(
                f"worker {self.worker}: step {self.stats.steps + 1} is past the run's "
                f"total_steps = {self.total_steps}"
            )
        self.stats.steps += 1
        self._tokens += tokens
        for event in self.schedule.events(self.stats.steps):
            if event.kind == "send":
                self._send(event.fragment, event.round)
            else:
                self._merge(event.fragment, event.round)

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
                inflight = [k for (q, k), s in self._sent.items() if q == p and not s.own_applied]
                for r in inflight:
                    self._merge(p, r)
                if self._next_round[p] < self.rounds[p]:
                    r = self._next_round[p]
                    self._send(p, r, final=True)
                    self._merge(p, r, final=True)
                if self.eager:
                    self._apply_outstanding(p)
            for sent in self._sent.values():
                sent.uploaded.result()
        finally:
            self._finished = True
            self.close()

    def close(self) -> None:
        """Stop background threads (without waiting for rounds in flight)."""
        self._stop.set()
        for pool in (self._encoder, self._uploader, self._poller):
            pool.shutdown(wait=True, cancel_futures=True)

    # -- sends ---------------------------------------------------------------------
    def _send(self, p: int, r: int, final: bool = False) -> None:
        if r != self._next_round[p]:
            raise RuntimeError(f"fragment {p}: sending round {r}, expected {self._next_round[p]}")
        if r >= self.rounds[p]:
            raise RuntimeError(f"fragment {p}: round {r} is past the run's {self.rounds[p]} rounds")
        self._next_round[p] = r + 1
        live = self.plan.gather(self.model, p)
        delta = self.outer[p].params - live
        tokens = self._tokens - self._tokens_at_send[p]
        self._tokens_at_send[p] = self._tokens
        previous = self._sent.get((p, r - 1))
        encoded = self._encoder.submit(self._encode, p, r, delta, previous)
        uploaded = self._uploader.submit(self._upload, encoded, tokens, final, self.stats.steps)
        mean = self._poller.submit(self._await_mean, p, r)
        self._sent[(p, r)] = _Sent(p, r, encoded, uploaded, mean)
        self.stats.rounds_sent += 1
        log.debug("worker %s: sent fragment %d round %d", self.worker, p, r)

    def _encode(self, p: int, r: int, delta: torch.Tensor, previous: _Sent | None) -> Prepared:
        feedback = self.exchange.manifest.codec_up.name
        if self.config.feedback(feedback):
            if previous is not None:
                previous.encoded.result()  # its residual is set when it finishes
            if self.residual[p] is not None:
                delta = delta + self.residual[p]
        x = delta.numpy()
        prepared = self.exchange.prepare_delta(p, r, self.worker, x)
        if self.config.feedback(feedback):
            self.residual[p] = torch.from_numpy(x - prepared.decoded)
        return prepared

    def _upload(self, encoded: Future, tokens: int, final: bool, step: int) -> Published:
        prepared: Prepared = encoded.result()
        return self.exchange.publish_prepared(
            prepared, tokens=tokens, extra={"final": final, "step": step}
        )

    def _await_mean(self, p: int, r: int) -> tuple[np.ndarray, dict]:
        delay = self.config.poll_interval_s
        while not self._stop.is_set():
            got = self.exchange.fetch_mean(p, r)
            if got is not None:
                return got
            self._stop.wait(delay)
            delay = min(delay * 1.5, self.config.poll_max_s)
        raise RuntimeError(f"worker {self.worker}: stopped while waiting for fragment {p} round {r}")

    # -- merges --------------------------------------------------------------------
    def _own(self, sent: _Sent) -> torch.Tensor:
        """This worker's decoded contribution as the aggregator sees it."""
        if sent.uploaded.done():
            return torch.from_numpy(np.asarray(sent.uploaded.result().decoded))
        return torch.from_numpy(np.asarray(sent.encoded.result().decoded))

    def _correction(self, sent: _Sent) -> torch.Tensor:
        """The others' part of a round: ``delta^(k) - w * delta_m^(k)``."""
        mean = torch.from_numpy(np.asarray(sent.mean.result()[0]))
        return mean - sent.own_weight * self._own(sent)

    def _wait(self, sent: _Sent):
        """The mean of ``sent``'s round, waiting for it if need be (timed)."""
        future, p, r = sent.mean, sent.fragment, sent.round
        if future.done():
            return future.result()
        start = time.perf_counter()
        self.waiting_for = (p, r)
        stopped_at = None
        try:
            while True:
                try:
                    value = future.result(timeout=0.25)
                    break
                except TimeoutError:
                    if self._abandon is None or not self._abandon.is_set():
                        continue
                    now = time.perf_counter()
                    stopped_at = stopped_at or now
                    if now - stopped_at >= self.stop_patience_s:
                        raise MergeAbandoned(self.worker, p, r, now - start) from None
        finally:
            self.waiting_for = None
        waited = time.perf_counter() - start
        self.stats.wait_seconds += waited
        self.stats.waits.append(waited)
        return value

    def _merge(self, p: int, r: int, final: bool = False) -> None:
        sent = self._sent[(p, r)]
        if not self.eager:
            mean = torch.from_numpy(np.asarray(self._wait(sent)[0]))
            sent.own_applied = sent.correction_applied = True
            grad = mean
        elif self.config.eager_rule == "pure" and not final:
            grad = self._pure_eager(sent)
        else:
            grad = self._adaptive_eager(sent, wait=final)
        new = self.outer[p].step(grad)
        alpha = 0.0 if final else self.alpha
        if alpha == 0.0:
            self.plan.scatter(self.model, p, new)
        else:
            live = self.plan.gather(self.model, p)
            self.plan.scatter(self.model, p, torch.lerp(new, live, alpha))
        self.stats.rounds_merged += 1
        self._forget(p)

    def _pure_eager(self, sent: _Sent) -> torch.Tensor:
        p, r = sent.fragment, sent.round
        own = self._own(sent)
        w = self.own_weight
        if r == 0:
            others = torch.zeros_like(own)
        else:
            prev = self._sent[(p, r - 1)]
            mean, commit = self._wait(prev)
            w_prev = float(commit["weights"].get(self.worker, 0.0))
            # evaluate in exactly this order (ALGORITHMS.md section 4)
            others = torch.from_numpy(np.asarray(mean)) - w_prev * self._own(prev)
            prev.correction_applied = True
            self.stats.staleness.append(1)
        sent.own_weight = w
        sent.own_applied = True
        return others + w * own

    def _adaptive_eager(self, sent: _Sent, wait: bool) -> torch.Tensor:
        p, r = sent.fragment, sent.round
        if wait:  # the final round: every mean of the fragment, so all is applied once
            for (q, k), s in sorted(self._sent.items()):
                if q == p and k <= r and not s.correction_applied:
                    self._wait(s)
        pending = sorted(
            k for (q, k), s in self._sent.items()
            if q == p and k <= r and not s.correction_applied and s.mean.done()
        )
        sent.own_weight = self.own_weight
        if r in pending:
            grad = torch.from_numpy(np.asarray(sent.mean.result()[0])).clone()
            sent.correction_applied = True
        else:
            grad = self.own_weight * self._own(sent)
            self.stats.late_means += 1
        sent.own_applied = True
        for k in pending:
            if k == r:
                continue
            old = self._sent[(p, k)]
            grad = grad + self._correction(old)
            old.correction_applied = True
            self.stats.staleness.append(r - k)
        return grad

    def _apply_outstanding(self, p: int) -> None:
        """Eager modes at the end, when no final round carried them: wait for every
        mean of fragment ``p`` and apply the others' parts not applied yet.

        This is a correction, not a round: it moves the outer parameters by
        ``-eta * correction`` without touching the momentum, so a zero correction (one
        worker, or means that matched the estimate) changes nothing.
        """
        grad = None
        for (q, _k), sent in sorted(self._sent.items()):
            if q != p or sent.correction_applied:
                continue
            self._wait(sent)
            part = self._correction(sent)
            grad = part if grad is None else grad + part
            sent.correction_applied = True
        if grad is not None:
            state = self.outer[p]
            with torch.no_grad():
                state.params.add_(grad, alpha=-state.lr)
            self.plan.scatter(self.model, p, state.params)

    def _forget(self, p: int) -> None:
        """Drop rounds of ``p`` that are fully applied and no longer referenced."""
        done = sorted(
            k for (q, k), s in self._sent.items()
            if q == p and s.own_applied and s.correction_applied and s.uploaded.done()
        )
        # keep the newest one: the pure rule and error feedback look one round back
        for k in done[:-1]:
            del self._sent[(p, k)]

    # -- checkpoint and resume -------------------------------------------------------
    def state_dict(self) -> dict:
        """The synchroniser's state at a step boundary, for a worker checkpoint.

        Waits until every round sent so far is committed, so that a resumed worker
        can read its own contributions back from the store instead of keeping them
        in the checkpoint. Rounds in flight are recorded and their means awaited
        again after the resume.
        """
        for sent in self._sent.values():
            sent.uploaded.result()
        return {
            "steps": self.stats.steps,
            "tokens": self._tokens,
            "tokens_at_send": list(self._tokens_at_send),
            "next_round": list(self._next_round),
            "outer": [
                {"params": o.params.clone(),
                 "momentum": None if o.momentum_buffer is None else o.momentum_buffer.clone()}
                for o in self.outer
            ],
            "residual": [None if r is None else r.clone() for r in self.residual],
            "sent": [
                {"fragment": s.fragment, "round": s.round, "own_weight": s.own_weight,
                 "own_applied": s.own_applied, "correction_applied": s.correction_applied}
                for s in self._sent.values()
            ],
            "wait_seconds": self.stats.wait_seconds,
            "rounds_sent": self.stats.rounds_sent,
            "rounds_merged": self.stats.rounds_merged,
            "late_means": self.stats.late_means,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict` (the live weights are the caller's)."""
        if self.stats.steps or self._sent:
            raise RuntimeError("load_state_dict() must come before the first step()")
        self.stats.steps = int(state["steps"])
        self._tokens = int(state["tokens"])
        self._tokens_at_send = [int(x) for x in state["tokens_at_send"]]
        self._next_round = [int(x) for x in state["next_round"]]
        for outer, saved in zip(self.outer, state["outer"], strict=True):
            outer.load(saved["params"], saved["momentum"])
        self.residual = [None if r is None else r.clone() for r in state["residual"]]
        for entry in state["sent"]:
            p, r = int(entry["fragment"]), int(entry["round"])
            value, commit = self.exchange.fetch_delta(p, r, self.worker)
            done: Future = Future()
            done.set_result(Published(value, commit, False))
            mean = self._poller.submit(self._await_mean, p, r)
            self._sent[(p, r)] = _Sent(
                p, r, done, done, mean,
                own_applied=bool(entry["own_applied"]),
                correction_applied=bool(entry["correction_applied"]),
                own_weight=float(entry["own_weight"]),
            )
        self.stats.wait_seconds = float(state.get("wait_seconds", 0.0))
        self.stats.rounds_sent = int(state.get("rounds_sent", 0))
        self.stats.rounds_merged = int(state.get("rounds_merged", 0))
        self.stats.late_means = int(state.get("late_means", 0))

    # -- introspection -------------------------------------------------------------
    def outer_params(self, p: int) -> torch.Tensor:
        return self.outer[p].params

    def outer_momentum(self, p: int) -> torch.Tensor | None:
        return self.outer[p].momentum_buffer
