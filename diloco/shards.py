"""One shard of a sharded aggregator (``aggregator.shards: K`` > 1).

Shard s owns a contiguous range of the zarr chunks of every fragment
(`storage.shards.span`), reads only those chunk objects of each contribution, and
keeps only its slice of the canonical state. Who counts is decided once, by shard
0, and every shard follows that decision (rather than each deciding alone: the gate
waits on clocks, quorum and grace windows, which K processes would see differently):

- shards 1..K-1 check their chunks of every committed contribution of the open
  rounds (sha256, finite) and commit their verdict with the chunks' float64 sum of
  squares (`storage.shards.write_check`);
- shard 0 counts a contribution as arrived only once all K-1 verdicts are in; it
  is rejected if any chunk is bad, and the norm guard sees the whole vector's norm
  (the square root of the summed sums of squares). Shard 0 then commits the
  decision (weights, rejected, late, owed, norms: what a K = 1 mean records);
- every shard reduces its slice with the decision's weights (`weighted_sum`,
  elementwise: the bits of the whole mean's slice), adds its error-feedback
  residual, commits its part of the mean, steps its slice of the outer state and
  checkpoints it; shard 0 commits ``mean.json`` and the round's whole checkpoint
  (naming the parts) once every part is in, so readers never see half a mean.

Everything is create-only and in the store: a shard killed at any point resumes
from its newest part checkpoint and replays the later rounds from their decisions
and committed parts, reaching the same bits.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from diloco.aggregator import Aggregator, RoundReport, restore_outer
from diloco.gate import Inbox
from diloco.outer import OuterState
from diloco.run import load_initial
from storage import layout
from storage.arrays import Coded
from storage.checkpoints import read_checkpoint, write_checkpoint
from storage.errors import (
    BAD_CONTRIBUTION,
    ImplausibleClaim,
    OutsizedContribution,
    TransientStoreError,
)
from storage.exchange import Exchange, contribution_of, weighted_sum
from storage.shards import (
    assemble_checkpoint,
    assemble_mean,
    decision,
    hold_delta_part,
    latest_part,
    publish_decision,
    publish_part,
    read_check,
    span,
    write_check,
)

log = logging.getLogger(__name__)


class ShardsBehind(TransientStoreError):
    """A contribution's other shards have not checked it yet (the poll retries)."""


class ShardAggregator(Aggregator):
    """Shard ``shard`` of the run's K-shard aggregator (K = ``exchange.shards``)."""

    def __init__(self, exchange: Exchange, *, shard: int, name: str = "aggregator",
                 **kwargs) -> None:
        if exchange.shards < 2:
            raise ValueError("aggregator.shards is 1: run diloco.aggregator.Aggregator")
        self.shard = shard
        self.spans = [span(exchange, p, shard) for p in range(len(exchange.manifest.fragments))]
        self.writer = f"{name}-s{shard}"
        layout.check_name("aggregator", self.writer)
        #: (p, k, worker) -> this shard's good slice of a contribution it checked, kept
        #: encoded (decoded a chunk at a time into the part of the mean)
        self._parts: dict[tuple[int, int, str], Coded] = {}
        self._seen: set[tuple[int, int, str]] = set()
        #: shard 0: (tokens, sum of squares, why bad) of its chunks of a contribution
        self._own: dict[tuple[int, int, str], tuple[int, float | None, str | None]] = {}
        #: shard 0: rounds whose mean.json or whole checkpoint is still to commit
        self._assembling: dict[tuple[int, int], dict] = {}
        super().__init__(exchange, name=name, **kwargs)

    # -- state ---------------------------------------------------------------------
    def _resume(self) -> None:
        init = load_initial(self.exchange, len(self.manifest.fragments))
        self.theta_norms = [float(v.norm()) for v in init]  # the norm guard's yardstick
        self.outer, self.residual, self.next_round = [], [], []
        for p, params in enumerate(init):
            sp = self.spans[p]
            state, residual = OuterState(params[sp.lo:sp.hi], self.config.outer.lr, self.config.outer.momentum), None
            latest = latest_part(self.exchange, p, self.shard)
            if latest is None:
                self.next_round.append(0)
            else:
                arrays, meta = read_checkpoint(self.exchange.store, latest[1])
                residual = restore_outer(state, arrays)
                self.next_round.append(latest[0] + 1)
                self.gate.restore(p, decision(self.exchange, p, latest[0]))
                if self.shard == 0:
                    for r in range(latest[0], -1, -1):
                        if self.exchange.store.exists(layout.global_commit(p, r)):
                            break
                        self._assembling[(p, r)] = {"fragment": p, "round": r,
                                                    "writer": self.name, "shards": self.exchange.shards}
                log.info("aggregator %s: fragment %d resumes at round %d",
                         self.writer, p, latest[0] + 1)
            self.outer.append(state)
            self.residual.append(residual)

    @property
    def done(self) -> bool:
        return super().done and not self._assembling

    # -- the loop ------------------------------------------------------------------
    def poll_once(self) -> bool:
        if self.shard == 0:
            checked = any([self._check_open(p, r) for p, r in enumerate(self.next_round)
                           if r < self.manifest.rounds[p]])
            progressed = super().poll_once() or checked
        else:  # follows shard 0: no roster, no gate of its own
            progressed = False
            for p in range(len(self.outer)):
                while self.next_round[p] < self.manifest.rounds[p] and self._try_round(p):
                    progressed = True
                if self.next_round[p] < self.manifest.rounds[p]:
                    progressed = self._check_open(p, self.next_round[p]) or progressed
        return self._assemble() or progressed

    def _assemble(self) -> bool:
        """Shard 0: commit the means and whole checkpoints whose parts are all in."""
        done = False
        for (p, r), meta in sorted(self._assembling.items()):
            if (assemble_mean(self.exchange, p, r, self.writer)
                    and assemble_checkpoint(self.exchange, p, r, meta)):
                del self._assembling[(p, r)]
                done = True
                old = r - self.keep_checkpoints
                if self.keep_checkpoints and old >= 0:
                    self.exchange.store.delete(layout.global_commit(p, old))
                    self.exchange.store.delete_prefix(layout.global_state(p, old) + "/")
        return done

    # -- checking contributions --------------------------------------------------------
    def _check_open(self, p: int, r: int) -> bool:
        """Read this shard's chunks of every committed contribution of the rounds shard
        0 may decide next (late ones of the last ``max_staleness`` too), all shards at
        once: shards 1..K-1 commit their verdict, shard 0 keeps its own for its
        decision. True if there was a new one (progress: the poll does not back off)."""
        checked = False
        first = max(0, r - self.config.membership.max_staleness)
        for k in range(first, min(r + 2, self.manifest.rounds[p])):
            for w in self.exchange.committed_workers(p, k):
                if (p, k, w) in self._seen:
                    continue
                tokens, reason, sumsq = 0, None, None
                try:
                    value, commit = hold_delta_part(self.exchange, p, k, w, self.spans[p])
                    tokens, sumsq = int(commit.get("tokens", 0)), value.sumsq()
                    self._parts[(p, k, w)] = value
                except BAD_CONTRIBUTION as exc:
                    reason = f"{type(exc).__name__}: {exc}"
                if self.shard == 0:
                    self._own[(p, k, w)] = (tokens, sumsq, reason)
                else:
                    write_check(self.exchange, p, k, w, self.shard, sumsq, reason)
                self._seen.add((p, k, w))
                checked = True
        return checked

    def _checks(self, p: int, k: int, w: str) -> list[dict] | None:
        checks = [read_check(self.exchange, p, k, w, s) for s in range(1, self.exchange.shards)]
        return None if any(c is None for c in checks) else checks

    def _collect(self, p: int, r: int, committed: list[str]) -> Inbox:
        """Shard 0: as `Aggregator._collect`, but a contribution arrives only once
        every other shard has checked its chunks."""
        return super()._collect(p, r, [w for w in committed if w in self.gate.inbox(p, r).arrived
                                       or self._checks(p, r, w) is not None])

    def _fetch(self, p: int, k: int, w: str, rejected: dict[str, str],
               key: str | None = None) -> tuple[Coded, int, float] | None:
        """Shard 0's verdict: its own chunks and the other shards' checks together."""
        checks = self._checks(p, k, w)
        deadline = time.monotonic() + self.config.liveness.poll_max_s
        while checks is None and time.monotonic() < deadline:  # a late one raced the list
            time.sleep(self.config.liveness.poll_interval_s)
            checks = self._checks(p, k, w)
        if checks is None:
            raise ShardsBehind(f"fragment {p} round {k}: worker {w}'s chunks are not all checked")
        if (p, k, w) not in self._own:  # read since (a restart, or committed just now)
            self._seen.discard((p, k, w))
            self._check_open(p, k)
        tokens, sumsq, reason = self._own.pop((p, k, w))
        value = self._parts.pop((p, k, w), None)
        norm = 0.0
        reason = reason or next((c["reason"] for c in checks if c.get("reason")), None)
        if reason is None:
            norm = math.sqrt(sumsq + sum(float(c["sumsq"]) for c in checks))
            try:
                self.trust.claim(p, k, w, tokens)
                self.trust.guard(p, k, w, norm)
            except (OutsizedContribution, ImplausibleClaim) as exc:
                reason = f"{type(exc).__name__}: {exc}"
        if reason is not None:
            rejected[key or w] = reason
            log.warning("aggregator %s: rejected %s", self.writer, reason)
            self.exchange.record_rejection(p, k, w, reason)
            return None
        return value, tokens, norm

    def _current_norm(self, p: int) -> float:
        """Shard 0 holds only its slice of the canonical parameters: the fragment's norm
        is estimated from it, scaled to the whole (the guard's factor has margin)."""
        sp = self.spans[p]
        whole = self.manifest.numel(p)
        return float(self.outer[p].params.norm()) * math.sqrt(whole / max(1, sp.hi - sp.lo))

    def _norms_of(self, p: int, k: int) -> list[float]:
        if (p, k) not in self._norms:
            commit = decision(self.exchange, p, k) or {}
            self._norms[(p, k)] = [float(v) for v in (commit.get("norms") or {}).values()]
        return self._norms[(p, k)]

    def _mean(self, p: int, values: dict[str, Coded],
              weights: dict[str, float]) -> torch.Tensor:
        sp = self.spans[p]
        return torch.from_numpy(weighted_sum(sp.hi - sp.lo, values, weights))

    # -- one round -----------------------------------------------------------------
    def _decide(self, p: int, r: int) -> tuple[dict | None, Inbox | None]:
        """Shard 0: the gate's decision of (p, r) committed, or (None, None) while it
        waits; the inbox is None when an earlier attempt's decision is adopted."""
        committed = self.exchange.committed_workers(p, r)
        if not committed:
            return None, None
        inbox = self._collect(p, r, committed)
        if not self.gate.ready(p, r, inbox):
            return None, None
        owed_before = set(self.gate.owed[p])
        late, dropped, absent = self.gate.settle(p, r, inbox, self._fetch)
        self.trust.peers(p, r, inbox)
        weights = self._weights(inbox.tokens, r)
        self.stats.rejected += len(inbox.rejected)
        body = {"weights": {k: float(v) for k, v in sorted(weights.items())},
                "rejected": dict(inbox.rejected),
                "participants": sorted(w for w in weights if "@" not in w),
                "expected": sorted(inbox.expected),
                "late": late, "dropped": dropped, "absent": absent,
                "owed": sorted([w, k] for w, k in self.gate.owed[p]),
                "grace_s": round(self.gate.grace.seconds(), 3),
                "norms": {w: inbox.norms[w] for w in sorted(weights)}}
        dec, created = publish_decision(self.exchange, p, r, self.writer, body)
        if not created:
            self.gate.owed[p] = owed_before
            return dec, None
        return dec, inbox

    def _slices(self, p: int, r: int, weights: dict[str, float],
                inbox: Inbox | None) -> dict[str, Coded]:
        """This shard's slice of every contribution the decision counts."""
        out = {}
        for key in sorted(weights):
            w, k = contribution_of(key, r)
            if inbox is not None and key in inbox.values:
                out[key] = inbox.values[key]
            elif (p, k, w) in self._parts:
                out[key] = self._parts[(p, k, w)]
            else:  # counted, so every shard found it good: a failure here is a fault
                out[key] = hold_delta_part(self.exchange, p, k, w, self.spans[p])[0]
        return out

    def _try_round(self, p: int) -> bool:
        r = self.next_round[p]
        start = time.perf_counter()
        dec, inbox = decision(self.exchange, p, r), None
        if dec is None:
            if self.shard != 0:
                return False
            dec, inbox = self._decide(p, r)
            if dec is None:
                return False
        weights = dec["weights"]
        x = acc = self._mean(p, self._slices(p, r, weights, inbox), weights)
        if weights:
            x = self._with_residual(p, acc)
        decoded, _created = publish_part(self.exchange, p, r, self.spans[p], self.writer,
                                         x.numpy())
        self.fault("published", p, r)
        mean = torch.from_numpy(np.asarray(decoded))
        if inbox is None:
            self.gate.restore(p, dec)
        before = self.outer[p].state_dict(), self.residual[p]
        try:
            if weights:
                if self.feedback:
                    self.residual[p] = x - mean
                self.outer[p].step(mean)
            self.trust.halt_check(p, r, weights, dict(dec.get("rejected", {})),
                                  self.outer[p].params)
            self.fault("stepped", p, r)
            self._checkpoint(p, r, weights)
            self.fault("checkpointed", p, r)
        except BaseException:
            self.outer[p].load(before[0]["params"], before[0]["momentum"])
            self.residual[p] = before[1]
            raise
        self.next_round[p] = r + 1
        self.gate.reduced(p, r, inbox)
        self._norms[(p, r)] = [float(v) for v in dec.get("norms", {}).values()]
        for key in [k for k in self._parts if k[0] == p and k[1] < r - self.config.membership.max_staleness]:
            del self._parts[key]
        if self.shard == 0:
            self._assembling[(p, r)] = {"fragment": p, "round": r, "weights": weights,
                                        "writer": self.name, "shards": self.exchange.shards}
        report = RoundReport(p, r, dict(weights), dict(dec.get("rejected", {})), inbox is None,
                             time.perf_counter() - start, float(mean.norm()),
                             late=len(dec.get("late", [])), dropped=len(dec.get("dropped", [])),
                             expected=len(dec.get("expected", [])),
                             absent=len(dec.get("absent", [])))
        self.stats.late += report.late
        self.stats.dropped += report.dropped
        self.stats.rounds.append(report)
        if self.on_round is not None:
            self.on_round(report)
        return True

    def _checkpoint(self, p: int, r: int, weights: dict[str, float]) -> None:
        """This shard's slice of the canonical state (shard 0 later commits the whole
        checkpoint naming the K slices)."""
        arrays = {"params": self.outer[p].params.numpy()}
        momentum = self.outer[p].momentum_buffer
        if momentum is not None:
            arrays["momentum"] = momentum.numpy()
        if self.residual[p] is not None:
            arrays["residual"] = self.residual[p].numpy()
        prefix = layout.global_part(p, r, self.shard)
        write_checkpoint(self.exchange.store, prefix, f"{prefix}.json", arrays,
                         {"fragment": p, "round": r, "shard": self.shard, "writer": self.writer})

