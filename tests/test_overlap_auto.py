"""``overlap: auto``: the tau decision, the schedule it drives, the replica that
measures and records it, and a resumed worker replaying its decisions. Replicas
and the aggregator run as threads on memory:// stores (tests/replicas.py)."""

from __future__ import annotations

import time
import uuid

import pytest
import torch
from pydantic import ValidationError

from diloco.config import SyncConfig
from diloco.overlap import AutoOverlap, decide_tau
from diloco.schedule import Schedule
from replicas import Blocks, data, train_replicas
from storage.exchange import Exchange


def url() -> str:
    return f"memory://overlap/{uuid.uuid4().hex}"


# -- the decision ------------------------------------------------------------------------
def test_decide_tau_covers_the_worst_recent_latency_plus_the_margin():
    # 0.5 s * 1.25 / 0.15 s = 4.17 steps -> 5
    assert decide_tau([0.2, 0.5, 0.3], 0.15, margin=0.25, start=1, most=9) == 5
    assert decide_tau([0.5], 0.15, margin=0.0, start=1, most=9) == 4  # 3.33 -> 4
    assert decide_tau([0.3], 0.15, margin=0.0, start=1, most=9) == 2  # exactly 2 steps


def test_decide_tau_clamps_to_the_schedule_and_starts_without_measurements():
    assert decide_tau([30.0], 0.15, margin=0.25, start=1, most=4) == 4  # tau < H/P
    assert decide_tau([0.001], 0.15, margin=0.25, start=3, most=9) == 1  # never 0
    assert decide_tau([], 0.15, margin=0.25, start=3, most=9) == 3
    assert decide_tau([0.5], None, margin=0.25, start=2, most=9) == 2


def test_decide_tau_hides_a_high_quantile_not_one_slow_round():
    # 6th of 8: one round of 2 s (a retried request) does not make 8 merges staler
    lat = [0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 2.0]
    assert decide_tau(lat, 0.1, margin=0.0, start=1, most=14) == 3
    assert decide_tau(lat, 0.1, margin=0.0, start=1, most=14, q=1.0) == 14  # the max
    assert decide_tau([0.3, 2.0, 0.3], 0.1, margin=0.0, start=1, most=30) == 20  # few: max


def test_the_lag_behind_the_last_peer_and_the_poll_pause_are_not_sized_into_tau():
    now = [0.0]
    auto = AutoOverlap(stride=15, total_steps=90, start=14, margin=0.0, clock=lambda: now[0])
    assert auto.poll_max(0.05, 0.5) == 0.5  # no step time yet: the configured pause
    for _ in range(3):
        now[0] += 0.1
        auto.stepped(waited_s=0.0)
    auto.arrived(1.0, lag_s=0.7)  # 0.7 s of the 1.0 s waited for the peer's send
    auto.arrived(0.3, lag_s=-0.2)  # this worker sent last: all of it is the link
    assert list(auto.latencies) == pytest.approx([0.3, 0.3])
    assert auto.propose() == 3
    assert auto.poll_max(0.05, 0.5) == pytest.approx(0.1)  # a poll per inner step
    assert auto.poll_max(0.2, 0.5) == 0.2
    assert auto.taus == [14]  # before any measurement: the start


def test_auto_overlap_proposes_from_its_measurements_and_takes_the_agreed_tau():
    now = [0.0]
    auto = AutoOverlap(stride=10, total_steps=40, start=1, margin=0.0, clock=lambda: now[0])
    for waited in (0.0, 0.05, 0.1):  # inner steps of 0.1 s, 0.05 s of it waiting
        now[0] += 0.1
        auto.stepped(waited_s=waited)
    assert auto.step_s() == pytest.approx(0.05)
    assert auto.tau_of(1) == 1  # nothing measured yet
    auto.arrived(0.32)
    assert auto.propose() == 7  # 0.32 / 0.05 = 6.4 -> 7
    auto.merged(1, agreed=None)  # the mean named no proposal: point 1's tau again
    auto.merged(2, agreed=7)
    auto.merged(3, agreed=12)  # clamped to H/P - 1 = 9
    auto.merged(4, agreed=7)
    assert auto.taus == [1, 1, 7, 9, 1]  # point 5 merges at step 50 > 40: the start
    assert auto.current(2) == [1, 9]
    auto.merged(2, agreed=3)  # decided already (a replay): kept
    assert auto.taus[2] == 7
    again = AutoOverlap(stride=10, total_steps=40, start=1, margin=0.0)
    again.load_state_dict(auto.state_dict())
    again.ensure(3)
    assert again.taus == auto.taus and again.propose() == auto.propose()


def test_schedule_with_per_point_taus_sends_each_round_tau_steps_before_its_merge():
    sched = Schedule(6, 2, 1)  # s = 3
    taus = {1: 1, 2: 2, 3: 1, 4: 2}
    got = [(t, e.kind, e.fragment, e.round) for t in range(1, 13)
           for e in sched.events(t, taus.__getitem__)]
    assert got == [
        (2, "send", 0, 0), (3, "merge", 0, 0), (4, "send", 1, 0), (6, "merge", 1, 0),
        (8, "send", 0, 1), (9, "merge", 0, 1), (10, "send", 1, 1), (12, "merge", 1, 1)]
    fixed = Schedule(6, 2, 2)
    for t in range(1, 13):  # a constant lookup is the fixed schedule
        assert fixed.events(t, lambda k: 2) == fixed.events(t)


# -- configuration ------------------------------------------------------------------------
def test_overlap_accepts_auto_and_refuses_what_cannot_use_it():
    cfg = SyncConfig(schedule={"sync_every": 12, "fragments": 2, "overlap": "auto"})
    # overlap_start resolved to H/P - 1 at creation: it fixes the round counts
    assert cfg.schedule.auto and cfg.schedule.overlap_start == cfg.schedule.send_offset == 5
    assert SyncConfig(
        schedule={"sync_every": 12, "fragments": 2, "overlap": "auto", "overlap_start": 2},
    ).schedule.send_offset == 2
    # a --set value arrives as text
    assert SyncConfig(schedule={"overlap": "3"}).schedule.overlap == 3
    cases = [
        (dict(overlap="often"), "must be an integer tau or 'auto'"),
        (dict(mode="diloco", overlap="auto"), "overlap 'auto' needs mode streaming"),
        (dict(mode="eager", overlap="auto"), "needs mode streaming, got mode 'eager'"),
        (dict(overlap="auto", overlap_start=0), "greater than or equal to 1"),
        (dict(sync_every=4, fragments=2, overlap="auto", overlap_start=2),
         "overlap_start must satisfy 1 <= tau < H/P = 2"),
        (dict(overlap="auto", overlap_margin=-0.5), "greater than or equal to 0"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValidationError) as info:
            SyncConfig(schedule=kwargs)
        assert len(info.value.errors()) == 1 and message in str(info.value), kwargs


# -- replicas on a slow link ------------------------------------------------------------
class SlowLink(Exchange):
    """A worker's view in which every mean becomes visible ``delay`` seconds after
    the worker first asks for it (right after its send): a long round trip."""

    def __init__(self, base: Exchange, delay: float):
        super().__init__(base.store, base.manifest)
        self.delay, self.first = delay, {}

    def fetch_mean(self, fragment, round, known=None):
        first = self.first.setdefault((fragment, round), time.monotonic())
        if time.monotonic() - first < self.delay:
            return None
        return super().fetch_mean(fragment, round, known)


FAST_POLL = dict(liveness={"poll_interval_s": 0.005, "poll_max_s": 0.01},
                 membership={"grace_min_s": 0.01})


def _slow_run(overlap, *, delay: float | dict[str, float], step_s: float, steps: int,
              **kw):
    """Two workers, H = 12, P = 2; ``delay``: the round trip, or one per worker."""
    cfg = SyncConfig(schedule={"mode": "streaming", "sync_every": 12, "fragments": 2,
                               "overlap": overlap, "alpha": 0.5}, **FAST_POLL)
    delays = delay if isinstance(delay, dict) else {"w0": delay, "w1": delay}
    return train_replicas(url(), Blocks, data, cfg, total_steps=steps, inner_lr=0.05,
                          before_step=lambda w, s, sync: time.sleep(step_s),
                          wrap_exchange=lambda w, ex: SlowLink(ex, delays[w]), **kw)


def test_auto_overlap_hides_a_slow_exchange_that_tau_1_waits_for():
    """Round trips of ~0.1 s against inner steps of 0.03 s: with tau = 1 every merge
    waits for its mean; with auto the workers start at H/P - 1 = 5, then take the tau
    the link needs (0.08 s * 1.25 / 0.03 s: 4 steps, not more) and stop waiting.
    (The final rounds, sent and merged at the end, wait in both: the training
    steps' waits are compared.)"""
    waited: dict[tuple[int, str], dict[int, float]] = {}

    def record(run):
        return lambda w, step, sync: waited.setdefault((run, w), {}).update(
            {step: sync.stats.wait_seconds})

    one = _slow_run(1, delay=0.08, step_s=0.03, steps=72, on_step=record(1))
    auto = _slow_run("auto", delay=0.08, step_s=0.03, steps=72, on_step=record(0))
    assert auto.traces["w0"].sync.tau.taus == auto.traces["w1"].sync.tau.taus
    for w in ("w0", "w1"):
        fixed, tuned = one.traces[w].sync, auto.traces[w].sync
        assert tuned.tau.taus[:2] == [5, 5]  # overlap_start: H/P - 1
        measured = tuned.tau.taus[2:-1]  # the last point merges past the run's end
        assert measured and all(3 <= t <= 5 for t in measured), tuned.tau.taus
        assert min(measured) < 5, tuned.tau.taus  # sized to the link, not the ceiling
        assert tuned.overlaps == tuned.tau.current(2)
        assert fixed.stats.rounds_merged == tuned.stats.rounds_merged
        # steps 37..72: six merges, each waiting ~0.05 s at tau = 1; with auto at most
        # one of them waits (a loaded machine can delay one mean past its tau)
        stalled_fixed, stalled_tuned = _stalled(waited[(1, w)]), _stalled(waited[(0, w)])
        assert len(stalled_fixed) >= 4, (stalled_fixed, fixed.stats.waits)
        assert len(stalled_tuned) <= 1, (stalled_tuned, tuned.stats.waits, tuned.tau.taus)
        late_fixed = waited[(1, w)][72] - waited[(1, w)][36]
        late_tuned = waited[(0, w)][72] - waited[(0, w)][36]
        assert late_tuned < 0.5 * late_fixed, (tuned.stats.waits, tuned.tau.taus)


def _stalled(waited: dict[int, float], first: int = 37, last: int = 72) -> list[int]:
    """The steps in first..last whose merge waited more than 0.02 s for its mean."""
    return [s for s in range(first, last + 1) if waited[s] - waited[s - 1] > 0.02]


def test_workers_with_different_links_agree_on_the_largest_proposal():
    """w0's round trip is 0.15 s, w1's 0.02 s: each proposes its own tau in its
    contribution's commit, and after every merge point both take the largest
    proposal the mean counted, so they decide alike and send together."""
    res = _slow_run("auto", delay={"w0": 0.15, "w1": 0.02}, step_s=0.03, steps=48)
    taus = [res.traces[w].sync.tau.taus for w in ("w0", "w1")]
    assert taus[0] == taus[1] and max(taus[0]) >= 4, taus  # 0.15 / 0.03 = 5 steps
    ex = res.aggregator.exchange
    proposals = []
    for k in range(1, 48 // 6):  # merge point k decides point k + 1
        p, r = (k - 1) % 2, (k - 1) // 2
        got = {w: ex.delta_commit(p, r, w)["tau_next"] for w in ("w0", "w1")}
        proposals.append(got)
        assert taus[0][k] == max(got.values()), (k, got, taus[0])
        sends = {ex.delta_commit(p, r, w)["step"] for w in ("w0", "w1")}
        assert sends == {6 * k - taus[0][k - 1]}  # the same step for both
    assert any(a["w0"] != a["w1"] for a in proposals), proposals  # they did differ


def test_a_slower_peer_does_not_make_tau_grow_to_the_ceiling():
    """w1's inner steps take twice w0's: w0 runs ahead, and its mean comes when w1
    has sent too, a lag of ~0.2 s a round on top of the 0.05 s link. No tau hides a
    peer that is slower (w0 waits whatever tau is), so the lag is left out and tau
    covers the link: 0.05 s * 1.25 over w0's 0.03 s steps, 3 steps, far below
    H/P - 1 = 11, where the lag (about 7 steps more) would take it. The margin is wide
    on purpose: a loaded machine stretches every latency a little."""
    cfg = SyncConfig(schedule={"mode": "streaming", "sync_every": 24, "fragments": 2,
                               "overlap": "auto", "overlap_start": 1, "alpha": 0.5},
                     **FAST_POLL)
    pace = {"w0": 0.03, "w1": 0.06}
    res = train_replicas(url(), Blocks, data, cfg, total_steps=96, inner_lr=0.05,
                         before_step=lambda w, s, sync: time.sleep(pace[w]),
                         wrap_exchange=lambda w, ex: SlowLink(ex, 0.05))
    taus = res.traces["w0"].sync.tau.taus
    assert taus == res.traces["w1"].sync.tau.taus
    measured = sorted(taus[2:-1])  # (the last point merges past the run's end)
    assert measured[len(measured) // 2] <= 6, taus


def test_a_resumed_worker_replays_its_decided_taus_and_ends_bit_exact():
    """Latency far beyond H/P steps pins every measured decision to H/P - 1, so two
    runs decide alike; w0 restarts at step 15, a round sent with tau = 5 in flight
    (fragment 0 round 1 merges at 18), w1 at 20. The resumed run keeps the decisions
    taken before each restart and ends on the same outer state, bit for bit."""
    seen: dict[str, list[int]] = {}

    def record(worker, step, sync):
        if step == {"w0": 15, "w1": 20}[worker]:
            seen[worker] = list(sync.tau.taus)

    plain = _slow_run("auto", delay=0.3, step_s=0.0, steps=36)
    resumed = _slow_run("auto", delay=0.3, step_s=0.0, steps=36, on_step=record,
                        restart_at={"w0": 15, "w1": 20})
    for w in ("w0", "w1"):
        sync = resumed.traces[w].sync
        assert sync.tau.taus[: len(seen[w])] == seen[w]
        assert 5 in seen[w]
        assert sync.tau.taus == plain.traces[w].sync.tau.taus
        assert plain.traces[w].losses == resumed.traces[w].losses
        for p in range(2):
            assert torch.equal(sync.outer_params(p), plain.traces[w].sync.outer_params(p))


# -- the worker: status, metrics, a crash and resume --------------------------------------
@pytest.fixture(scope="module")
def dataset() -> str:
    from workers.data.prepare import prepare_data  # noqa: PLC0415

    url = f"memory://datasets/overlap-{uuid.uuid4().hex[:8]}"
    prepare_data(["builtin:shakespeare"], url, max_bytes=100_000)
    return url


def test_a_worker_reports_its_taus_and_resumes_a_crash_with_overlap_auto(dataset):
    """The worker's status carries ``tau`` per fragment and its metric reports
    ``tau/f0``, ``tau/f1`` (what MLflow logs); a worker that crashed at step 14
    resumes from its checkpoint of step 8 and finishes the run."""
    from test_worker import Run, config  # noqa: PLC0415

    from storage.objectstore import ObjectStore  # noqa: PLC0415
    from workers.status import read_status  # noqa: PLC0415

    reported: list[dict] = []

    class Watched(Run):
        def metrics(self, m):
            super().metrics(m)
            reported.append(m)

    run = Watched(config(dataset, "train.steps=24", "train.checkpoint_every=8",
                         "sync.schedule.overlap=auto", "sync.membership.quorum=1.0"))
    results = run.train(crash={"region-b": 14})
    assert results["region-b"].resumed_from == 8
    for w in run.cfg.workers:
        assert results[w].steps == 24
        taus = read_status(ObjectStore(run.url), w)["tau"]
        assert len(taus) == 2 and all(1 <= t <= 3 for t in taus)  # H/P - 1 = 3
        mine = [m for m in reported if m.get("worker") == w and "tau/f0" in m]
        assert mine and all(1 <= m["tau/f0"] <= 3 and 1 <= m["tau/f1"] <= 3 for m in mine)
    assert run.aggregator.done
