"""Elastic membership in process: a worker joins a running run, one leaves, one is
slow past its lease; every contribution ends in exactly one outcome (the audit)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from test_trust import make_run, vec

from diloco.aggregator import Aggregator
from diloco.audit import audit
from diloco.config import SyncConfig
from diloco.membership import MembershipError, request_leave
from diloco.run import open_run
from storage import layout
from storage.objectstore import ObjectStore
from workers.config import load_config
from workers.data.prepare import prepare_data
from workers.elastic import last_sent
from workers.loop import WorkerLoop
from workers.runs import create_run

# No periodic worker checkpoint (a torch distributed checkpoint every 4 steps, most of
# a worker's CPU here): no test starts a worker again, and a joiner takes the canonical
# state, not a checkpoint.
MICRO = [
    "model.overrides={d_model: 32, n_layers: 2, n_heads: 2, max_seq_len: 64}",
    "data.seq_len=16", "data.batch_size=4", "optim.warmup_steps=2", "optim.lr=0.01",
    "train.eval_every=0", "train.eval_batches=1", "train.log_every=1",
    "train.checkpoint_every=0", "sync.schedule.sync_every=4", "sync.schedule.fragments=2", "sync.schedule.overlap=1",
    "sync.liveness.poll_max_s=0.05", "sync.membership.grace_min_s=0.05", "sync.membership.grace_max_s=2",
    "sync.liveness.lease_s=3",
]

_DATASET = f"memory://datasets/elastic-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def dataset() -> str:
    prepare_data(["builtin:shakespeare"], _DATASET, max_bytes=120_000)
    return _DATASET


class Run:
    """A run whose aggregator runs in a thread; workers are started on demand."""

    def __init__(self, dataset: str, *extra: str, url: str | None = None):
        self.cfg = load_config("tiny", [*MICRO, f"data.dataset={dataset}", *extra])
        self.url = url or f"memory://elastic/{uuid.uuid4().hex}"
        create_run(self.cfg, self.url)
        self.stop = threading.Event()
        self.aggregator = Aggregator(open_run(self.url), slots=self.cfg.data.slot_count(
            len(self.cfg.workers)))
        self.agg = threading.Thread(target=self.aggregator.run, args=(self.stop, 300))
        self.agg.start()
        self.results: dict[str, object] = {}
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        self.steps: dict[str, int] = {}

    def start(self, worker: str, *, join: bool = False, slow_s: float = 0.0,
              stop: threading.Event | None = None) -> threading.Thread:
        def metrics(m):
            if "loss" in m:
                self.steps[worker] = m["step"]
                if slow_s:
                    time.sleep(slow_s)

        def work():
            try:
                loop = WorkerLoop.open(self.url, worker, join=join, metrics=metrics, stop=stop)
                try:
                    self.results[worker] = loop.run()
                finally:
                    loop.close()
            except BaseException as exc:  # surfaced by the test
                self.errors.append(exc)

        t = threading.Thread(target=work, name=worker)
        t.start()
        self.threads.append(t)
        return t

    def wait(self, timeout: float = 240) -> None:
        for t in self.threads:
            t.join(timeout)
        self.agg.join(timeout)
        self.stop.set()
        if self.errors:
            raise self.errors[0]

    def until(self, worker: str, step: int, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while self.steps.get(worker, 0) < step:
            assert time.monotonic() < end, f"{worker} never reached step {step}"
            time.sleep(0.02)


def _clean(report: dict) -> None:
    assert report["lost"] == [] and report["double"] == [], report
    assert report["pending"] == 0, report


def test_a_worker_joins_midway_and_its_rounds_are_applied(dataset):
    run = Run(dataset, "train.steps=48")
    for w in run.cfg.workers:
        run.start(w)
    run.until("region-a", 16)
    run.start("region-c", join=True)
    run.wait()
    assert run.aggregator.done
    joined = run.results["region-c"]
    assert joined.state == "finished" and joined.steps == 48
    ex = open_run(run.url)
    admission = ex.store.get(layout.admission("region-c"))
    assert b'"slot": 2' in admission  # the first free data slot after the two workers
    report = audit(ex)
    _clean(report)
    took_part = [r for p in range(2) for r in range(ex.manifest.rounds[p])
                 for key in (ex.mean_commit(p, r) or {}).get("weights", {})
                 if key.split("@")[0] == "region-c"]
    assert took_part, "the joiner's contributions were never applied (on time or late)"


def test_a_leaver_finishes_its_round_and_no_one_waits_for_it(dataset):
    run = Run(dataset, "train.steps=32", "sync.membership.quorum=1.0", "sync.membership.grace_s=30")
    for w in run.cfg.workers:
        run.start(w)
    run.until("region-b", 10)
    store = ObjectStore(run.url)
    assert request_leave(store, "region-b")
    t0 = time.monotonic()
    run.wait()
    assert time.monotonic() - t0 < 60  # quorum 1.0 and 30 s of grace: no wait for it
    assert run.results["region-b"].state == "left"
    ex = open_run(run.url)
    left = ex.store.get(layout.left("region-b"))
    assert b"last_rounds" in left
    report = audit(ex)
    _clean(report)
    assert report["applied_late"] == 0 and report["dropped_stale"] == 0


def test_a_name_already_taken_is_refused_and_nothing_is_written(dataset):
    run = Run(dataset, "train.steps=8")
    with pytest.raises(MembershipError, match="taken"):
        WorkerLoop.open(run.url, "region-a", join=True)
    run.stop.set()
    run.agg.join(10)


@pytest.fixture(scope="module")
def uneven(dataset) -> Run:
    """A finished run where region-b trains with half the batch (a smaller GPU)."""
    run = Run(dataset, "train.steps=16", "sync.membership.quorum=1.0",
              "data.worker_batch_size={region-b: 2}")
    for w in run.cfg.workers:
        run.start(w)
    run.wait()
    return run


def test_joining_a_finished_run_is_refused_and_nothing_is_written(uneven):
    run = uneven  # any finished run
    store = ObjectStore(run.url)
    before = sorted(store.list(""))
    with pytest.raises(MembershipError, match="finished"):
        WorkerLoop.open(run.url, "region-z", join=True)
    assert sorted(store.list("")) == before


def test_heterogeneous_batches_are_weighted_by_tokens(uneven):
    """region-b trains with half the batch (a smaller GPU): in every round both
    arrive in, its weight is a third, region-a's two thirds."""
    run = uneven
    ex = open_run(run.url)
    both = [c["weights"] for p in range(2) for r in range(ex.manifest.rounds[p])
            if set((c := ex.mean_commit(p, r))["weights"]) == {"region-a", "region-b"}]
    assert both
    for weights in both:
        assert weights["region-b"] == pytest.approx(1 / 3)
        assert weights["region-a"] == pytest.approx(2 / 3)
    assert run.results["region-b"].tokens * 2 == run.results["region-a"].tokens


def test_the_grace_window_follows_the_spread_and_is_capped_by_the_pace():
    """No history: the first round's own pace bounds the window (5% of it, never
    below grace_min_s); complete rounds' spreads set it (3 x their 90th percentile);
    the pace caps it so a straggler costs the others little; grace_s fixes it."""
    from diloco.config import SyncConfig  # noqa: PLC0415
    from diloco.grace import Grace  # noqa: PLC0415

    cfg = SyncConfig(
        schedule={"sync_every": 4, "fragments": 2, "overlap": 1},
        membership={"grace_min_s": 0.1, "grace_max_s": 30},
    )
    g = Grace(cfg)
    assert g.seconds() == 30  # nothing known yet
    assert g.seconds(quorum_at=105.0, previous_mean_at=100.0) == pytest.approx(0.5)  # 5% of 10 s
    for t in range(8):  # rounds of 10 s (5 s between merge points, P = 2), 0.2 s spread
        g.observe(quorum_at=100.0 + 5 * t + 5, last_arrival=100.0 + 5 * t + 5.2,
                  complete=True, previous_mean_at=100.0 + 5 * t)
    assert g.seconds() == pytest.approx(0.5)  # 3 x 0.2 = 0.6, capped at 5% of 10 s
    slow = Grace(cfg)
    for t in range(8):  # rounds reduced without someone: no spread sample, only the pace
        slow.observe(quorum_at=10.0 * t + 10, last_arrival=10.0 * t + 10, complete=False,
                     previous_mean_at=10.0 * t)
    assert slow.seconds() == pytest.approx(1.0)  # 5% of 20 s
    fast = Grace(cfg)
    fast.observe(quorum_at=1.0, last_arrival=1.01, complete=True, previous_mean_at=0.0)
    assert fast.seconds() == pytest.approx(0.1)  # 3 x 0.01 is below grace_min_s
    assert Grace(cfg.changed(membership={"grace_s": 7.0})).seconds() == 7.0


def test_a_fault_free_run_with_jitter_equals_the_strict_run(dataset):
    """region-b is held up for 1.5 s at several steps (a busy machine), far past the
    grace window (at most 2 s, adaptively much less), but it keeps progressing: at
    the default quorum every round still waits for it, so the canonical model equals
    the quorum 1.0 run's bit for bit, with nothing late or dropped. (A lease of 30 s:
    the harness's 3 s would make 3 s without a step a lapse of progress.)"""
    import torch  # noqa: PLC0415

    strict = Run(dataset, "train.steps=16", "sync.liveness.lease_s=30", "sync.membership.quorum=1.0")
    for w in strict.cfg.workers:
        strict.start(w)
    strict.wait()
    run = Run(dataset, "train.steps=16", "sync.liveness.lease_s=30")
    run.start("region-a")

    def held_up(m):  # region-b's metrics callback runs in its loop: its step stalls
        if "loss" in m and m["step"] in {3, 6, 7, 11}:
            time.sleep(1.5)

    def work():
        try:
            loop = WorkerLoop.open(run.url, "region-b", metrics=held_up)
            try:
                run.results["region-b"] = loop.run()
            finally:
                loop.close()
        except BaseException as exc:  # surfaced by run.wait
            run.errors.append(exc)

    t = threading.Thread(target=work, name="region-b")
    t.start()
    run.threads.append(t)
    run.wait()
    for p in range(2):
        assert torch.equal(strict.aggregator.canonical(p), run.aggregator.canonical(p))
    report = audit(open_run(run.url))
    _clean(report)
    assert report["applied_late"] == 0 and report["dropped_stale"] == 0
    assert run.aggregator.stats.late == 0 and strict.aggregator.stats.late == 0


def test_a_leave_check_the_store_keeps_failing_does_not_stop_training(caplog):
    """A worker reads ``control/leave/<name>.json`` at its merges; when the store keeps
    failing that read (a flaky S3), it trains on and reads again at the next merge
    (the campaign's flaky-S3 trial once ended a worker with exit 2 here)."""
    import types  # noqa: PLC0415

    from storage.errors import TransientStoreError  # noqa: PLC0415
    from workers import elastic  # noqa: PLC0415

    class Down:
        def exists(self, key: str) -> bool:
            raise TransientStoreError(f"exists {key} failed after 6 attempts")

    loop = types.SimpleNamespace(store=Down(), worker="w0")
    with caplog.at_level("WARNING", logger="workers.elastic"):
        assert elastic.asked_to_leave(loop) is False
    assert "read again at the next merge" in caplog.text


def test_a_leave_record_names_the_rounds_committed_before_a_crash():
    """A worker killed after its leave request resumes from an older checkpoint and
    leaves at once: its synchroniser has sent less than the store holds. The record
    names the newest round committed per fragment, so no mean that holds its
    contribution comes after the round it says it left after."""
    cfg = SyncConfig(schedule={"mode": "streaming", "sync_every": 4, "fragments": 2})
    _, ex = make_run(cfg, steps=16)
    for r in range(3):  # fragment 0: rounds 0..2 committed; fragment 1: round 0 only
        ex.publish_delta(0, r, "w0", vec(ex, 0.1, 0), tokens=10)
    ex.publish_delta(1, 0, "w0", vec(ex, 0.1, 1), tokens=10)
    ex.publish_delta(1, 2, "w0", vec(ex, 0.1, 1), tokens=10)  # a gap: not contiguous
    assert last_sent(ex, "w0", [0, 0]) == [2, 0]
    assert last_sent(ex, "w0", [-1, -1]) == [2, 0]
    assert last_sent(ex, "w1", [-1, 1]) == [-1, 1]  # nothing of w1's in the store
    assert last_sent(ex, "w0", [3, 3]) == [3, 3]  # what it sent stands
