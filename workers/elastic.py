"""A worker's side of elastic membership: join, take its data slot, heal, leave.

- **Join**: a worker that is not one of the manifest's workers creates its
  membership record (create-only, with a claim id so that its own record read back
  after a crash is told from another joiner's), then waits for the aggregator's
  admission, which names its data slot.
- **Data**: the train tokens are cut into ``data.slots`` equal shares; a member
  reads only its slot's share, so members never read each other's tokens. The
  manifest's workers hold slots 0..M-1; the aggregator gives a joiner the lowest
  slot no present member holds. A worker that starts (or restarts) at inner step S
  reads its slot from batch S on (`WorkerStream.seek`), so even a slot taken over
  from a worker that left is never read twice at the same position.
- **Catch up**: a joiner, a worker started again without a checkpoint, or one whose
  checkpoint is behind rounds already reduced, takes the canonical state at the
  run's newest merge point (`diloco.bootstrap.frontier`) instead of sending stale
  rounds; so does a worker that falls more than ``max_staleness`` rounds behind
  during the run (`diloco.synchronizer.Behind`).
- **Leave**: at a merge point (nothing of its own is in flight then), a worker asked
  to leave makes sure its rounds are committed, writes ``members/{name}/left.json``
  with its last round per fragment, and stops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from diloco.bootstrap import frontier
from diloco.membership import (
    MembershipError,
    claim_name,
    has_left,
    leave_requested,
    new_claim,
    read_json,
    record_left,
    run_finished,
    wait_admission,
)
from storage import layout
from storage.errors import TransientStoreError
from storage.objectstore import ObjectStore
from storage.retry import outlast
from storage.spec import RunManifest
from workers.config import RunConfig

#: a `workers.loop.WorkerLoop` (not imported: it imports this module)
WorkerLoop = Any

log = logging.getLogger(__name__)


class RunFinished(MembershipError):
    """There is nothing left to train: every round of the run is reduced."""


@dataclass
class Seat:
    """Where a member sits: its data slot of ``slots``, its batch size, and
    whether it joined mid-run."""

    slot: int
    slots: int
    batch_size: int
    joined: bool


def take_seat(store: ObjectStore, manifest: RunManifest, cfg: RunConfig, worker: str, *,
              join: bool, claim: str | None, on_wait: Any = None,
              admission_timeout_s: float = 600.0) -> Seat:
    """The member's seat; for a joiner, claim the name and wait for admission.
    Raises `MembershipError` (one line) for a name taken or a worker not in the run."""
    slots = cfg.data.slot_count(len(manifest.workers))
    batch = cfg.data.worker_batch_size.get(worker, cfg.data.batch_size)
    if worker in manifest.workers:
        if join:
            raise MembershipError(
                f"worker name {worker!r} is taken: it is one of run {manifest.run_id!r}'s "
                f"workers ({', '.join(manifest.workers)}); pick another --worker")
        return Seat(manifest.workers.index(worker), slots, batch, joined=False)
    record = read_json(store, layout.member(worker))
    if record is None or not record.get("join"):
        if not join:
            raise MembershipError(
                f"worker {worker!r} is not in run {manifest.run_id!r} (workers: "
                f"{', '.join(manifest.workers)}); add it with: diloco join RUN --worker "
                f"{worker}")
        if cfg.train.strategy != "diloco":
            raise MembershipError(
                f"train.strategy is {cfg.train.strategy!r}: only 'diloco' runs take joiners")
        if run_finished(store, manifest):
            raise RunFinished(f"run {manifest.run_id!r} has finished: every round is reduced "
                              "(nothing left to join)")
        claim_name(store, manifest, worker, claim or new_claim(), batch_size=batch)
        record = read_json(store, layout.member(worker)) or {}
    elif join and record.get("claim") != claim:  # a relaunch without --join is a resume
        raise MembershipError(
            f"worker name {worker!r} is taken: run {manifest.run_id!r} already has a member "
            f"{worker!r} (members/{worker}.json); pick another --worker")
    if on_wait is not None:
        on_wait()
    admission = wait_admission(store, worker, timeout_s=admission_timeout_s)
    return Seat(int(admission["slot"]), slots, int(record.get("batch_size") or batch),
                joined=True)


def catch_up(loop: WorkerLoop, *, fresh: bool, reason: str) -> bool:
    """Take the canonical state at the run's newest merge point if it is ahead of
    ``loop``; True if the worker moved. ``fresh``: its inner optimizer is new (a
    joiner, or a start without a checkpoint), so its learning rate warms up again
    from there."""
    sync = loop.sync
    if sync is None:
        return False
    loop._status("joining", force=True, note=reason)
    front = outlast(lambda: frontier(loop.exchange, loop.cfg.sync, stop=loop.stop.is_set,
                                     timeout_s=loop.cfg.sync.liveness.outage_s),
                    patience_s=loop.cfg.sync.liveness.outage_s, log=log, stop=loop.stop.is_set,
                    what=f"worker {loop.worker}: read the run's canonical state", pause_s=2.0)
    if front.step >= loop.cfg.train.steps:
        raise RunFinished(
            f"run {loop.exchange.manifest.run_id!r} has finished: every round is reduced "
            "(nothing left to train)")
    if front.step <= loop.step:
        loop._status("running", force=True)
        return False
    log.info("worker %s: %s: taking the canonical state at step %d (merge point %d)",
             loop.worker, reason, front.step, front.merge_point)
    sync.rebase(front.step, front.rounds, front.outer)
    loop.step = front.step
    loop.stream.seek(front.step * loop.cfg.optim.grad_accum)
    loop.from_step = front.step
    if fresh:
        loop.warm_from = front.step
    loop._status("running", force=True)
    return True


def behind(loop: WorkerLoop) -> bool:
    """Whether a starting worker's next round of some fragment was reduced without
    it (a round reduced with its contribution is one it replays exactly, as a
    worker started again after a crash does)."""
    sync = loop.sync
    if sync is None:
        return False

    def check() -> bool:
        for p, (r, n) in enumerate(zip(sync._next_round, sync.rounds, strict=True)):
            commit = loop.exchange.mean_commit(p, r) if r < n else None
            if commit is not None and loop.worker not in commit.get("weights", {}):
                return True
        return False

    return outlast(check, patience_s=loop.cfg.sync.liveness.outage_s, log=log, pause_s=2.0,
                   what=f"worker {loop.worker}: read where the run is", stop=loop.stop.is_set)


def merged_at(loop: WorkerLoop, step: int) -> bool:
    """Whether a fragment merged after inner step ``step`` (a place to leave). Every
    rank of an island answers alike: the schedule is the run's, not rank 0's."""
    return loop._uses_sync() and any(e.kind == "merge" for e in loop.schedule.events(step))


def leaving(loop: WorkerLoop, step: int | None = None) -> bool:
    """Whether the worker leaves now: at its start (``step`` None) if it left or was
    asked to, else after inner step ``step`` if a fragment merged then and it was asked
    to. In an island rank 0 alone reads the request (it alone talks to the store) and
    the ranks agree on it (`workers.island.Island.agree`), so they all leave after the
    same step: a rank that went on would wait forever in the next step's all-reduce."""
    if not loop._uses_sync() or (step is not None and not merged_at(loop, step)):
        return False
    wants = loop.sync is not None and (
        (step is None and already_left(loop)) or asked_to_leave(loop))
    if loop.group.size == 1:
        return wants
    return loop.island.agree(int(wants)) > 0


def asked_to_leave(loop: WorkerLoop) -> bool:
    """Whether ``diloco leave`` asked this worker to leave. A store that keeps failing
    the read does not stop training over it: the request is read again at the next
    merge (a leave is never urgent)."""
    try:
        return leave_requested(loop.store, loop.worker)
    except TransientStoreError as exc:
        log.warning("%s: could not read whether it is asked to leave (read again at the "
                    "next merge): %s", loop.worker, exc)
        return False


def already_left(loop: WorkerLoop) -> bool:
    return has_left(loop.store, loop.worker)


def leave(loop: WorkerLoop) -> None:
    """Commit what was sent, record the last rounds, say ``left``."""
    if not loop.group.leader:
        return  # an island's rank 0 records it, with the rounds its synchroniser sent
    sync = loop.sync
    last = [-1] * len(loop.plan)
    if sync is not None:
        sync.inflight.drain()  # every round sent is committed before the record
        last = [r - 1 for r in sync._next_round]
    record_left(loop.store, loop.worker, last, loop.step)
    log.info("worker %s: left the run after step %d (last rounds %s)", loop.worker,
             loop.step, last)
