"""Who takes part in a run: membership records, leases, admissions and leaves.

Everything is an object in the run's store, so any party (and any audit) sees the
same members:

- the manifest's workers are the initial members, holding data slots 0..M-1;
- a worker joins mid-run with a create-only record ``members/{name}.json`` marked
  ``join`` (two joiners racing for one name: one create wins, the other is refused
  and writes nothing); the aggregator, the one authority, admits it with a
  create-only ``members/{name}/admission.json`` naming its data slot;
- a member's lease is renewed by its status object (every renewal changes its
  ``updated`` field) and by every contribution it commits, so a member driven through
  the Python API, which writes no status, is live as long as it contributes; the
  aggregator, on its own clock, counts a member live while it has seen a renewal
  within ``lease_s`` (worker clocks never decide);
- a member's progress is the step its status reports (a worker writes it every
  ``HEARTBEAT_S`` while it trains, with its usual step time) and the send step of each
  contribution: the aggregator waits for a member that is progressing, and goes on
  without one that is not, whose lease lapsed, or that is a straggler
  (`Roster.coming`);
- ``diloco leave`` writes ``control/leave/{name}.json``; the worker finishes its
  round, commits, and writes ``members/{name}/left.json`` with its last round per
  fragment, after which no one waits for it.

The aggregator decides per (fragment, round) which members it expects (`Roster.
expected`) and records that decision in the mean's commit, so every party sees who
took part.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from storage import layout
from storage.errors import ObjectMissing
from storage.objectstore import ObjectStore
from storage.spec import RunManifest

log = logging.getLogger(__name__)

#: states of a member's status in which it sends no more rounds (until it changes):
#: one catching up to the run's state, one that left or finished. An interrupted or
#: failed member stays expected until its lease lapses (it is usually relaunched).
IDLE = ("joining", "left", "finished")


#: seconds a member that has not written its first status yet keeps its lease
#: beyond ``lease_s`` (a job starting on a busy machine or a cold node)
START_PATIENCE_S = 300.0
#: a member is progressing while its newest progress (a higher step in its status,
#: or a contribution) is at most this many of its usual gaps old ...
PROGRESS_GAPS = 10.0
#: ... and never less than this (a loaded machine stretches steps for a while), nor
#: more than its lease
PROGRESS_MIN_S = 30.0
#: a member whose usual step time is above this multiple of the others' median is a
#: straggler: rounds go on without it after the grace window
STRAGGLER_FACTOR = 2.0
#: statuses of a member still training (or not heard from yet): the ones waited for
TRAINING = (None, "running")


class MembershipError(ValueError):
    """A join or leave that cannot be done (the message says why, in one line)."""



def read_json(store: ObjectStore, key: str) -> dict[str, Any] | None:
    """The JSON object at ``key``, or None when it is absent or unreadable."""
    try:
        body = json.loads(store.get(key))
    except (ObjectMissing, ValueError):
        return None
    return body if isinstance(body, dict) else None


def new_claim() -> str:
    """A fresh claim id: it tells a joiner's own record (read back after a crash)
    from another joiner's that took the name."""
    return secrets.token_hex(8)


def claim_name(store: ObjectStore, manifest: RunManifest, name: str, claim: str,
               **extra: Any) -> bool:
    """Create the joiner's membership record. True if created now, False if it is
    this claim's own record from an earlier attempt; `MembershipError` if the name
    is another member's."""
    layout.check_name("worker", name)
    if name in manifest.workers:
        raise MembershipError(
            f"worker name {name!r} is taken: it is one of run {manifest.run_id!r}'s "
            f"workers ({', '.join(manifest.workers)}); pick another --worker"
        )
    body = {"name": name, "join": True, "claim": claim, "created": layout.utc_now(), **extra}
    if store.put_if_absent(layout.member(name), json.dumps(body).encode()):
        return True
    existing = read_json(store, layout.member(name)) or {}
    if existing.get("claim") == claim:
        return False
    raise MembershipError(
        f"worker name {name!r} is taken: run {manifest.run_id!r} already has a member "
        f"{name!r} (members/{name}.json); pick another --worker"
    )


def wait_admission(store: ObjectStore, name: str, *, timeout_s: float,
                   stop: Callable[[], bool] = lambda: False,
                   poll_s: float = 0.2) -> dict[str, Any]:
    """Wait for the aggregator's admission of joiner ``name``: its data slot."""
    deadline = time.monotonic() + timeout_s
    delay = min(0.05, poll_s)
    while True:
        got = read_json(store, layout.admission(name))
        if got is not None:
            if got.get("refused"):
                raise MembershipError(f"worker {name} was not admitted: {got['refused']}")
            return got
        if stop() or time.monotonic() > deadline:
            raise TimeoutError(
                f"worker {name}: no admission from the aggregator after {timeout_s:.0f} s "
                "(is the run's aggregator running?)"
            )
        time.sleep(delay)
        delay = min(delay * 1.5, poll_s)


def run_finished(store: ObjectStore, manifest: RunManifest) -> bool:
    """Whether every fragment's last round is reduced (the run has finished)."""
    return all(store.exists(layout.mean_commit(p, n - 1))
               for p, n in enumerate(manifest.rounds) if n > 0)


def request_leave(store: ObjectStore, name: str, reason: str = "diloco leave") -> bool:
    """Ask worker ``name`` to leave; False when it was asked already."""
    body = {"worker": name, "reason": reason, "created": layout.utc_now()}
    return store.put_if_absent(layout.leave_request(name), json.dumps(body).encode())


def leave_requested(store: ObjectStore, name: str) -> bool:
    return store.exists(layout.leave_request(name))


def record_left(store: ObjectStore, name: str, last_rounds: list[int], step: int) -> None:
    """The worker's record that it left after ``last_rounds`` (per fragment; -1:
    none sent)."""
    body = {"worker": name, "last_rounds": list(last_rounds), "step": step,
            "created": layout.utc_now()}
    store.put_if_absent(layout.left(name), json.dumps(body).encode())


def has_left(store: ObjectStore, name: str) -> bool:
    return store.exists(layout.left(name))


@dataclass
class Member:
    """One member as the aggregator sees it."""

    name: str
    joined: bool = False  # joined mid-run (not a manifest worker)
    slot: int | None = None  # its data slot (None: a joiner not admitted yet)
    refused: str | None = None
    last_rounds: list[int] | None = None  # from left.json: it left after these rounds
    state: str | None = None  # from its status
    from_step: int = 0  # the step it trains from (its newest bootstrap)
    stamp: str | None = None  # its status's ``updated``: a change is a renewal
    seen: float = 0.0  # the aggregator's clock at the newest renewal
    record: dict[str, Any] = field(default_factory=dict)
    step: int | None = None  # the newest step it reached (status or contribution)
    step_s: float | None = None  # its usual inner step, as its status reports it
    progress_at: float | None = None  # the aggregator's clock when ``step`` last rose
    gaps: list[float] = field(default_factory=list)  # recent seconds between rises

    def progressed(self, step: int, now: float) -> None:
        """It reached ``step``: progress if that is beyond what was known."""
        if self.step is not None and step <= self.step:
            return
        if self.progress_at is not None:
            self.gaps = [*self.gaps[-15:], now - self.progress_at]
        self.step, self.progress_at = step, now

    @property
    def left(self) -> bool:
        return self.last_rounds is not None


class Roster:
    """The aggregator's view of the members, refreshed from the store at most every
    ``refresh_s`` seconds (one listing plus one status read per member)."""

    def __init__(self, store: ObjectStore, manifest: RunManifest, *, lease_s: float,
                 slots: int, admit: bool = True, refresh_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.store, self.manifest = store, manifest
        self.lease_s = lease_s
        self.slots = max(slots, len(manifest.workers))
        self.admit = admit
        self.refresh_s = refresh_s if refresh_s is not None else min(2.0, lease_s / 10)
        self.clock = clock
        now = clock()
        # every initial member starts with one lease: a run starting up waits for it
        self.members: dict[str, Member] = {
            w: Member(w, slot=i, seen=now) for i, w in enumerate(manifest.workers)}
        self._refreshed = -float("inf")
        self.events: list[dict[str, Any]] = []  # joins, admissions, leaves, lapses

    # -- reading the store ----------------------------------------------------------
    def refresh(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self._refreshed < self.refresh_s:
            return
        self._refreshed = now
        keys = self.store.list("members/")
        names, admitted, left = set(), set(), set()
        for key in keys:
            rest = key[len("members/"):]
            if rest.endswith(".json") and "/" not in rest:
                names.add(rest[:-5])
            elif rest.endswith("/admission.json"):
                admitted.add(rest[: -len("/admission.json")])
            elif rest.endswith("/left.json"):
                left.add(rest[: -len("/left.json")])
        for name in sorted(names - layout.RESERVED - set(self.members)):
            record = read_json(self.store, layout.member(name))
            if record is None or not record.get("join"):
                continue  # a registration of no worker (or not readable yet)
            self.members[name] = Member(name, joined=True, seen=now, record=record)
            self._event("joined", name)
        for m in self.members.values():
            if m.joined and m.slot is None and m.refused is None:
                if m.name in admitted:
                    self._take_admission(m)
                elif self.admit:
                    self._admit(m)
            if m.name in left and m.last_rounds is None:
                body = read_json(self.store, layout.left(m.name)) or {}
                m.last_rounds = [int(x) for x in body.get("last_rounds", [])] or [
                    -1] * len(self.manifest.fragments)
                self._event("left", m.name, last_rounds=m.last_rounds)
            if not m.left:
                self._renew(m, now)

    def _renew(self, m: Member, now: float) -> None:
        status = read_json(self.store, layout.member_status(m.name))
        if status is None:
            return
        stamp = status.get("updated")
        if stamp != m.stamp:
            was_live = self.live(m.name)
            m.stamp, m.seen = stamp, now
            if not was_live and m.state is not None:
                self._event("returned", m.name)
        m.state = status.get("state")
        m.from_step = int(status.get("from_step") or 0)
        if status.get("step") is not None:
            m.progressed(int(status["step"]), now)
        if status.get("step_s") is not None:
            m.step_s = float(status["step_s"])

    def contributed(self, name: str, step: int) -> None:
        """A contribution of ``name`` sent at ``step`` was seen: it renews the lease
        and is progress, with or without a status."""
        m = self.members.get(name)
        if m is None or m.left:
            return
        now = self.clock()
        if not self.live(name) and m.state is not None:
            self._event("returned", name)
        m.seen = now
        m.progressed(step, now)

    def _take_admission(self, m: Member) -> None:
        body = read_json(self.store, layout.admission(m.name)) or {}
        if body.get("refused"):
            m.refused = str(body["refused"])
        elif body.get("slot") is not None:
            m.slot = int(body["slot"])

    def _admit(self, m: Member) -> None:
        held = {x.slot for x in self.members.values() if x.slot is not None and not x.left}
        free = [s for s in range(self.slots) if s not in held]
        if free:
            body: dict[str, Any] = {"worker": m.name, "slot": free[0], "created": layout.utc_now()}
        else:
            body = {"worker": m.name, "created": layout.utc_now(), "refused": (
                f"no free data slot: the run's {self.slots} slots (data.slots) are held by "
                "members that have not left")}
        if not self.store.put_if_absent(layout.admission(m.name), json.dumps(body).encode()):
            self._take_admission(m)  # another aggregator admitted it first
            return
        if body.get("refused"):
            m.refused = body["refused"]
            log.warning("joiner %s refused: %s", m.name, m.refused)
        else:
            m.slot = free[0]
            self._event("admitted", m.name, slot=m.slot)

    def _event(self, kind: str, name: str, **fields: Any) -> None:
        self.events.append({"event": kind, "worker": name, "at": layout.utc_now(), **fields})
        log.info("member %s: %s %s", name, kind, fields or "")

    # -- decisions ------------------------------------------------------------------
    def live(self, name: str) -> bool:
        """Whether ``name`` holds its lease: a renewal seen within ``lease_s``. A
        member never seen to renew yet (starting up: imports, data, the model) has
        ``START_PATIENCE_S`` more, so a slow start does not cost it its first rounds."""
        m = self.members.get(name)
        if m is None or m.left:
            return False
        patience = self.lease_s + (START_PATIENCE_S if m.stamp is None else 0.0)
        return self.clock() - m.seen <= patience

    def progressing(self, name: str) -> bool:
        """Whether ``name`` holds its lease and has made progress lately: its newest
        progress at most ``PROGRESS_GAPS`` of its usual gaps (or step times) old,
        within ``PROGRESS_MIN_S`` .. its lease. One not heard from yet is progressing
        while it holds its lease (it is starting)."""
        m = self.members.get(name)
        if m is None or not self.live(name):
            return False
        if m.progress_at is None:
            return True
        usual = max(float(np.median(m.gaps)) if m.gaps else 0.0, m.step_s or 0.0)
        lease = self.lease_s + (START_PATIENCE_S if m.stamp is None else 0.0)
        patience = min(lease, max(PROGRESS_MIN_S, PROGRESS_GAPS * usual))
        return self.clock() - m.progress_at <= patience

    def straggler(self, name: str) -> bool:
        """Whether ``name``'s usual step time (its status's) is above
        ``STRAGGLER_FACTOR`` times the median of the other live members' (a measure
        over many steps, not one round's arrival)."""
        m = self.members.get(name)
        if m is None or m.step_s is None:
            return False
        others = [x.step_s for x in self.members.values() if x.name != name
                  and x.step_s is not None and self.live(x.name) and x.state in TRAINING]
        return bool(others) and m.step_s > STRAGGLER_FACTOR * float(np.median(others))

    def coming(self, name: str,
               held: Callable[[str, int], bool] = lambda name, step: False) -> bool:
        """Whether a round should wait for ``name`` (up to ``deadline_s``): it is
        training (or not heard from yet), not a straggler, and progressing, or held
        after its newest known step by a mean the run has not reduced yet
        (``held(name, step)``)."""
        m = self.members.get(name)
        if m is None or m.state not in TRAINING or self.straggler(name):
            return False
        if self.progressing(name):
            return True
        return self.live(name) and m.step is not None and held(name, m.step)

    def tokens_per_step(self, name: str) -> int | None:
        """The most tokens ``name`` trains in one inner step: its admitted batch (a
        joiner's from its membership record, else the run's, per worker if set) x
        sequence length x gradient accumulation, from the run's config; None when the
        config does not say (a run made through the Python API)."""
        cfg = self.manifest.config or {}
        data, optim = cfg.get("data") or {}, cfg.get("optim") or {}
        if data.get("batch_size") is None or data.get("seq_len") is None:
            return None
        m = self.members.get(name)
        batch = (m.record.get("batch_size") if m is not None and m.joined else None) or \
            (data.get("worker_batch_size") or {}).get(name, data["batch_size"])
        return int(batch) * int(data["seq_len"]) * int(optim.get("grad_accum") or 1)

    def is_member(self, name: str) -> bool:
        m = self.members.get(name)
        return m is not None and m.refused is None and (m.slot is not None)

    def takes_part(self, name: str, p: int, r: int) -> bool:
        """Whether a contribution of ``name`` to (p, r) may be used: a member that
        had not left before round ``r``."""
        m = self.members.get(name)
        if m is None or not self.is_member(name):
            return False
        return not m.left or r <= m.last_rounds[p]

    def expected(self, p: int, r: int, send_step: int) -> set[str]:
        """The members round ``r`` of fragment ``p`` waits for: admitted, holding a
        live lease, not idle (joining, left, finished), trained from a step before
        the round's send, and not left before it."""
        out = set()
        for m in self.members.values():
            if not self.takes_part(m.name, p, r) or not self.live(m.name):
                continue
            if m.state in IDLE:
                continue
            if m.from_step > send_step:
                continue
            out.add(m.name)
        return out

    def lapsed(self) -> list[str]:
        return sorted(n for n, m in self.members.items()
                      if self.is_member(n) and not m.left and not self.live(n))

    def describe(self) -> list[dict[str, Any]]:
        """Every member with its slot, lease and state, for status and audits."""
        now = self.clock()
        return [{"worker": m.name, "slot": m.slot, "joined": m.joined, "left": m.left,
                 "live": self.live(m.name), "lease_age_s": round(now - m.seen, 1),
                 "state": m.state, "from_step": m.from_step, "refused": m.refused,
                 "step": m.step, "step_s": m.step_s,
                 "straggler": self.straggler(m.name)}
                for m in sorted(self.members.values(), key=lambda x: (x.slot is None,
                                                                       x.slot, x.name))]


def members_of(store: ObjectStore, manifest: RunManifest) -> list[dict[str, Any]]:
    """Every member of a run read from the store (the manifest's workers and the
    joiners), for ``diloco status``: slot, joined, left, state and status age."""
    roster = Roster(store, manifest, lease_s=float("inf"), slots=0, admit=False)
    roster.refresh(force=True)
    out = []
    for m in roster.describe():
        status = read_json(store, layout.member_status(m["worker"])) or {}
        for key in ("live", "lease_age_s", "step", "step_s", "straggler"):
            m.pop(key)  # the aggregator's view, not the store's
        m["updated"] = status.get("updated")
        out.append(m)
    return out
