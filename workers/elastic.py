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
import threading
from collections.abc import Callable
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
from diloco.schedule import Schedule
from diloco.synchronizer import Synchronizer
from storage import layout
from storage.errors import TransientStoreError
from storage.exchange import Exchange
from storage.objectstore import ObjectStore
from storage.retry import outlast
from storage.spec import RunManifest
from workers.config import RunConfig
from workers.group import Group
from workers.island import Island
from workers.progress import Position

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


@dataclass(frozen=True)
class Member:
    """What elastic membership needs of a worker, and no more: who it is, where the
    run is, its island and the run's schedule (read only), the event that stops it,
    and ``status``, which writes its status (``status(state, force=..., note=...)``).
    Its progress (`workers.progress.Position`) and its synchroniser are passed apart:
    they are what membership changes or reads as the worker trains."""

    worker: str
    group: Group
    cfg: RunConfig
    store: ObjectStore
    exchange: Exchange
    island: Island
    schedule: Schedule
    stop: threading.Event
    status: Callable[..., None]

    @property
    def uses_sync(self) -> bool:
        """Whether the worker exchanges through the store (``diloco``); the
        data-parallel baseline has no membership to change."""
        return self.cfg.train.strategy == "diloco"


def catch_up(member: Member, sync: Synchronizer | None, position: Position, *, fresh: bool,
             reason: str) -> bool:
    """Take the canonical state at the run's newest merge point if it is ahead of
    ``position``; True if the worker moved. ``fresh``: its inner optimizer is new (a
    joiner, or a start without a checkpoint), so its learning rate warms up again
    from there."""
    if sync is None:
        return False
    cfg, stop = member.cfg, member.stop
    member.status("joining", force=True, note=reason)
    front = outlast(lambda: frontier(member.exchange, cfg.sync, stop=stop.is_set,
                                     timeout_s=cfg.sync.liveness.outage_s),
                    patience_s=cfg.sync.liveness.outage_s, log=log, stop=stop.is_set,
                    what=f"worker {member.worker}: read the run's canonical state", pause_s=2.0)
    if front.step >= cfg.train.steps:
        raise RunFinished(
            f"run {member.exchange.manifest.run_id!r} has finished: every round is reduced "
            "(nothing left to train)")
    if front.step <= position.step:
        member.status("running", force=True)
        return False
    log.info("worker %s: %s: taking the canonical state at step %d (merge point %d)",
             member.worker, reason, front.step, front.merge_point)
    sync.rebase(front.step, front.rounds, front.outer)
    position.seek(front.step, fresh=fresh)
    member.status("running", force=True)
    return True


def behind(member: Member, sync: Synchronizer | None) -> bool:
    """Whether a starting worker's next round of some fragment was reduced without
    it (a round reduced with its contribution is one it replays exactly, as a
    worker started again after a crash does)."""
    if sync is None:
        return False

    def check() -> bool:
        for p, (r, n) in enumerate(zip(sync.next_rounds, sync.rounds, strict=True)):
            commit = member.exchange.mean_commit(p, r) if r < n else None
            if commit is not None and member.worker not in commit.get("weights", {}):
                return True
        return False

    return outlast(check, patience_s=member.cfg.sync.liveness.outage_s, log=log, pause_s=2.0,
                   what=f"worker {member.worker}: read where the run is",
                   stop=member.stop.is_set)


def merged_at(member: Member, step: int) -> bool:
    """Whether a fragment merged after inner step ``step`` (a place to leave). Every
    rank of an island answers alike: the schedule is the run's, not rank 0's."""
    return member.uses_sync and any(e.kind == "merge" for e in member.schedule.events(step))


def leaving(member: Member, sync: Synchronizer | None, step: int | None = None) -> bool:
    """Whether the worker leaves now: at its start (``step`` None) if it left or was
    asked to, else after inner step ``step`` if a fragment merged then and it was asked
    to. In an island rank 0 alone reads the request (it alone talks to the store) and
    the ranks agree on it (`workers.island.Island.agree`), so they all leave after the
    same step: a rank that went on would wait forever in the next step's all-reduce."""
    if not member.uses_sync or (step is not None and not merged_at(member, step)):
        return False
    wants = sync is not None and (
        (step is None and already_left(member)) or asked_to_leave(member))
    if member.group.size == 1:
        return wants
    return member.island.agree(int(wants)) > 0


def asked_to_leave(member: Member) -> bool:
    """Whether ``diloco leave`` asked this worker to leave. A store that keeps failing
    the read does not stop training over it: the request is read again at the next
    merge (a leave is never urgent)."""
    try:
        return leave_requested(member.store, member.worker)
    except TransientStoreError as exc:
        log.warning("%s: could not read whether it is asked to leave (read again at the "
                    "next merge): %s", member.worker, exc)
        return False


def already_left(member: Member) -> bool:
    return has_left(member.store, member.worker)


def last_sent(exchange: Exchange, worker: str, sent: list[int]) -> list[int]:
    """Per fragment, the newest round ``worker`` has a contribution committed for:
    ``sent`` (what its synchroniser sent), or later where the store holds more. A
    worker killed after its leave request resumes from an older checkpoint and
    leaves at once; the rounds it committed before the kill may be in means already,
    and its record must not say it left before them."""
    out = []
    for p, r in enumerate(sent):
        while r + 1 < exchange.manifest.rounds[p] and worker in exchange.committed_workers(p, r + 1):
            r += 1
        out.append(r)
    return out


def leave(member: Member, sync: Synchronizer | None, step: int) -> None:
    """Commit what was sent, record the last rounds (one per fragment), say ``left``."""
    if not member.group.leader:
        return  # an island's rank 0 records it, with the rounds its synchroniser sent
    last = [-1] * len(member.exchange.manifest.fragments)
    if sync is not None:
        sync.inflight.drain()  # every round sent is committed before the record
        last = last_sent(member.exchange, member.worker, [r - 1 for r in sync.next_rounds])
    record_left(member.store, member.worker, last, step)
    log.info("worker %s: left the run after step %d (last rounds %s)", member.worker,
             step, last)
