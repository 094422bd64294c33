"""The aggregator's poll pacing (diloco/pacing.py): awake when a round is due, idle
otherwise, and never a change in what the rounds contain."""

from __future__ import annotations

import pytest

from diloco.pacing import Pacer

FAST, SLOW = 0.05, 0.5


def rhythm(pacer: Pacer, p: int, rounds: int, every: float, t0: float = 100.0) -> float:
    """Fragment ``p``'s rounds 0..rounds-1 first seen ``every`` seconds apart; the time
    the last was seen."""
    for r in range(rounds):
        pacer.arrived(p, r, t0 + r * every)
    return t0 + (rounds - 1) * every


def test_without_a_rhythm_the_backoff_is_unchanged() -> None:
    pacer = Pacer(2)
    assert pacer.delay(0.0, [(0, 0), (1, 0)], SLOW, FAST) == SLOW
    pacer.arrived(0, 0, 10.0)  # one round: no interval yet
    assert pacer.delay(10.5, [(0, 1)], SLOW, FAST) == SLOW


def test_polls_fast_around_the_moment_a_round_is_due() -> None:
    pacer = Pacer(1)
    last = rhythm(pacer, 0, 4, every=10.0)
    assert pacer.interval(0) == pytest.approx(10.0)
    due = last + 10.0
    # long before: idle, but not sleeping past the window's opening (due - 1 s)
    assert pacer.delay(last + 1.0, [(0, 4)], SLOW, FAST) == SLOW
    assert pacer.delay(due - 1.2, [(0, 4)], SLOW, FAST) == pytest.approx(0.2)
    # inside the window, up to one interval late
    assert pacer.delay(due - 0.5, [(0, 4)], SLOW, FAST) == FAST
    assert pacer.delay(due + 9.0, [(0, 4)], SLOW, FAST) == FAST
    # a round that never comes: back to the backoff after one interval
    assert pacer.delay(due + 11.0, [(0, 4)], SLOW, FAST) == SLOW


def test_a_round_that_has_begun_to_arrive_is_polled_fast_for_one_interval() -> None:
    pacer = Pacer(1)
    rhythm(pacer, 0, 3, every=4.0, t0=0.0)
    pacer.arrived(0, 3, 12.0)  # the first contribution of round 3; round 3 still open
    assert pacer.delay(12.1, [(0, 3)], SLOW, FAST) == FAST
    assert pacer.delay(15.9, [(0, 3)], SLOW, FAST) == FAST
    assert pacer.delay(16.5, [(0, 3)], SLOW, FAST) == SLOW  # a worker is absent


def test_the_soonest_fragment_sets_the_pause() -> None:
    pacer = Pacer(2)
    rhythm(pacer, 0, 3, every=10.0, t0=0.0)   # round 3 due at 30
    rhythm(pacer, 1, 3, every=10.0, t0=5.0)   # round 3 due at 35
    assert pacer.delay(25.0, [(0, 3), (1, 3)], 8.0, FAST) == pytest.approx(4.0)
    assert pacer.delay(29.5, [(0, 3), (1, 3)], SLOW, FAST) == FAST
    # fragment 1 finished its rounds: only fragment 0's rhythm counts
    assert pacer.delay(33.0, [(0, 4)], SLOW, FAST) == SLOW


def test_the_median_interval_ignores_one_slow_round_and_the_first_sighting_counts() -> None:
    pacer = Pacer(1)
    times = [0.0, 2.0, 4.0, 14.0, 16.0, 18.0]  # one 10 s gap (a stalled worker)
    for r, t in enumerate(times):
        pacer.arrived(0, r, t)
        pacer.arrived(0, r, t + 1.5)  # a second contribution of the same round
    assert pacer.interval(0) == pytest.approx(2.0)
    assert pacer.delay(19.9, [(0, 6)], SLOW, FAST) == FAST


def test_a_real_run_teaches_the_aggregator_each_fragments_rhythm(tmp_path) -> None:
    """Workers and aggregator on a directory store: every round is applied and the pacer
    has learned an interval for both fragments, about H inner steps of wall time."""
    import time  # noqa: PLC0415

    from diloco.config import SyncConfig  # noqa: PLC0415
    from tests.replicas import Blocks, data, train_replicas  # noqa: PLC0415

    config = SyncConfig(
        schedule={"mode": "streaming", "sync_every": 4, "fragments": 2, "overlap": 1},
    )
    result = train_replicas(f"file://{tmp_path}/run", Blocks, data, config, total_steps=24,
                            before_step=lambda w, s, sync: time.sleep(0.02))
    agg = result.aggregator
    assert agg.next_round == list(agg.manifest.rounds)
    for p in range(2):
        every = agg.pacer.interval(p)
        assert every is not None and every >= 4 * 0.02
