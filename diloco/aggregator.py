"""The aggregator: reduce the workers' outer gradients and step the canonical model.

For each fragment, round after round: list the committed contributions, wait for
every worker (or, once ``deadline_s`` has passed since the first one arrived, for a
quorum), fetch and verify each (a corrupt, partial, non-finite or wrong-shaped one
is rejected, recorded and never applied), take the token-weighted float32 mean,
publish it encoded (with the aggregator's own error feedback), apply the outer step
with the decoded published mean, and checkpoint the canonical state.

All state is in the store. Killed at any point and restarted, the aggregator loads
each fragment's newest checkpoint and replays later rounds from their committed
means, reaching the same bits. Two aggregators on one run race only on create-only
commits: one mean per (fragment, round); the loser adopts the winner's mean.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from diloco.config import SyncConfig
from diloco.outer import OuterState
from diloco.run import latest_global, load_initial
from storage import layout
from storage.checkpoints import read_checkpoint, write_checkpoint
from storage.errors import (
    CorruptObject,
    NonFiniteValues,
    ObjectMissing,
    PartialObject,
    ShapeMismatch,
)
from storage.exchange import Exchange

log = logging.getLogger(__name__)

# A bad contribution is one of these; anything else (the store unreachable) is not
# the worker's fault and propagates.
REJECTABLE = (CorruptObject, PartialObject, ShapeMismatch, NonFiniteValues, ObjectMissing)


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


@dataclass
class AggregatorStats:
    rounds: list[RoundReport] = field(default_factory=list)
    rejected: int = 0


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
        keep_checkpoints: int = 0,
    ):
        """``keep_checkpoints``: round checkpoints of the canonical state kept per
        fragment (0 keeps all). Each is the fragment's float32 parameters and
        momentum, so a long run of a large model needs a bound; resuming reads only
        the newest."""
        layout.check_name("aggregator", name)
        if keep_checkpoints < 0:
            raise ValueError(f"keep_checkpoints must be >= 0 (0 keeps all), got {keep_checkpoints}")
        self.keep_checkpoints = keep_checkpoints
        self.exchange = exchange
        self.manifest = exchange.manifest
        self.name = name
        self.config = config or SyncConfig(**self.manifest.sync)
        self.fault = fault or (lambda stage, p, r: None)
        self.on_round = on_round
        self.stats = AggregatorStats()
        self.workers = list(self.manifest.workers)
        self.quorum = max(1, math.ceil(self.config.quorum * len(self.workers)))
        self.feedback = self.config.feedback(self.manifest.codec_down.name)
        self._first_seen: dict[tuple[int, int], float] = {}
        self._resume()

    # -- state ---------------------------------------------------------------------
    def _resume(self) -> None:
        """Load each fragment's newest canonical checkpoint (or the initial params)."""
        init = load_initial(self.exchange, len(self.manifest.fragments))
        self.outer: list[OuterState] = []
        self.residual: list[torch.Tensor | None] = []
        self.next_round: list[int] = []
        for p, params in enumerate(init):
            state = OuterState(params, self.config.eta, self.config.mu)
            residual = None
            latest = latest_global(self.exchange, p)
            if latest is None:
                self.next_round.append(0)
            else:
                arrays, _meta = read_checkpoint(self.exchange.store, latest[1])
                momentum = arrays.get("momentum")
                state.load(
                    torch.from_numpy(arrays["params"].copy()),
                    None if momentum is None else torch.from_numpy(momentum.copy()),
                )
                if "residual" in arrays:
                    residual = torch.from_numpy(arrays["residual"].copy())
                self.next_round.append(latest[0] + 1)
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
        base = poll_interval if poll_interval is not None else self.config.poll_interval_s
        delay = base
        while not self.done:
            if stop.is_set():
                break
            if self.poll_once():
                delay = base
                continue
            if timeout is not None and time.monotonic() - start > timeout:
                raise TimeoutError(
                    f"aggregator {self.name}: rounds still open after {timeout:.0f} s: "
                    f"next rounds {self.next_round} of {self.manifest.rounds}"
                )
            stop.wait(delay)
            delay = min(delay * 1.5, self.config.poll_max_s)
        return self.stats

    def poll_once(self) -> bool:
        """Try to complete the next round of every fragment; True if any progressed."""
        progressed = False
        for p in range(len(self.outer)):
            while self.next_round[p] < self.manifest.rounds[p] and self._try_round(p):
                progressed = True
        return progressed

    # -- one round -----------------------------------------------------------------
    def _ready(self, p: int, r: int) -> list[str] | None:
        """Workers to reduce now, or None to keep waiting."""
        committed = self.exchange.committed_workers(p, r)
        present = [w for w in committed if w in self.workers]
        if not present:
            return None
        first = self._first_seen.setdefault((p, r), time.monotonic())
        if len(present) == len(self.workers):
            return present
        if time.monotonic() - first >= self.config.deadline_s and len(present) >= self.quorum:
            log.warning(
                "aggregator %s: fragment %d round %d: deadline passed, reducing %d of %d "
                "workers (missing %s)", self.name, p, r, len(present), len(self.workers),
                sorted(set(self.workers) - set(present)),
            )
            return present
        return None

    def _reduce(
        self, p: int, r: int, workers: list[str], weights: dict[str, float] | None = None
    ) -> tuple[torch.Tensor, dict[str, float], dict[str, str]]:
        """Token-weighted float32 mean of the given contributions.

        With ``weights`` (replaying a committed mean) those exact weights are used.
        """
        values: dict[str, np.ndarray] = {}
        tokens: dict[str, int] = {}
        rejected: dict[str, str] = {}
        for w in workers:
            if weights is not None and w not in weights:
                continue
            try:
                value, commit = self.exchange.fetch_delta(p, r, w)
            except REJECTABLE as exc:
                if weights is not None:
                    raise  # a contribution the committed mean used must be readable
                rejected[w] = f"{type(exc).__name__}: {exc}"
                log.warning("aggregator %s: rejected %s", self.name, exc)
                self.exchange.record_rejection(p, r, w, rejected[w])
                continue
            values[w] = value
            tokens[w] = int(commit.get("tokens", 0))
        if weights is None:
            total = sum(tokens.values())
            weights = {
                w: (tokens[w] / total if total > 0 else 1.0 / len(values)) for w in sorted(values)
            }
        acc = torch.zeros(self.manifest.numel(p), dtype=torch.float32)
        for w in sorted(weights):
            # two roundings, pinned: (weight * value) in float32, then the sum
            acc += torch.from_numpy(values[w]) * np.float32(weights[w])
        return acc, weights, rejected

    def _try_round(self, p: int) -> bool:
        r = self.next_round[p]
        start = time.perf_counter()
        commit = self.exchange.mean_commit(p, r)
        adopted = commit is not None
        rejected: dict[str, str] = {}
        if commit is None:
            workers = self._ready(p, r)
            if workers is None:
                return False
            acc, weights, rejected = self._reduce(p, r, workers)
            self.stats.rejected += len(rejected)
            x = self._with_residual(p, acc)
            published = self.exchange.publish_mean(
                p, r, self.name, x.numpy(), weights=weights,
                extra={"rejected": rejected, "participants": sorted(weights)},
            )
            self.fault("published", p, r)
            if published.created:
                mean = torch.from_numpy(np.asarray(published.decoded))
            else:
                adopted, commit = True, published.commit
        if adopted:
            mean, x = self._replay(p, r, commit)
            weights = commit["weights"]
        if self.feedback:
            self.residual[p] = x - mean
        grad_norm = float(mean.norm())
        self.outer[p].step(mean)
        self.fault("stepped", p, r)
        self._checkpoint(p, r, weights)
        self.fault("checkpointed", p, r)
        self.next_round[p] = r + 1
        report = RoundReport(p, r, dict(weights), rejected, adopted,
                             time.perf_counter() - start, grad_norm)
        self.stats.rounds.append(report)
        if self.on_round is not None:
            self.on_round(report)
        log.info("aggregator %s: fragment %d round %d applied (%d workers%s)", self.name, p, r,
                 len(weights), ", adopted" if adopted else "")
        return True

    def _replay(self, p: int, r: int, commit: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed mean and what this aggregator's pre-quantisation value would
        have been, so its error-feedback residual continues exactly."""
        got = self.exchange.fetch_mean(p, r)
        if got is None:  # pragma: no cover - commit was read a moment ago
            raise ObjectMissing(f"mean of fragment {p} round {r} vanished")
        mean = torch.from_numpy(np.asarray(got[0]))
        if not self.feedback:
            return mean, mean
        acc, _, _ = self._reduce(p, r, sorted(commit["weights"]), weights=commit["weights"])
        return mean, self._with_residual(p, acc)

    def _with_residual(self, p: int, acc: torch.Tensor) -> torch.Tensor:
        """The value to publish: the mean plus the error-feedback residual (if on)."""
        if not self.feedback or self.residual[p] is None:
            return acc
        return acc + self.residual[p]

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
