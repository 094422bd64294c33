"""The streaming schedule, exactly as docs/algorithms.md section 5 pins it.

Inner steps count from 1. Let ``s = H / P``. The k-th merge point (``t = k * s``,
k = 1, 2, ...) belongs to fragment ``(k - 1) % P`` and is that fragment's round
``(k - 1) // P``; its outer gradient is sent ``tau`` steps earlier, at
``t = k * s - tau``. So each fragment syncs every H steps, fragments are staggered by
``s``, and at most one fragment is in flight per worker.

With ``overlap: auto`` tau differs per merge point: ``events`` takes a lookup
``tau_of(k)`` of the tau decided for merge point ``k`` (`diloco.overlap`), so the
schedule stays a pure function of its inputs; ``overlap`` is then the reference tau
that fixes the round counts (the decisions keep it for merge points past the run's
end, so every party counts the same rounds).

A run of ``T`` inner steps also has a final round per fragment when the live
weights can differ from the outer ones at the end (steps after the last merge, or a
merge that kept part of the local side): ``rounds_in_run`` counts them, so the
aggregator and every worker agree on how many rounds each fragment has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from diloco.config import ScheduleConfig


@dataclass(frozen=True)
class Event:
    """Something the synchroniser does after inner step ``step``."""

    kind: Literal["send", "merge"]
    fragment: int
    round: int
    step: int


@dataclass(frozen=True)
class Schedule:
    """Send and merge steps of every fragment round (H, P, tau as in the papers)."""

    sync_every: int
    fragments: int
    overlap: int = 0

    def __post_init__(self) -> None:
        h, p, tau = self.sync_every, self.fragments, self.overlap
        if p < 1 or h < 1 or p > h or h % p or not 0 <= tau < h // p:
            raise ValueError(
                f"invalid schedule: need 1 <= P <= H, H % P == 0, 0 <= tau < H/P; "
                f"got H = {h}, P = {p}, tau = {tau}"
            )

    @classmethod
    def of(cls, config: ScheduleConfig) -> Schedule:
        """The schedule a run's ``sync.schedule`` section sets (tau: its send offset,
        which is 0 for pure eager and overlap_start for overlap auto)."""
        return cls(config.sync_every, config.fragments, config.send_offset)

    @property
    def stride(self) -> int:
        """s = H / P: steps between two consecutive merge points."""
        return self.sync_every // self.fragments

    def merge_step(self, fragment: int, round: int) -> int:
        """Inner step after which fragment ``fragment`` merges round ``round``."""
        k = round * self.fragments + fragment + 1
        return k * self.stride

    def send_step(self, fragment: int, round: int) -> int:
        """Inner step after which fragment ``fragment`` sends round ``round``."""
        return self.merge_step(fragment, round) - self.overlap

    def point(self, k: int) -> tuple[int, int]:
        """(fragment, round) of merge point ``k`` (k = 1, 2, ...)."""
        return (k - 1) % self.fragments, (k - 1) // self.fragments

    def events(self, step: int, tau_of: Callable[[int], int] | None = None) -> list[Event]:
        """The sends and merges due after inner step ``step`` (sends first).

        ``tau_of(k)``: the tau of merge point ``k`` when it varies (``overlap: auto``;
        each must be in ``0 .. H/P - 1``); by default every point's is ``overlap``."""
        out: list[Event] = []
        s = self.stride
        if tau_of is None:
            send_k, rem = divmod(step + self.overlap, s)
            if rem == 0 and send_k >= 1:
                out.append(Event("send", *self.point(send_k), step))
        else:  # tau < s: the point whose send may fall here is the next one (or this)
            k = -(-step // s)
            if k >= 1 and k * s - tau_of(k) == step:
                out.append(Event("send", *self.point(k), step))
        merge_k, rem = divmod(step, s)
        if rem == 0 and merge_k >= 1:
            out.append(Event("merge", *self.point(merge_k), step))
        return out

    def rounds_sent_by(self, fragment: int, total_steps: int) -> int:
        """How many scheduled rounds of ``fragment`` are sent within ``total_steps``."""
        first = self.send_step(fragment, 0)
        if total_steps < first:
            return 0
        return (total_steps - first) // self.sync_every + 1

    def has_final_round(self, fragment: int, total_steps: int, merge_alpha: float) -> bool:
        """Whether the live weights of ``fragment`` may differ from its outer weights
        after the run's last scheduled merge, so that a final round must carry it."""
        n = self.rounds_sent_by(fragment, total_steps)
        if n == 0:
            return total_steps > 0
        last_merge = self.merge_step(fragment, n - 1)
        return total_steps > last_merge or merge_alpha > 0.0

    def rounds_in_run(self, total_steps: int, merge_alpha: float) -> list[int]:
        """Rounds per fragment in a run of ``total_steps`` inner steps, final included."""
        return [
            self.rounds_sent_by(p, total_steps)
            + int(self.has_final_round(p, total_steps, merge_alpha))
            for p in range(self.fragments)
        ]
