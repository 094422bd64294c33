"""The aggregator's checks on what a contribution claims and holds, so that no single
worker can ruin a run (docs/algorithms.md, "Which contributions a round uses").

- the token claim: at most what the member could have trained since its previous
  contribution to the fragment (`claim`, `ImplausibleClaim`);
- the norm guard (`guard`, `peers`, `OutsizedContribution`): from round 0 against the
  norm of the fragment's parameters (the larger of the initial and the current
  canonical ones) and against the other contributions of the same mean (three or
  more), after a warm-up against the fragment's recent accepted norms;
- the halt (`halt_check`, `RunHalted`): a canonical model that is no longer finite,
  or a fragment whose every contribution has been rejected for several rounds, stops
  the aggregator instead of letting a run that no longer trains look finished.

Every rejection is recorded in the store by the caller's ``record``, like any other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from diloco.config import SyncConfig
from diloco.gate import Inbox
from diloco.membership import Roster
from storage.errors import ImplausibleClaim, OutsizedContribution
from storage.exchange import contribution_of

log = logging.getLogger(__name__)

#: contributions a mean needs before they are compared with each other
PEER_GUARD_MIN = 3
#: rounds in a row of one fragment whose every contribution was rejected before the
#: aggregator stops: its model is no longer being trained, and that must be said
HALT_AFTER_REJECTED = 3


class RunHalted(RuntimeError):
    """The aggregator stops stepping: the canonical model is no longer finite, or every
    contribution of a fragment has been rejected for several rounds in a row."""


class Trust:
    """The checks of one aggregator (or shard 0 of a sharded one)."""

    def __init__(self, config: SyncConfig, roster: Roster, *,
                 send_step: Callable[[int, int], int], theta_norm: Callable[[int], float],
                 fragments: int, norms_of: Callable[[int, int], list[float]],
                 record: Callable[[int, int, str, str], None], name: str):
        """``send_step(p, r)``: the step round ``r`` of ``p`` is sent at;
        ``theta_norm(p)``: the norm of fragment ``p``'s parameters to compare with (the
        larger of its initial and its current canonical ones: an outer gradient is a
        fraction of the parameters it moves, and they grow in training);
        ``norms_of(p, k)``: the accepted norms of a reduced round (from its commit, so
        a restarted aggregator decides the same); ``record(p, k, worker, reason)``:
        records a rejection in the store."""
        self.config, self.roster, self.name = config, roster, name
        self.send_step, self.theta_norm = send_step, theta_norm
        self.norms_of, self.record = norms_of, record
        #: (fragment, worker) -> the send step of its newest accepted claim
        self.sent_at: dict[tuple[int, str], int] = {}
        self.all_rejected = [0] * fragments

    def claim(self, p: int, k: int, w: str, tokens: int) -> None:
        """A contribution's tokens are its weight in the mean: more than its member
        could have trained since its previous contribution to the fragment (its
        admitted batch x sequence x accumulation x the steps between the two sends;
        from step 0 when no earlier one is known) is rejected."""
        per_step = self.roster.tokens_per_step(w)
        step = self.send_step(p, k)
        before = self.sent_at.get((p, w), 0)
        before = before if before < step else 0  # a late one read after a newer one
        if per_step is not None and tokens > per_step * (step - before):
            raise ImplausibleClaim(
                f"delta of worker {w} for fragment {p} round {k}: it claims {tokens} tokens, "
                f"more than the {per_step * (step - before)} it could have trained in steps "
                f"{before + 1}..{step} ({per_step} a step)")
        self.sent_at[(p, w)] = max(step, self.sent_at.get((p, w), 0))

    def guard(self, p: int, r: int, worker: str, norm: float) -> None:
        """The norm guard on one contribution: from round 0 above ``norm_guard_params``
        times the norm of the fragment's parameters (an honest outer gradient is a
        small fraction of it); after ``norm_guard_warmup`` rounds also above
        ``norm_guard`` times the median of the accepted norms of the last
        ``norm_guard_window`` rounds. ``norm_guard`` 0 turns every rule off."""
        cfg = self.config
        if not cfg.guard.ratio:
            return
        what = f"delta of worker {worker} for fragment {p} round {r}: norm {norm:.4g}"
        theta = self.theta_norm(p) if cfg.guard.params_ratio else 0.0
        if cfg.guard.params_ratio and not norm <= cfg.guard.params_ratio * theta:
            raise OutsizedContribution(
                f"{what} is above the norm guard {cfg.guard.params_ratio * theta:.4g} "
                f"({cfg.guard.params_ratio:g} x the norm of the fragment's parameters, "
                f"{theta:.4g})")
        if r < cfg.guard.warmup:
            return
        history = [n for k in range(max(0, r - cfg.guard.window), r)
                   for n in self.norms_of(p, k)]
        if not history:
            return
        limit = cfg.guard.ratio * float(np.median(history))
        if not norm <= limit:
            raise OutsizedContribution(
                f"{what} is above the norm guard {limit:.4g} ({cfg.guard.ratio:g} x the "
                f"median of the accepted norms of the last {cfg.guard.window} rounds)"
            )

    def peers(self, p: int, r: int, inbox: Inbox) -> None:
        """With three or more contributions in one mean, reject (from ``inbox``) any
        whose norm is above ``norm_guard`` times their median: from round 0 a single
        outsized one among honest peers is caught, before any history exists."""
        cfg = self.config
        if not cfg.guard.ratio or len(inbox.values) < PEER_GUARD_MIN:
            return
        limit = cfg.guard.ratio * float(np.median(list(inbox.norms.values())))
        for key in sorted(inbox.values):
            norm = inbox.norms[key]
            if norm <= limit:
                continue
            w, k = contribution_of(key, r)
            reason = (f"OutsizedContribution: delta of worker {w} for fragment {p} round {k}: "
                      f"norm {norm:.4g} is above the norm guard {limit:.4g} "
                      f"({cfg.guard.ratio:g} x the median of the {len(inbox.values)} "
                      f"contributions of this mean)")
            del inbox.values[key], inbox.tokens[key], inbox.norms[key]
            inbox.rejected[key] = reason
            log.warning("aggregator %s: rejected %s", self.name, reason)
            self.record(p, k, w, reason)

    def halt_check(self, p: int, r: int, weights: dict[str, float],
                   rejected: dict[str, str], params: torch.Tensor) -> None:
        """`RunHalted` (the caller has not checkpointed the round yet) when ``params``
        are no longer finite after the step, or when every contribution of the
        fragment's last ``HALT_AFTER_REJECTED`` rounds was rejected."""
        if weights and not bool(torch.isfinite(params).all()):
            raise RunHalted(f"aggregator {self.name}: fragment {p} round {r}: the canonical "
                            "parameters are no longer finite after the outer step; nothing "
                            "was checkpointed, stopping")
        self.all_rejected[p] = 0 if weights else self.all_rejected[p] + bool(rejected)
        if self.all_rejected[p] >= HALT_AFTER_REJECTED:
            raise RunHalted(
                f"aggregator {self.name}: fragment {p}: every contribution of its last "
                f"{HALT_AFTER_REJECTED} rounds was rejected (round {r}: "
                f"{'; '.join(sorted(rejected.values()))[:400]}); the canonical model is not "
                "being trained, stopping")
