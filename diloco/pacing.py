"""When the aggregator polls: fast while a round's contributions are due, slowly otherwise.

Every poll costs requests (a HEAD for the mean and a LIST of the round's commits, per
fragment), so an idle aggregator backs off to ``poll_max_s`` between polls. But the
time from a worker's send to the aggregator seeing it is part of the exchange latency
that ``overlap: auto`` sizes tau to, and every step of tau makes a merge staler: with a
0.5 s backoff a round waited 0.25 s on average for nothing, two inner steps of a small
model. Contributions come in a rhythm (a fragment's rounds are H inner steps apart), so
the aggregator learns it and is awake when one is due:

- it notes when it first saw a contribution of each round of each fragment;
- a fragment's next round is due one *interval* after its previous one (the median
  of its recent intervals, per round);
- from a short while before that moment (a tenth of the interval, at least one
  poll) until one interval after it, the aggregator polls every ``poll_interval_s``;
  once a round has a contribution and waits for the rest (which the workers sent at
  the same step), likewise, for at most one interval;
- otherwise it backs off as before, but never sleeps past the start of the next
  fast window.

Until a fragment has two rounds on record there is no rhythm and nothing changes. A
late or absent worker costs at most one interval of fast polling per round. Pure
timing: which rounds are applied and what they contain does not depend on it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

#: intervals between a fragment's rounds whose median predicts the next one
INTERVAL_WINDOW = 8
#: the fast window opens this share of an interval before a round is due
LEAD = 0.1


class Pacer:
    """The aggregator's poll delays, from when each fragment's rounds were first seen."""

    def __init__(self, fragments: int):
        self.seen: list[dict[int, float]] = [{} for _ in range(fragments)]
        self.intervals: list[deque[float]] = [deque(maxlen=INTERVAL_WINDOW)
                                              for _ in range(fragments)]

    def arrived(self, p: int, r: int, now: float) -> None:
        """A contribution of round ``r`` of fragment ``p`` was seen at ``now`` (only the
        first of a round counts)."""
        rounds = self.seen[p]
        if r in rounds:
            return
        if (r - 1) in rounds and now > rounds[r - 1]:
            self.intervals[p].append(now - rounds[r - 1])
        rounds[r] = now
        for old in [k for k in rounds if k < r - 1]:
            del rounds[old]

    def interval(self, p: int) -> float | None:
        """The median recent time between two rounds of fragment ``p``."""
        got = sorted(self.intervals[p])
        return got[len(got) // 2] if got else None

    def delay(self, now: float, waiting: Iterable[tuple[int, int]], backoff: float,
              fastest: float) -> float:
        """The pause before the next poll: ``fastest`` inside a fast window of any
        round in ``waiting`` ((fragment, round) pairs not applied yet), else
        ``backoff`` but not past the next window's start."""
        pause = backoff
        for p, r in waiting:
            every = self.interval(p)
            if every is None:
                continue
            rounds = self.seen[p]
            if r in rounds:  # partly arrived: the rest were sent at the same step
                if now - rounds[r] <= every:
                    return fastest
                continue
            if (r - 1) not in rounds:
                continue
            due = rounds[r - 1] + every
            opens = due - max(fastest, LEAD * every)
            if opens <= now <= due + every:
                return fastest
            if now < opens:
                pause = min(pause, opens - now)
        return max(fastest, pause)
