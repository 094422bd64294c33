"""When the aggregator reduces a round, and what it owes to the members that missed one.

The aggregator (`diloco.aggregator`) asks the gate, for each open (fragment, round),
whether to reduce now. Who is expected comes from the roster (`diloco.membership`).
Every expected member in: now. A missing member that is *coming* (training, not a
straggler, and progressing, or held by a mean the run has not reduced yet) is waited
for, up to ``deadline_s``: so a run where nothing failed is reduced with everyone,
round after round, however busy the machines are, and gives the same model as
``quorum: 1.0``. Once only members that are not coming are missing (a lapsed lease,
no progress, a straggler) and a quorum is in, the grace window (`diloco.grace`)
applies: it is for members that are not coming, not for jitter. A member whose contribution is not in the reduced round is
*owed*: if its contribution is committed within ``max_staleness`` rounds it joins the
next mean of that fragment (weighted by its tokens, under the key ``worker@round``),
exactly once; past that bound it is dropped (``stale``) or, never committed, recorded
``absent``. What is still owed is written into every mean's commit, so a restarted
aggregator continues the same bookkeeping and an audit can account for every
contribution.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from diloco.config import SyncConfig
from diloco.grace import Grace
from diloco.membership import Roster
from diloco.schedule import Schedule
from storage.arrays import Coded
from storage.exchange import Exchange

log = logging.getLogger(__name__)

#: (fragment, round, worker, rejected, key) -> (value, tokens, norm), or None if bad; the
#: value is a verified contribution kept encoded (`storage.arrays.Coded`)
Fetch = Callable[[int, int, str, dict[str, str], str], "tuple[Coded, int, float] | None"]


@dataclass
class Inbox:
    """The contributions of one (fragment, round) read so far, each verified once:
    the usable ones (kept encoded until the mean sums them) with their tokens and
    norm, and the rejected ones with why."""

    values: dict[str, Coded] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    norms: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    expected: set[str] = field(default_factory=set)
    first: float = 0.0  # the aggregator's clock at the first arrival
    quorum_at: float | None = None  # ... when the quorum was in
    last: float = 0.0  # ... at the newest arrival
    waiting: list[str] = field(default_factory=list)  # missing members it waits for
    grace_from: float | None = None  # ... since when none of them is coming
    withheld: set[str] = field(default_factory=set)  # kept out by a benchmark's hook

    @property
    def arrived(self) -> set[str]:
        return {k for k in set(self.values) | set(self.rejected) if "@" not in k}


def late_key(worker: str, round: int) -> str:
    """The weight key of a contribution applied late (in a later round's mean)."""
    return f"{worker}@{round}"


class Gate:
    """The aggregator's waiting policy and late-contribution bookkeeping."""

    def __init__(self, exchange: Exchange, config: SyncConfig, roster: Roster, name: str,
                 reduced: Callable[[int, int], bool] = lambda p, r: False):
        """``reduced(p, r)``: whether the run has reduced round ``r`` of fragment ``p``
        (a member blocked on its mean is held by the run, not stuck)."""
        self.exchange, self.config, self.roster, self.name = exchange, config, roster, name
        self.is_reduced = reduced
        self.manifest = exchange.manifest
        self.grace = Grace(config)
        self.schedule = Schedule.of(config.schedule)
        self.inboxes: dict[tuple[int, int], Inbox] = {}
        #: per fragment: (worker, round) contributions that missed their round and may
        #: still be applied late (from the newest commit, so a restart keeps them)
        self.owed: list[set[tuple[str, int]]] = [set() for _ in self.manifest.fragments]
        #: members a round was reduced without, with the step they were known at then:
        #: later rounds wait for them only ``absent_deadline_s``, until they progress
        #: again or one of theirs arrives in time
        self.absent: dict[str, int | None] = {}
        self._mean_at = roster.clock()  # the newest mean of any fragment (or the start)

    def inbox(self, p: int, r: int) -> Inbox:
        return self.inboxes.setdefault((p, r), Inbox())

    def restore(self, p: int, commit: dict | None) -> None:
        """Take what is owed for fragment ``p`` from its newest mean's commit."""
        self.owed[p] = {(str(w), int(k)) for w, k in (commit or {}).get("owed", [])}

    def _back(self, names: set[str]) -> None:
        for w in names:
            self.absent.pop(w, None)

    def _still_absent(self, name: str) -> bool:
        """A member a round went on without counts as coming again only once it has
        progressed past the step it was known at then."""
        if name not in self.absent:
            return False
        m = self.roster.members.get(name)
        step, then = (m.step if m is not None else None), self.absent[name]
        return step is None or (then is not None and step <= then)

    def held(self, name: str, step: int) -> bool:
        """Whether member ``name``, known to have reached ``step``, is held by the run:
        it has contributed to the round of its next merge point (so it waits there,
        or soon will) and the run has not reduced that round. Merge points are every
        H/P steps whatever tau; the k-th belongs to fragment (k - 1) mod P, round
        (k - 1) div P."""
        stride, fragments = self.schedule.stride, len(self.manifest.fragments)
        k = step // stride + 1  # the first merge point after ``step``
        p, r = (k - 1) % fragments, (k - 1) // fragments
        if r >= self.manifest.rounds[p] or self.is_reduced(p, r):
            return False
        inbox = self.inboxes.get((p, r))
        return inbox is not None and name in inbox.arrived

    def send_step(self, p: int, r: int) -> int:
        return min(self.schedule.send_step(p, r), self.manifest.total_steps)

    def expected(self, p: int, r: int) -> set[str]:
        return self.roster.expected(p, r, self.send_step(p, r))

    def ready(self, p: int, r: int, inbox: Inbox) -> bool:
        """Whether round ``r`` of ``p`` is to be reduced now (``inbox`` holds what
        has arrived).

        Every expected member in (usable or rejected): now. Otherwise once at least
        the quorum is in (``min_quorum``, and ``quorum`` of the expected members)
        and the grace window has passed since it was (``absent_deadline_s`` at most
        when only members that missed an earlier round are missing), or
        ``deadline_s`` since the first arrival."""
        if not inbox.arrived:
            return False
        now = self.roster.clock()
        if not inbox.first:
            inbox.first = now
        inbox.expected = self.expected(p, r)
        missing = inbox.expected - inbox.arrived
        cfg = self.config
        need = max(cfg.membership.min_quorum, math.ceil(cfg.membership.quorum * len(inbox.expected)))
        if len(inbox.arrived) >= need and inbox.quorum_at is None:
            inbox.quorum_at = now
        if not missing:
            self._back(inbox.arrived)
            return True
        if inbox.quorum_at is None:
            return False
        coming = sorted(w for w in missing if self.roster.coming(w, self.held)
                        and not self._still_absent(w) and w not in inbox.withheld)
        if coming and now - inbox.first < cfg.membership.deadline_s:
            inbox.waiting, inbox.grace_from = coming, None
            return False
        if inbox.grace_from is None:  # the window counts from when no one is coming
            inbox.grace_from = now
        grace = self.grace.seconds(inbox.quorum_at, self._mean_at)
        if missing <= set(self.absent):
            grace = min(grace, cfg.membership.absent_deadline_s)
        if now - inbox.grace_from < grace and now - inbox.first < cfg.membership.deadline_s:
            return False
        # before going on without someone: the newest membership (a leave, a lapse)
        self.roster.refresh(force=True)
        inbox.expected = self.expected(p, r)
        missing = inbox.expected - inbox.arrived
        if not missing:
            return True
        log.warning(
            "aggregator %s: fragment %d round %d: reducing %d of %d expected members after "
            "%.1f s of grace (missing %s)", self.name, p, r,
            len(inbox.arrived & inbox.expected), len(inbox.expected), now - inbox.grace_from,
            sorted(missing),
        )
        self._back(inbox.arrived)
        for w in missing:
            self.absent.setdefault(w, self.roster.members[w].step)
        return True

    def settle(self, p: int, r: int, inbox: Inbox, fetch: Fetch
               ) -> tuple[list[dict], list[dict], list[dict]]:
        """Settle the contributions of fragment ``p`` that missed their round: each
        committed one within ``max_staleness`` rounds joins this mean (its value in
        ``inbox`` under `late_key`), a later one is dropped; one not committed by
        then is recorded absent. Returns (late, dropped, absent) for the commit and
        leaves the entries still owed, this round's misses included, in
        ``self.owed[p]``."""
        late, dropped, absent = [], [], []
        keep: set[tuple[str, int]] = set()
        bound = self.config.membership.max_staleness
        by_round: dict[int, list[str]] = {}
        for w, k in self.owed[p]:
            if self.roster.takes_part(w, p, k):  # not one a member left before sending
                by_round.setdefault(k, []).append(w)
        for k in sorted(by_round):
            names = set(self.exchange.committed_workers(p, k))
            for w in sorted(by_round[k]):
                if w in names and r - k <= bound and self.config.membership.late == "drop":
                    dropped.append({"worker": w, "round": k, "reason": "late"})
                elif w in names and r - k <= bound:
                    key = late_key(w, k)
                    got = fetch(p, k, w, inbox.rejected, key)
                    if got is not None:
                        inbox.values[key], inbox.tokens[key], inbox.norms[key] = got
                        late.append({"worker": w, "round": k, "tokens": got[1]})
                elif w in names:
                    dropped.append({"worker": w, "round": k, "reason": "stale"})
                elif r - k >= bound:
                    absent.append({"worker": w, "round": k})
                else:
                    keep.add((w, k))
        send_step = self.send_step(p, r)
        for name, m in self.roster.members.items():
            if (name not in inbox.arrived and self.roster.takes_part(name, p, r)
                    and m.state != "finished" and m.from_step <= send_step):
                # a joiner still catching up is owed too: the round it sends first may
                # be one reduced while its status still said "joining"
                keep.add((name, r))
        self.owed[p] = keep
        return late, dropped, absent

    def reduced(self, p: int, r: int, inbox: Inbox | None) -> None:
        """Round ``r`` of ``p`` is done: feed the grace window (when this aggregator
        reduced it) and forget its inbox."""
        now = self.roster.clock()
        if inbox is not None and inbox.quorum_at is not None:
            self.grace.observe(quorum_at=inbox.quorum_at, last_arrival=inbox.last,
                               complete=inbox.expected <= inbox.arrived,
                               previous_mean_at=self._mean_at)
        self._mean_at = now
        self.inboxes.pop((p, r), None)
