"""Where a worker is in its run, and what it tells the run about it.

`Position` is the one mutable record of a worker's progress (its inner step, tokens,
the step its data and learning rate count from). The loop advances it step by step;
elastic membership (`workers.elastic.catch_up`) moves it to the run's canonical
state; checkpoints save and restore it. `Reporter` composes the worker's status (its
lease on the status board, what ``diloco status`` shows) and counts its exchange
bytes over every life of the worker.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from storage.billing import Meter
from storage.objectstore import ObjectStore
from workers import report
from workers.status import StatusBoard

if TYPE_CHECKING:
    from diloco.synchronizer import Synchronizer
    from workers.config import RunConfig
    from workers.data.streams import WorkerStream

#: steps whose seconds give a worker's usual step (its status's ``step_s``)
PACE_STEPS = 32


@dataclass
class Position:
    """A worker's progress: ``step`` inner steps done, ``tokens`` trained on,
    ``from_step`` the step it started from or last took the canonical state at (the
    aggregator counts its rounds from there), ``warm_from`` the step its learning rate
    warms up again from (None: from 0). ``stream`` is its data, read
    ``batches_per_step`` batches an inner step."""

    stream: WorkerStream
    batches_per_step: int
    step: int = 0
    tokens: int = 0
    from_step: int = 0
    warm_from: int | None = None

    def seek(self, step: int, *, fresh: bool) -> None:
        """Stand at inner step ``step`` taken from elsewhere (the canonical state):
        the data reads on from that step's batch, so no slot position is read twice,
        and ``from_step`` says where this worker's rounds start. ``fresh``: its inner
        optimizer is new, so its learning rate warms up again from ``step``."""
        self.step = step
        self.stream.seek(step * self.batches_per_step)
        self.from_step = step
        if fresh:
            self.warm_from = step


class Reporter:
    """Writes a worker's status to its board and counts its exchange bytes.

    ``store`` is the exchange's client (its traffic is what the product reports, not
    the checkpoints'); a restarted worker's bytes add on to what its previous lives'
    status recorded (read here, once)."""

    def __init__(self, board: StatusBoard, meter: Meter, store: ObjectStore, cfg: RunConfig):
        self.board = board
        self.meter = meter
        self.store = store
        self.total_steps = cfg.train.steps
        self.moved_before = report.moved_before(board)
        #: seconds of the recent steps, without their exchange (a merge's wait for a
        #: mean is the others' pace, not this worker's): their median, the usual step,
        #: is what the aggregator compares members by
        self.pace: deque[float] = deque(maxlen=PACE_STEPS)

    def moved(self) -> tuple[int, int]:
        """Exchange bytes up and down over every life of this worker (not checkpoints)."""
        t, (up, down) = self.store.traffic, self.moved_before
        return up + t.bytes_up, down + t.bytes_down

    def usual_step_s(self) -> float | None:
        """The median of the recent steps' seconds, their exchange left out (None
        before ``PACE_STEPS // 2`` steps: a straggler is judged over many steps, not a
        few noisy ones)."""
        if len(self.pace) < PACE_STEPS // 2:
            return None
        return round(statistics.median(self.pace), 4)

    def status(self, state: str, *, position: Position | None = None,
               sync: Synchronizer | None = None, slot: int | None = None,
               force: bool = False, **fields: Any) -> None:
        """Overwrite the worker's status: ``state`` and every figure the run reads of
        it. ``position`` None: nothing trained yet (a joiner waiting for admission)."""
        (up, down), bill = self.moved(), self.meter.figures()  # exchange bytes; the bill: all
        self.board.update(
            state, force=force, step=position.step if position else 0,
            total_steps=self.total_steps, tokens=position.tokens if position else 0,
            bytes_up=up, bytes_down=down, **bill,
            wait_s=sync.stats.wait_seconds if sync else 0.0, **report.taus(sync),
            from_step=position.from_step if position else 0, slot=slot,
            step_s=self.usual_step_s(), rebases=sync.stats.rebases if sync else 0, **fields,
        )
