"""How long the aggregator waits for the rest once a quorum is in: the grace window.

A fixed timeout is always wrong somewhere: too short and healthy workers with a
little jitter miss their round; too long and one slow GPU sets the pace of the whole
run. The window adapts instead, from two things the aggregator observes on its own
clock in recent rounds:

- the *spread*: in a round where every expected member arrived, the time from the
  quorum's arrival to the last one. Three times its 90th percentile covers the
  jitter of healthy members. Rounds reduced without someone are not samples (a dead
  or consistently slow member must not widen the window for everyone);
- the *pace*: how long the quorum computes a round. Merge points come every H/P
  steps, one fragment after the other, so the time from the previous mean (of any
  fragment; for the first round, from the aggregator's start) to this round's
  quorum, times P, estimates it. The window is at most ``GRACE_SHARE`` of it, so
  waiting for a straggler costs the others at most that share of their
  throughput. (The first round's estimate includes the jobs' start-up, so its
  window is wider: start-up differences are absorbed.)

The result is kept within ``grace_min_s .. grace_max_s``. An explicit ``grace_s``
in the config turns adaptation off.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from diloco.config import SyncConfig

#: how many recent samples of each kind are kept
WINDOW = 16
#: the share of the quorum's round time the window may take
GRACE_SHARE = 0.05
#: the margin over the observed spread
SPREAD_MARGIN = 3.0


class Grace:
    """The adaptive grace window (see the module)."""

    def __init__(self, config: SyncConfig):
        self.config = config
        self.spreads: deque[float] = deque(maxlen=WINDOW)
        self.paces: deque[float] = deque(maxlen=WINDOW)

    def seconds(self, quorum_at: float | None = None, previous_mean_at: float | None = None
                ) -> float:
        """The window now; with the open round's quorum time and the newest earlier
        mean, that round's own pace counts too (so even the first round has one)."""
        cfg = self.config
        if cfg.membership.grace_s != "adaptive":
            return float(cfg.membership.grace_s)
        bound = cfg.membership.grace_max_s
        paces = list(self.paces)
        if quorum_at is not None and previous_mean_at is not None and quorum_at > previous_mean_at:
            paces.append((quorum_at - previous_mean_at) * self.config.schedule.fragments)
        if paces:
            bound = min(bound, GRACE_SHARE * float(np.median(paces)))
        if not self.spreads:
            return max(cfg.membership.grace_min_s, bound)
        spread = SPREAD_MARGIN * float(np.percentile(self.spreads, 90))
        return max(cfg.membership.grace_min_s, min(spread, bound))

    def observe(self, *, quorum_at: float, last_arrival: float, complete: bool,
                previous_mean_at: float) -> None:
        """Record one reduced round (times on the aggregator's monotonic clock;
        ``previous_mean_at``: the newest earlier mean of any fragment)."""
        if complete:
            self.spreads.append(max(0.0, last_arrival - quorum_at))
        if quorum_at > previous_mean_at:
            self.paces.append((quorum_at - previous_mean_at) * self.config.schedule.fragments)
