"""The streaming schedule (docs/algorithms.md section 5), checked against tables derived by
hand.

Rule being checked: s = H / P; the k-th merge point t = k * s (k = 1, 2, ...) belongs
to fragment (k - 1) % P, round (k - 1) // P; that round is sent tau steps earlier,
at t = k * s - tau. Steps count from 1.
"""

from __future__ import annotations

import pytest

from diloco.schedule import Event, Schedule

S, M = "send", "merge"


def table(schedule: Schedule, last: int) -> dict[int, list[tuple[str, int, int]]]:
    """Non-empty ``events(t)`` for t = 1..last as (kind, fragment, round)."""
    out = {}
    for t in range(1, last + 1):
        events = schedule.events(t)
        assert all(e.step == t for e in events)
        if events:
            out[t] = [(e.kind, e.fragment, e.round) for e in events]
    return out


# -- the event tables ---------------------------------------------------------------------


def test_events_h6_p3_tau1():
    # s = 6 / 3 = 2. Merge points t = 2k: k = 1..6 -> t = 2, 4, 6, 8, 10, 12 for
    # fragments (k-1) % 3 = 0, 1, 2, 0, 1, 2 and rounds (k-1) // 3 = 0, 0, 0, 1, 1, 1.
    # Sends one step earlier (tau = 1): t = 1, 3, 5, 7, 9, 11.
    assert table(Schedule(6, 3, 1), 12) == {
        1: [(S, 0, 0)],
        2: [(M, 0, 0)],
        3: [(S, 1, 0)],
        4: [(M, 1, 0)],
        5: [(S, 2, 0)],
        6: [(M, 2, 0)],
        7: [(S, 0, 1)],
        8: [(M, 0, 1)],
        9: [(S, 1, 1)],
        10: [(M, 1, 1)],
        11: [(S, 2, 1)],
        12: [(M, 2, 1)],
    }


def test_events_h4_p1_tau0_blocking():
    # s = 4 / 1 = 4. Merge points t = 4, 8 (fragment 0, rounds 0 and 1); tau = 0, so
    # the send is at the same step and is listed first.
    assert table(Schedule(4, 1, 0), 8) == {
        4: [(S, 0, 0), (M, 0, 0)],
        8: [(S, 0, 1), (M, 0, 1)],
    }
    assert Schedule(4, 1, 0).events(4) == [Event("send", 0, 0, 4), Event("merge", 0, 0, 4)]


def test_events_h4_p2_tau1():
    # s = 4 / 2 = 2. Merges t = 2, 4, 6, 8 -> fragments 0, 1, 0, 1, rounds 0, 0, 1, 1.
    # Sends at t - 1 = 1, 3, 5, 7.
    assert table(Schedule(4, 2, 1), 8) == {
        1: [(S, 0, 0)],
        2: [(M, 0, 0)],
        3: [(S, 1, 0)],
        4: [(M, 1, 0)],
        5: [(S, 0, 1)],
        6: [(M, 0, 1)],
        7: [(S, 1, 1)],
        8: [(M, 1, 1)],
    }


def test_events_h6_p2_tau2():
    # s = 6 / 2 = 3, tau = 2 < 3. Merges t = 3, 6, 9, 12 -> fragments 0, 1, 0, 1,
    # rounds 0, 0, 1, 1. Sends at t - 2 = 1, 4, 7, 10; steps 2, 5, 8, 11 are free.
    assert table(Schedule(6, 2, 2), 12) == {
        1: [(S, 0, 0)],
        3: [(M, 0, 0)],
        4: [(S, 1, 0)],
        6: [(M, 1, 0)],
        7: [(S, 0, 1)],
        9: [(M, 0, 1)],
        10: [(S, 1, 1)],
        12: [(M, 1, 1)],
    }


def test_events_h6_p3_tau0():
    # s = 2, tau = 0: send and merge together at t = 2, 4, ..., 12.
    assert table(Schedule(6, 3, 0), 12) == {
        2: [(S, 0, 0), (M, 0, 0)],
        4: [(S, 1, 0), (M, 1, 0)],
        6: [(S, 2, 0), (M, 2, 0)],
        8: [(S, 0, 1), (M, 0, 1)],
        10: [(S, 1, 1), (M, 1, 1)],
        12: [(S, 2, 1), (M, 2, 1)],
    }


def test_stride():
    assert Schedule(6, 3, 1).stride == 2  # 6 / 3
    assert Schedule(4, 1).stride == 4  # 4 / 1
    assert Schedule(50, 5, 3).stride == 10  # 50 / 5


# -- invariants over several settings ----------------------------------------------------

SETTINGS = [(6, 3, 1), (4, 1, 0), (4, 2, 1), (6, 2, 2), (6, 3, 0), (12, 4, 2), (5, 5, 0)]


@pytest.mark.parametrize(("h", "p", "tau"), SETTINGS)
def test_each_fragment_synchronised_every_h_steps(h, p, tau):
    sched = Schedule(h, p, tau)
    merges: dict[int, list[int]] = {f: [] for f in range(p)}
    sends: dict[int, list[int]] = {f: [] for f in range(p)}
    for t in range(1, 4 * h + 1):
        for e in sched.events(t):
            (sends if e.kind == "send" else merges)[e.fragment].append(t)
    for f in range(p):
        # 4 H steps hold exactly 4 merges of each fragment, H apart, the first at
        # (f + 1) * s; sends are tau earlier.
        s = h // p
        assert merges[f] == [(f + 1) * s + r * h for r in range(4)]
        assert sends[f] == [m - tau for m in merges[f]]


@pytest.mark.parametrize(("h", "p", "tau"), SETTINGS)
def test_at_most_one_fragment_in_flight(h, p, tau):
    sched = Schedule(h, p, tau)
    in_flight: set[int] = set()
    for t in range(1, 4 * h + 1):
        for e in sched.events(t):  # processed in the listed order
            if e.kind == "send":
                assert e.fragment not in in_flight
                in_flight.add(e.fragment)
            else:
                assert e.fragment in in_flight  # a merge always follows its send
                in_flight.remove(e.fragment)
            assert len(in_flight) <= 1
        if tau == 0:
            assert not in_flight  # blocking: nothing survives the step


@pytest.mark.parametrize(("h", "p", "tau"), SETTINGS)
def test_merge_step_and_send_step_agree_with_events(h, p, tau):
    sched = Schedule(h, p, tau)
    last = 3 * h
    seen = set()
    for t in range(1, last + 1):
        for e in sched.events(t):
            if e.kind == "send":
                assert sched.send_step(e.fragment, e.round) == t
            else:
                assert sched.merge_step(e.fragment, e.round) == t
            seen.add((e.kind, e.fragment, e.round))
    expected = set()
    for f in range(p):
        for r in range(3):
            if sched.send_step(f, r) <= last:
                expected.add((S, f, r))
            if sched.merge_step(f, r) <= last:
                expected.add((M, f, r))
    assert seen == expected


def test_merge_step_and_send_step_by_hand():
    sched = Schedule(6, 3, 1)
    # fragment 2, round 1: k = 1 * 3 + 2 + 1 = 6 -> merge at 6 * 2 = 12, send at 11
    assert sched.merge_step(2, 1) == 12
    assert sched.send_step(2, 1) == 11
    # fragment 0, round 0: k = 1 -> merge at 2, send at 1
    assert (sched.send_step(0, 0), sched.merge_step(0, 0)) == (1, 2)


# -- rounds in a run -------------------------------------------------------------------------
# H = 6, P = 3, tau = 1. Per fragment (from the table above):
#   fragment 0: sends 1, 7, 13  merges 2, 8, 14
#   fragment 1: sends 3, 9, 15  merges 4, 10, 16
#   fragment 2: sends 5, 11, 17 merges 6, 12, 18
# rounds_sent_by counts sends at steps <= T. A final round is added when the live
# weights may differ from the outer ones after the last scheduled merge: no round
# sent yet and T > 0; steps after the last merge (T > last merge); or merge alpha
# > 0 (the merge keeps part of the local side). A round still in flight at T is
# merged by finish(); with alpha 0 that sets live = outer, so no final round.


@pytest.mark.parametrize(
    ("total", "sent", "final_a0", "final_a05"),
    [
        # T = 0: nothing ran, nothing to send
        (0, [0, 0, 0], [False, False, False], [False, False, False]),
        # T = 1: fragment 0 sent at 1 (in flight, merge 2 > 1); 1 and 2 never sent
        (1, [1, 0, 0], [False, True, True], [True, True, True]),
        # T = 2: fragment 0 merged exactly at T; 1 and 2 not sent
        (2, [1, 0, 0], [False, True, True], [True, True, True]),
        # T = 3: fragment 0 merged at 2 < 3; fragment 1 sent at 3, in flight
        (3, [1, 1, 0], [True, False, True], [True, True, True]),
        # T = 6 = H: fragments 0 and 1 merged at 2, 4 < 6; fragment 2 merged at 6 = T
        (6, [1, 1, 1], [True, True, False], [True, True, True]),
        # T = 11: merges 8, 10 < 11; fragment 2 sent round 1 at 11, merge 12 > 11
        (11, [2, 2, 2], [True, True, False], [True, True, True]),
        # T = 12 = 2H: merges 8, 10 < 12; fragment 2 merged round 1 at 12 = T
        (12, [2, 2, 2], [True, True, False], [True, True, True]),
        # T = 13: fragment 0 sent round 2 at 13 (merge 14 > 13); 10, 12 < 13
        (13, [3, 2, 2], [False, True, True], [True, True, True]),
    ],
)
def test_rounds_in_run_h6_p3_tau1(total, sent, final_a0, final_a05):
    sched = Schedule(6, 3, 1)
    assert [sched.rounds_sent_by(f, total) for f in range(3)] == sent
    assert [sched.has_final_round(f, total, 0.0) for f in range(3)] == final_a0
    assert [sched.has_final_round(f, total, 0.5) for f in range(3)] == final_a05
    assert sched.rounds_in_run(total, 0.0) == [n + f for n, f in zip(sent, final_a0, strict=True)]
    assert sched.rounds_in_run(total, 0.5) == [n + f for n, f in zip(sent, final_a05, strict=True)]


def test_rounds_in_run_h6_p3_tau1_by_hand():
    sched = Schedule(6, 3, 1)
    # restating rows of the table above as the totals the manifest stores
    assert sched.rounds_in_run(6, 0.0) == [2, 2, 1]  # 1+1, 1+1, 1+0
    assert sched.rounds_in_run(6, 0.5) == [2, 2, 2]
    assert sched.rounds_in_run(12, 0.0) == [3, 3, 2]  # 2+1, 2+1, 2+0
    assert sched.rounds_in_run(12, 0.5) == [3, 3, 3]
    assert sched.rounds_in_run(13, 0.0) == [3, 3, 3]  # 3+0, 2+1, 2+1
    assert sched.rounds_in_run(13, 0.5) == [4, 3, 3]


@pytest.mark.parametrize(
    ("total", "a0", "a05"),
    [
        # H = 4, P = 1, tau = 0 (blocking DiLoCo): send + merge at 4, 8.
        (0, [0], [0]),
        (3, [1], [1]),  # no send yet, 3 local steps: one final round
        (4, [1], [2]),  # merged at 4 = T: alpha 0 -> live = outer, no final round
        (5, [2], [2]),  # one step after the merge at 4
        (7, [2], [2]),
        (8, [2], [3]),  # rounds at 4 and 8, T at a merge
        (9, [3], [3]),
    ],
)
def test_rounds_in_run_h4_p1_tau0(total, a0, a05):
    sched = Schedule(4, 1, 0)
    assert sched.rounds_in_run(total, 0.0) == a0
    assert sched.rounds_in_run(total, 0.5) == a05


@pytest.mark.parametrize(
    ("total", "sent", "a0", "a05"),
    [
        # H = 4, P = 2, tau = 1. Fragment 0: sends 1, 5, 9, merges 2, 6, 10.
        # Fragment 1: sends 3, 7, merges 4, 8.
        (4, [1, 1], [2, 1], [2, 2]),  # f0 merged 2 < 4; f1 merged 4 = T
        (5, [2, 1], [2, 2], [3, 2]),  # f0 round 1 in flight (sent 5); f1 merged 4 < 5
        (8, [2, 2], [3, 2], [3, 3]),  # f0 merged 6 < 8; f1 merged 8 = T
    ],
)
def test_rounds_in_run_h4_p2_tau1(total, sent, a0, a05):
    sched = Schedule(4, 2, 1)
    assert [sched.rounds_sent_by(f, total) for f in range(2)] == sent
    assert sched.rounds_in_run(total, 0.0) == a0
    assert sched.rounds_in_run(total, 0.5) == a05


def test_rounds_in_run_h6_p2_tau2_in_flight_with_local_steps():
    # H = 6, P = 2, tau = 2: fragment 0 sent at 1, merges at 3. At T = 2 it is in
    # flight with one local step (step 2) after its send. Alpha 0 discards that step
    # at the merge (docs/algorithms.md section 5), so no final round; alpha > 0 keeps it.
    sched = Schedule(6, 2, 2)
    assert sched.rounds_sent_by(0, 2) == 1
    assert sched.rounds_in_run(2, 0.0) == [1, 1]  # f1 never sent: 0 + 1
    assert sched.rounds_in_run(2, 0.5) == [2, 1]


# -- invalid schedules ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("h", "p", "tau"),
    [
        (4, 5, 0),  # P > H
        (6, 4, 0),  # H % P = 2
        (6, 3, 2),  # tau = 2 >= H / P = 2
        (4, 1, 4),  # tau = 4 >= H / P = 4
        (6, 3, -1),  # tau < 0
        (4, 0, 0),  # P < 1
        (0, 1, 0),  # H < 1
    ],
)
def test_invalid_schedule_raises(h, p, tau):
    with pytest.raises(ValueError, match="invalid schedule") as info:
        Schedule(h, p, tau)
    assert f"H = {h}, P = {p}, tau = {tau}" in str(info.value)


def test_largest_valid_overlap():
    # tau = H / P - 1 is the largest allowed: H = 6, P = 3 -> tau = 1
    Schedule(6, 3, 1)
    Schedule(4, 1, 3)  # s = 4, tau = 3: send at 1, merge at 4
    assert Schedule(4, 1, 3).send_step(0, 0) == 1
