"""The synchroniser and the aggregator together: bit-exact agreement of outer
state, eager rules, rejection of bad contributions, racing and restarted
aggregators. Replicas and aggregators run as threads on memory:// stores."""

from __future__ import annotations

import uuid

import pytest
import torch

from diloco.config import SyncConfig
from replicas import Blocks, data, train_replicas
from storage.exchange import Exchange


def url() -> str:
    return f"memory://sync/{uuid.uuid4().hex}"


def _merges(cfg: SyncConfig, step: int) -> list[tuple[int, int]]:
    from diloco.schedule import Schedule  # noqa: PLC0415

    sched = Schedule.of(cfg.schedule)
    return [(e.fragment, e.round) for e in sched.events(step) if e.kind == "merge"]


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
def test_non_eager_workers_hold_canonical_state_bit_for_bit(codec):
    """Streaming (P = 2, tau = 1, alpha = 0.5): after every merge, each worker's outer
    parameters and momentum equal the aggregator's checkpoint of that round, bit for
    bit; after finish() the live model equals the canonical model."""
    cfg = SyncConfig(
        schedule={"mode": "streaming", "sync_every": 4, "fragments": 2, "overlap": 1, "alpha": 0.5},
        codec={"up": codec, "down": codec, "block_size": 32},
    )
    seen: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def record(worker, step, sync):
        for p, r in _merges(cfg, step):
            seen[(worker, p, r)] = (sync.outer_params(p).clone(),
                                    sync.outer_momentum(p).clone())

    res = train_replicas(url(), Blocks, data, cfg, total_steps=14, on_step=record,
                         inner_lr=0.05)
    from storage.checkpoints import read_checkpoint  # noqa: PLC0415

    ex = res.aggregator.exchange
    # s = H/P = 2: merges at t = 2, 4, ..., 14, fragment 0 at 2, 6, 10, 14 (rounds 0-3),
    # fragment 1 at 4, 8, 12 (rounds 0-2): 7 merges per worker, 2 workers.
    assert len(seen) == 2 * 7
    for (worker, p, r), (params, momentum) in seen.items():
        arrays, _ = read_checkpoint(ex.store, f"global/frag/{p}/r{r:06d}.json")
        assert torch.equal(params, torch.from_numpy(arrays["params"])), (worker, p, r)
        assert torch.equal(momentum, torch.from_numpy(arrays["momentum"])), (worker, p, r)
    for trace in res.traces.values():
        for p in range(2):
            assert torch.equal(trace.sync.outer_params(p), res.aggregator.canonical(p))
            assert torch.equal(trace.sync.outer_momentum(p), res.aggregator.momentum(p))
            live = trace.sync.plan.gather(trace.model, p)
            assert torch.equal(live, res.aggregator.canonical(p))


@pytest.mark.parametrize("rule", ["pure", "adaptive"])
def test_one_worker_eager_equals_blocking(rule):
    """M = 1, codec none: eager updates (alpha 0) equal blocking DiLoCo, step by step,
    bit for bit (docs/algorithms.md section 6)."""
    h, outer = {"sync_every": 3, "fragments": 1}, {"lr": 0.7, "momentum": 0.9}
    blocking = train_replicas(url(), Blocks, data,
                              SyncConfig(schedule={"mode": "diloco", **h}, outer=outer),
                              workers=("w0",), total_steps=12)
    eager = SyncConfig(schedule={"mode": "eager", "eager_rule": rule, "alpha": 0.0, **h},
                       outer=outer)
    eager = train_replicas(url(), Blocks, data, eager, workers=("w0",), total_steps=12)
    b, e = blocking.traces["w0"], eager.traces["w0"]
    assert b.losses == e.losses
    for pb, pe in zip(b.params, e.params, strict=True):
        for name in pb:
            assert torch.equal(pb[name], pe[name]), name


class HiddenMeans(Exchange):
    """A worker's view of the store in which a mean stays invisible until the test
    releases it: a slow link, made deterministic."""

    def __init__(self, base: Exchange, released: set[tuple[int, int]]):
        super().__init__(base.store, base.manifest)
        self.released = released

    def fetch_mean(self, fragment, round):
        if (fragment, round) not in self.released:
            return None
        return super().fetch_mean(fragment, round)


def _eager_run(cfg: SyncConfig, late: set[tuple[int, int]], total_steps: int = 16,
               restart_at: dict[str, int] | None = None,
               waits_in_training: dict[str, list[float]] | None = None):
    """Two workers. A mean in ``late`` reaches a worker one round late (released after
    the worker's merge of that round, awaited before its next merge of the fragment);
    every other mean is awaited before its merge (on time). ``waits_in_training``
    receives each worker's ``stats.waits`` after its last step, before finish()."""
    views: dict[str, HiddenMeans] = {}
    released: dict[str, set] = {"w0": set(), "w1": set()}

    def wrap(worker, ex):
        views[worker] = HiddenMeans(ex, released[worker])
        return views[worker]

    def before(worker, step, sync):
        view = views[worker]
        for p, r in _merges(cfg, step):
            if (p, r) not in late:  # on time: visible and fetched before the merge
                view.released.add((p, r))
                assert sync.mean_arrived(p, r, timeout=30)
            if (p, r - 1) in late:  # one round late: here by the next merge
                view.released.add((p, r - 1))
                assert sync.mean_arrived(p, r - 1, timeout=30)

    def after(worker, step, sync):
        for p, r in _merges(cfg, step):
            if (p, r) in late:
                views[worker].released.add((p, r))

    def release_all(worker, step, sync):
        after(worker, step, sync)
        if step == total_steps:
            if waits_in_training is not None:
                waits_in_training[worker] = list(sync.stats.waits)
            views[worker].released.update(
                (p, r) for p in range(cfg.schedule.fragments) for r in range(100))

    return train_replicas(url(), Blocks, data, cfg, total_steps=total_steps,
                          wrap_exchange=wrap, before_step=before, on_step=release_all,
                          inner_lr=0.05, restart_at=restart_at)


EAGER_HP = {"sync_every": 4, "fragments": 2}
EAGER_OUTER = {"lr": 0.7, "momentum": 0.5}


def _eager(**schedule) -> SyncConfig:
    """H = 4, P = 2, eta 0.7, mu 0.5 with the given schedule fields."""
    return SyncConfig(schedule={**EAGER_HP, **schedule}, outer=EAGER_OUTER)


def _outer(res, worker, fragments=2):
    return torch.cat([res.traces[worker].sync.outer_params(p) for p in range(fragments)])


def test_adaptive_eager_all_on_time_equals_streaming():
    streaming = train_replicas(url(), Blocks, data,
                               _eager(mode="streaming", overlap=1, alpha=0.5),
                               total_steps=16, inner_lr=0.05)
    adaptive = _eager_run(_eager(mode="eager", overlap=1, alpha=0.5), late=set())
    for w in ("w0", "w1"):
        assert streaming.traces[w].losses == adaptive.traces[w].losses
        assert torch.equal(_outer(streaming, w), _outer(adaptive, w))
        assert adaptive.traces[w].sync.stats.late_means == 0


def test_adaptive_eager_all_late_equals_pure_eager():
    """Every mean one round late: the adaptive rule is the paper's eager rule."""
    late = {(p, r) for p in range(2) for r in range(10)}
    pure = _eager_run(_eager(mode="eager", eager_rule="pure"), late=late)
    adaptive = _eager_run(_eager(mode="eager", alpha=0.0), late=late)
    for w in ("w0", "w1"):
        assert adaptive.traces[w].sync.stats.late_means > 0
        torch.testing.assert_close(torch.tensor(pure.traces[w].losses),
                                   torch.tensor(adaptive.traces[w].losses),
                                   rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(_outer(pure, w), _outer(adaptive, w), rtol=1e-6, atol=1e-7)


def test_adaptive_eager_applies_every_contribution_once():
    """Half the means late, outer momentum 0: after the last means arrive, every
    worker's outer parameters moved by exactly -lr * (sum of all means), like the
    canonical model: each contribution was applied once, none twice or never."""
    cfg = SyncConfig(
        schedule={"mode": "eager", "overlap": 1, "alpha": 0.5, "sync_every": 4, "fragments": 2},
        outer={"lr": 0.7, "momentum": 0.0},
    )
    late = {(0, 0), (1, 1), (0, 2), (1, 3)}
    waits: dict[str, list[float]] = {}
    res = _eager_run(cfg, late=late, waits_in_training=waits)
    canonical = torch.cat([res.aggregator.canonical(p) for p in range(2)])
    for w in ("w0", "w1"):
        stats = res.traces[w].sync.stats
        assert stats.late_means == len(late)
        # 16 steps, s = 2: 8 merges, none waited (eager); only finish() may wait for
        # the last means, and wait_seconds is the sum of the waits counted
        # merges at t = 2, 4, ..., 16 plus a final round per fragment (alpha > 0)
        assert stats.rounds_merged == 8 + 2
        assert waits[w] == []
        assert stats.wait_seconds == pytest.approx(sum(stats.waits))
        torch.testing.assert_close(_outer(res, w), canonical, rtol=1e-5, atol=1e-6)


def test_naive_delayed_is_the_canonical_trajectory_one_round_late():
    """eager_rule naive, outer momentum on: at every merge of round r >= 1 each worker's
    outer parameters and momentum are the aggregator's state after round r - 1, bit
    for bit (it applied mean^(r-1) and nothing of round r); round 0 takes no step.
    The two workers agree bit for bit, and after finish() every mean was applied once,
    each as its own outer step: the live model and momentum are the canonical ones."""
    from diloco.run import load_initial  # noqa: PLC0415
    from storage.checkpoints import read_checkpoint  # noqa: PLC0415

    cfg = _eager(mode="eager", eager_rule="naive")
    seen: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def record(worker, step, sync):
        for p, r in _merges(cfg, step):
            momentum = sync.outer_momentum(p)
            seen[(worker, p, r)] = (sync.outer_params(p).clone(),
                                    None if momentum is None else momentum.clone())

    res = train_replicas(url(), Blocks, data, cfg, total_steps=16, on_step=record,
                         inner_lr=0.05)
    ex = res.aggregator.exchange
    initial = load_initial(ex, 2)
    assert len(seen) == 2 * 8
    for (worker, p, r), (params, momentum) in seen.items():
        if r == 0:  # nothing to apply yet: no step, no momentum
            assert momentum is None or not momentum.any(), (worker, p)
            continue
        arrays, _ = read_checkpoint(ex.store, f"global/frag/{p}/r{r - 1:06d}.json")
        assert torch.equal(params, torch.from_numpy(arrays["params"])), (worker, p, r)
        assert torch.equal(momentum, torch.from_numpy(arrays["momentum"])), (worker, p, r)
        assert torch.equal(params, seen[("w1" if worker == "w0" else "w0", p, r)][0])
    for w in ("w0", "w1"):
        # rounds 1-3 of each fragment, fragment 0's round 3 with its final round 4
        assert res.traces[w].sync.stats.staleness.count(1) == 7
        for p in range(2):
            live = res.traces[w].sync.plan.gather(res.traces[w].model, p)
            assert torch.equal(live, res.aggregator.canonical(p))
            assert torch.equal(res.traces[w].sync.outer_momentum(p), res.aggregator.momentum(p))
            assert not torch.equal(live, initial[p])


def test_naive_delayed_trails_blocking_diloco_by_a_round():
    """M = 1, codec none: naive delayed is not blocking DiLoCo (a round's work lands
    one round late, the worker restarting from the stale outer value), which pure
    eager equals in this setting: the rule the eager paper measures as worse."""
    h, outer = {"sync_every": 3, "fragments": 1}, {"lr": 0.7, "momentum": 0.9}
    blocking = train_replicas(url(), Blocks, data,
                              SyncConfig(schedule={"mode": "diloco", **h}, outer=outer),
                              workers=("w0",), total_steps=12)
    naive = train_replicas(url(), Blocks, data,
                           SyncConfig(schedule={"mode": "eager", "eager_rule": "naive", **h},
                                      outer=outer),
                           workers=("w0",), total_steps=12)
    b, n = blocking.traces["w0"].losses, naive.traces["w0"].losses
    assert b[:3] == n[:3]  # the first round trains from the same start
    assert b[3:6] != n[3:6]  # after round 0's merge: blocking moved, naive restarted


_INT4_UP = {"up": "int4", "down": "int8", "block_size": 32}
RESUMES = {
    # step 5 is fragment 0's send of round 1 (s = 2, tau = 1): in flight at the restart
    "streaming": (SyncConfig(schedule={"mode": "streaming", "sync_every": 4, "fragments": 2,
                                       "overlap": 1, "alpha": 0.5}, codec=_INT4_UP),
                  {"w0": 5, "w1": 8}),
    # naive delayed: the previous round's mean is owed (merged at step 2, applied at 6)
    "naive-delayed": (SyncConfig(schedule={**EAGER_HP, "mode": "eager", "eager_rule": "naive"},
                                 outer=EAGER_OUTER, codec=_INT4_UP),
                      {"w0": 3, "w1": 9}),
}


@pytest.mark.parametrize("name", list(RESUMES))
def test_synchronizer_resumes_exactly_from_its_state_dict(name):
    """A worker restarted from state_dict() mid-run (a fragment in flight; for naive
    delayed, a mean still owed) continues exactly as if it had not stopped: what was
    owed is applied once, as before."""
    cfg, restart_at = RESUMES[name]
    plain = train_replicas(url(), Blocks, data, cfg, total_steps=14, inner_lr=0.05)
    resumed = train_replicas(url(), Blocks, data, cfg, total_steps=14, inner_lr=0.05,
                             restart_at=restart_at)
    for w in ("w0", "w1"):
        assert plain.traces[w].losses == resumed.traces[w].losses
        assert torch.equal(_outer(plain, w), _outer(resumed, w))


def test_eager_synchronizer_resumes_exactly_with_late_means_pending():
    """Adaptive eager with late means: restarted while a late mean's correction is
    still owed, the worker applies it once after the resume, exactly as before."""
    cfg = SyncConfig(schedule={**EAGER_HP, "mode": "eager", "overlap": 1, "alpha": 0.5},
                     outer=EAGER_OUTER, codec={"up": "int4", "down": "int8", "block_size": 32})
    late = {(0, 0), (1, 1), (0, 2)}
    plain = _eager_run(cfg, late)
    # w0 restarts at step 3: fragment 0's round 0 merged with its mean still owed,
    # fragment 1's round 0 in flight; w1 at step 10.
    resumed = _eager_run(cfg, late, restart_at={"w0": 3, "w1": 10})
    for w in ("w0", "w1"):
        assert plain.traces[w].losses == resumed.traces[w].losses
        assert torch.equal(_outer(plain, w), _outer(resumed, w))
        assert resumed.traces[w].sync.stats.late_means == len(late)


def _lonely_worker(stop, patience: float, steps: int = 1):
    """w0 of a two-worker run (H = 2, 4 steps), with no w1 and no aggregator: its
    first merge waits for a mean that never comes unless the test publishes one.
    After step 1, a thread runs ``steps`` more steps (the merge of round 0 at step 2,
    of round 1 at step 4)."""
    import threading  # noqa: PLC0415

    from diloco.run import new_run, open_run, plan_for  # noqa: PLC0415
    from diloco.synchronizer import Synchronizer  # noqa: PLC0415
    from storage.objectstore import ObjectStore  # noqa: PLC0415

    cfg = SyncConfig(schedule={"mode": "diloco", "sync_every": 2, "fragments": 1})
    u = url()
    model = Blocks()
    new_run(ObjectStore(u), model, cfg, workers=["w0", "w1"], total_steps=4)
    ex = open_run(ObjectStore(u, name="w0"))
    sync = Synchronizer(model, ex, "w0", plan_for(model, cfg), stop=stop,
                        stop_patience_s=patience)
    sync.step(1)
    outcome: dict = {}

    def second_step():  # the merge of round 0: blocks on the mean
        try:
            for _ in range(steps):
                sync.step(1)
            outcome["merged"] = True
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome["error"] = exc

    t = threading.Thread(target=second_step, daemon=True)
    t.start()
    return sync, t, outcome, u


def _wait_until(cond, timeout=20.0):
    import time  # noqa: PLC0415

    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_a_merge_blocked_on_a_mean_gives_up_after_the_stop_patience():
    """Asked to stop while its merge waits for a mean nobody will reduce, the worker
    waits ``stop_patience_s`` more and then raises MergeAbandoned naming the round;
    the outer parameters are untouched (nothing half-applied)."""
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    from diloco.synchronizer import MergeAbandoned  # noqa: PLC0415

    stop = threading.Event()
    sync, t, outcome, _ = _lonely_worker(stop, patience=0.5)
    try:
        _wait_until(lambda: sync.waiting_for == (0, 0))
        before = sync.outer_params(0).clone()
        time.sleep(0.6)
        assert t.is_alive(), "without a stop request the merge keeps waiting"
        stop.set()
        started = time.monotonic()
        t.join(10)
        assert not t.is_alive()  # it gave up (a hang would fail here)
        assert time.monotonic() - started >= 0.4  # not before the patience (0.5 s) ran out
        exc = outcome["error"]
        assert isinstance(exc, MergeAbandoned)
        assert exc.waited >= 0.6 + 0.5  # the wait before the stop, then the patience
        assert (exc.fragment, exc.round) == (0, 0) and "fragment 0 round 0" in str(exc)
        assert sync.waiting_for is None
        assert torch.equal(sync.outer_params(0), before)
    finally:
        sync.close()


def test_a_mean_arriving_within_the_stop_patience_is_merged():
    """The stop request comes, but the mean arrives within the patience: the merge
    completes normally, so a worker whose peers are still running stops cleanly at the
    next step boundary."""
    import threading  # noqa: PLC0415

    from diloco.aggregator import Aggregator  # noqa: PLC0415
    from diloco.run import open_run  # noqa: PLC0415
    from storage.objectstore import ObjectStore  # noqa: PLC0415

    stop = threading.Event()
    sync, t, outcome, u = _lonely_worker(stop, patience=30.0)
    try:
        _wait_until(lambda: sync.waiting_for == (0, 0))
        stop.set()
        # w1 contributes a zero delta and an aggregator reduces the round
        ex1 = open_run(ObjectStore(u, name="w1"))
        ex1.publish_delta(0, 0, "w1", torch.zeros_like(sync.outer_params(0)).numpy(),
                          tokens=1)
        agg = Aggregator(open_run(ObjectStore(u, name="agg")))
        _wait_until(lambda: agg.poll_once() or sync.waiting_for is None, timeout=30)
        t.join(30)
        assert outcome == {"merged": True}
        assert sync.stats.rounds_merged == 1
    finally:
        sync.close()


def test_a_blocking_merge_waits_as_long_as_its_mean_is_late():
    """Blocking DiLoCo, merges of rounds 0 and 1 at steps 2 and 4: the test withholds
    each round's mean for 0.5 s after the merge starts waiting for it, so each merge
    counts exactly one wait, of at least 0.5 s, and wait_seconds is their sum."""
    import time  # noqa: PLC0415

    from diloco.aggregator import Aggregator  # noqa: PLC0415
    from diloco.run import open_run  # noqa: PLC0415
    from storage.objectstore import ObjectStore  # noqa: PLC0415

    late_by = 0.5
    sync, t, outcome, u = _lonely_worker(None, patience=10.0, steps=3)
    try:
        ex1 = open_run(ObjectStore(u, name="w1"))
        agg = Aggregator(open_run(ObjectStore(u, name="agg")))
        zeros = torch.zeros_like(sync.outer_params(0)).numpy()
        for r in (0, 1):
            _wait_until(lambda r=r: sync.waiting_for == (0, r))
            time.sleep(late_by)
            ex1.publish_delta(0, r, "w1", zeros, tokens=1)
            _wait_until(lambda r=r: agg.poll_once() or sync.waiting_for != (0, r), timeout=30)
        t.join(30)
        assert outcome == {"merged": True}
        stats = sync.stats
        assert stats.rounds_merged == 2 and len(stats.waits) == 2
        assert min(stats.waits) >= late_by
        assert stats.wait_seconds == pytest.approx(sum(stats.waits))
    finally:
        sync.close()


def test_a_worker_holds_no_values_of_settled_rounds():
    """Memory: once a round's own part and mean are applied, the worker keeps its
    commits (tau agreement, drain, checkpoint) but not its decoded contribution, its
    payload or its mean (they were twice the model's float32 size); the error-feedback
    residual is rewritten in place round after round, not reallocated."""
    cfg = SyncConfig(
        schedule={"mode": "streaming", "sync_every": 4, "fragments": 2, "overlap": 1, "alpha": 0.5},
        codec={"up": "int4", "down": "int8", "block_size": 32},
    )
    settled, buffers = [], {}

    def inspect(worker, step, sync):
        for p in range(2):
            for s in sync.inflight.of(p):
                if not s.settled:
                    assert not s.released
                    continue
                settled.append((worker, p, s.round))
                assert s.released and s.uploaded.result().decoded.size == 0
                assert s.encoded.result().decoded.size == 0 and s.mean.result()[0].size == 0
                assert s.uploaded.result().commit["round"] == s.round  # the commit stays
                with pytest.raises(RuntimeError, match="released"):
                    sync.inflight.own(s)
            if sync.residual[p] is not None:
                buffers.setdefault((worker, p), set()).add(sync.residual[p].data_ptr())

    train_replicas(url(), Blocks, data, cfg, total_steps=14, on_step=inspect, inner_lr=0.05)
    assert {(w, p) for w, p, _ in settled} == {(w, p) for w in ("w0", "w1") for p in (0, 1)}
    assert all(len(ptrs) == 1 for ptrs in buffers.values()), buffers


def test_a_checkpoint_can_take_the_state_without_copies():
    """``state_dict(copy=False)`` (what a worker writes at once) holds the outer state
    and residuals themselves, with the values of the copying form."""
    cfg = SyncConfig(
        schedule={"mode": "streaming", "sync_every": 4, "fragments": 2, "overlap": 1, "alpha": 0.5},
        codec={"up": "int4", "down": "int8", "block_size": 32},
    )
    sync = train_replicas(url(), Blocks, data, cfg, total_steps=14,
                          inner_lr=0.05).traces["w0"].sync
    copied, held = sync.state_dict(), sync.state_dict(copy=False)
    for p in range(2):
        assert held["outer"][p]["params"] is sync.outer_params(p)
        assert held["outer"][p]["momentum"] is sync.outer_momentum(p)
        assert held["residual"][p] is sync.residual[p]
        assert copied["residual"][p] is not sync.residual[p]
        assert torch.equal(copied["residual"][p], held["residual"][p])
        for k in ("params", "momentum"):
            assert torch.equal(copied["outer"][p][k], held["outer"][p][k])
