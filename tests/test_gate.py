"""The aggregator's gate decides when a round goes on without someone.

A member that is coming (training, progressing, or held by a mean the run has not
reduced, and not a straggler) is waited for up to ``deadline_s``; the grace window
is only for members that are not coming. All on a fake clock, with the members'
status objects written into a memory store as workers write them.
"""

from __future__ import annotations

import json
import uuid

import pytest

from diloco.gate import Gate, Inbox
from diloco.membership import PROGRESS_MIN_S, START_PATIENCE_S, Roster
from diloco.run import open_run
from storage import layout
from workers.config import load_config
from workers.runs import create_run

# H 4, P 2: merge points every 2 steps; fragment 0 rounds merge at steps 2, 6, ...
MICRO = ["model.overrides={d_model: 32, n_layers: 2, n_heads: 2, max_seq_len: 64}",
         "data.seq_len=16", "data.batch_size=4", "train.steps=16",
         "sync.schedule.sync_every=4", "sync.schedule.fragments=2", "sync.schedule.overlap=1",
         "sync.membership.grace_min_s=0.5", "sync.membership.grace_max_s=5", "sync.liveness.lease_s=120",
         "sync.membership.deadline_s=600", "workers=[a, b, c]"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def exchange(tmp_path_factory):
    from workers.data.prepare import prepare_data  # noqa: PLC0415

    data = f"memory://datasets/gate-{uuid.uuid4().hex[:8]}"
    prepare_data(["builtin:shakespeare"], data, max_bytes=50_000)
    url = f"memory://gate/{uuid.uuid4().hex}"
    create_run(load_config("tiny", [*MICRO, f"data.dataset={data}"]), url)
    return open_run(url)


class Setup:
    """A roster and gate on a fake clock over one run's store."""

    def __init__(self, exchange, *overrides: str, reduced=lambda p, r: False):
        from diloco.config import SyncConfig  # noqa: PLC0415

        self.ex = exchange
        for key in list(exchange.store.list("members/")):
            exchange.store.delete(key)
        self.clock = Clock()
        changes: dict[str, dict[str, float]] = {}
        for item in overrides:  # section.field=value
            key, v = item.split("=")
            section, field = key.split(".")
            changes.setdefault(section, {})[field] = float(v)
        self.config = SyncConfig.stored(exchange.manifest.sync).changed(**changes)
        self.roster = Roster(exchange.store, exchange.manifest, lease_s=self.config.liveness.lease_s,
                             slots=3, clock=self.clock)
        self.gate = Gate(exchange, self.config, self.roster, "aggregator", reduced=reduced)
        self.n = 0

    def status(self, name: str, step: int, state: str = "running",
               step_s: float | None = 0.1) -> None:
        """What a worker's status says (a fresh ``updated`` each time: a renewal)."""
        self.n += 1
        body = {"name": name, "state": state, "updated": f"t{self.n}", "step": step,
                "step_s": step_s}
        self.ex.store.put(layout.member_status(name), json.dumps(body).encode())

    def tick(self, seconds: float) -> None:
        self.clock.now += seconds
        self.roster.refresh(force=True)

    def ready(self, inbox: Inbox, p: int = 0, r: int = 0) -> bool:
        return self.gate.ready(p, r, inbox)


def arrived(*names: str) -> Inbox:
    return Inbox(values=dict.fromkeys(names))


def test_a_progressing_member_is_waited_for_past_every_grace_window(exchange):
    """a and c are in (a quorum of 3 at 0.5), b trains on slowly: the round waits,
    far past grace_max_s (5 s), until b's contribution or deadline_s (600 s)."""
    s = Setup(exchange)
    inbox = arrived("a", "c")
    for step in range(1, 40):
        for w in "abc":
            s.status(w, step)
        s.tick(4.0)  # each status a step further, 4 s apart: b is progressing
        assert not s.ready(inbox)
    assert inbox.waiting == ["b"]
    s.tick(600.0 - 39 * 4.0)  # deadline_s after the first arrival
    assert s.ready(inbox)


def test_a_member_that_stopped_progressing_gets_only_the_grace_window(exchange):
    """b's status is renewed but its step stays at 3: after PROGRESS_MIN_S (its gaps
    are 1 s, 10 of them is less) it is not coming, and the grace window (5 s at
    most, here its lower bound as no pace is known) lets the round go on."""
    s = Setup(exchange)
    for step in range(1, 4):
        for w in "abc":
            s.status(w, step)
        s.tick(1.0)
    inbox = arrived("a", "c")
    s.status("b", 3)  # renewed (a new ``updated``), no progress
    s.tick(PROGRESS_MIN_S - 5)
    assert not s.ready(inbox)  # still within its patience
    s.status("b", 3)
    s.tick(6.0)
    assert not s.ready(inbox)  # not coming: the grace window starts to count
    s.tick(5.0)
    assert s.ready(inbox)


def test_a_straggler_is_not_waited_for(exchange):
    """c's usual step (0.35 s) is above twice the others' (0.1 s): a straggler,
    although it progresses; the round goes on after the grace window."""
    s = Setup(exchange)
    inbox = arrived("a", "b")
    for step in range(1, 3):
        s.status("a", step)
        s.status("b", step)
        s.status("c", step, step_s=0.35)
        s.tick(1.0)
    assert s.roster.straggler("c") and not s.roster.straggler("a")
    assert not s.ready(inbox)  # the grace window starts
    s.tick(5.0)
    assert s.ready(inbox)
    just_slow = Setup(exchange)
    for step in range(1, 3):
        just_slow.status("a", step)
        just_slow.status("b", step)
        just_slow.status("c", step, step_s=0.19)  # 1.9 x: slow, not a straggler
        just_slow.tick(1.0)
    just_slow.tick(10.0)
    assert not just_slow.ready(arrived("a", "b"))


def test_a_member_held_by_an_open_mean_is_waited_for_without_progress(exchange):
    """b sent fragment 0 round 1 (merge at step 6) and waits at that merge for its
    mean, which the run has not reduced: no progress for minutes, still coming. Once
    that round is reduced (and b still does not move) it is not."""
    done: set[tuple[int, int]] = set()
    s = Setup(exchange, reduced=lambda p, r: (p, r) in done)
    s.gate.inbox(0, 1).values.update(dict.fromkeys(["b"]))  # b's round 1 of fragment 0
    for w in "abc":
        s.status(w, 5)
    s.tick(1.0)
    s.roster.contributed("b", 5)
    inbox = arrived("a", "c")  # fragment 1 round 1, which b has not sent
    s.tick(PROGRESS_MIN_S * 3)
    for w in "abc":
        s.status(w, 5)  # renewals keep the leases
    s.tick(1.0)
    assert not s.ready(inbox, 1, 1)
    done.add((0, 1))
    assert not s.ready(inbox, 1, 1)  # not held any more: the grace window starts
    s.tick(6.0)
    assert s.ready(inbox, 1, 1)


def test_contributions_keep_a_member_without_status_live_for_hours(exchange):
    """The Python API writes no status: each contribution renews the lease, so after
    an hour of rounds every member is still expected; one that stops contributing
    lapses after lease_s plus the start patience."""
    s = Setup(exchange)
    for minute in range(60):
        s.tick(60.0)
        for step, w in enumerate("abc"):
            s.roster.contributed(w, 4 * minute + step)
        assert s.gate.expected(0, 0) == {"a", "b", "c"}
        assert all(s.roster.coming(w) for w in "abc")
    for minute in range(8):
        s.tick(60.0)
        s.roster.contributed("a", 1000 + minute)
        s.roster.contributed("b", 1000 + minute)
    assert s.gate.expected(0, 0) == {"a", "b"}  # c: silent for lease_s + START_PATIENCE_S
    assert 120 + START_PATIENCE_S < 8 * 60


def test_a_lapsed_lease_is_not_expected(exchange):
    s = Setup(exchange)
    for w in "abc":
        s.status(w, 1)
    s.tick(1.0)
    for _ in range(5):
        s.status("a", 2)
        s.status("c", 2)
        s.tick(30.0)  # b renews nothing for 150 s > lease_s
    assert s.gate.expected(0, 0) == {"a", "c"}
    assert s.ready(arrived("a", "c"))


def test_a_quorum_of_half_of_three_is_two(exchange):
    """quorum 0.5 of 3 expected members needs ceil(1.5) = 2: with one contribution in
    and the two others not coming, the round never goes on (until deadline_s); with
    two in, it goes on after the grace window."""
    s = Setup(exchange)
    for w in "abc":
        s.status(w, 3)
    s.tick(1.0)
    s.tick(PROGRESS_MIN_S + 1)  # no one progresses: no one is coming
    for w in "abc":
        s.status(w, 3)  # renewed leases
    s.tick(1.0)
    one = arrived("a")
    for _ in range(5):
        assert not s.ready(one)
        s.tick(10.0)
    two = arrived("a", "b")
    assert not s.ready(two)  # the grace window starts
    s.tick(5.0)
    assert s.ready(two)
