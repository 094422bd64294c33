"""Faults degrade a run, never stall it or ruin it (the aggregator and exchange side).

Each test reproduces one defect a fault campaign found: a commit record copied to
another round was accepted; one huge value ruined the model; a round whose every
contribution was rejected still stepped; a worker whose own committed delta was
unreadable could never continue; a short outage killed a worker; a missing worker
stalled the run silently and for ever.
"""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest
import torch

from diloco.aggregator import Aggregator, Stall
from diloco.config import SyncConfig
from diloco.inflight import InFlight
from diloco.run import new_run, open_run
from replicas import Blocks
from storage import layout
from storage.errors import MisboundRecord, TransientStoreError
from storage.exchange import Exchange
from storage.objectstore import ObjectStore
from storage.retry import outlast


def make_run(cfg: SyncConfig, workers=("w0", "w1"), steps: int = 8) -> tuple[str, Exchange]:
    u = f"memory://trust/{uuid.uuid4().hex}"
    new_run(ObjectStore(u), Blocks(), cfg, workers=list(workers), total_steps=steps)
    return u, open_run(ObjectStore(u))


def vec(ex: Exchange, value: float, p: int = 0) -> np.ndarray:
    return np.full(ex.manifest.numel(p), value, np.float32)


def corrupt_chunk(ex: Exchange, p: int, r: int, worker: str) -> None:
    """Flip one byte of a committed contribution's first chunk, in the store."""
    commit = ex.delta_commit(p, r, worker)
    key = f"{commit['payload']}/c/0"
    data = bytearray(ex.store.get(key))
    data[3] ^= 0x40
    ex.store.put(key, bytes(data))


BLOCKING = SyncConfig(
    schedule={"mode": "diloco", "sync_every": 2, "fragments": 1},
    outer={"lr": 0.7, "momentum": 0.9},
)


def test_a_commit_record_copied_to_another_round_is_rejected():
    """Copying w0's round-0 record to its round-1 slot (a replay) is caught: the
    record's own round and payload disagree with its key, so the aggregator rejects
    it, and w0, finding its slot taken by something it cannot use, goes on."""
    _, ex = make_run(BLOCKING)
    for w, v in (("w0", 0.1), ("w1", 0.2)):
        ex.publish_delta(0, 0, w, vec(ex, v), tokens=10)
    agg = Aggregator(open_run(ex.store))
    assert agg.poll_once()
    ex.store.put_if_absent(layout.delta_commit(0, 1, "w0"),
                           ex.store.get(layout.delta_commit(0, 0, "w0")))
    with pytest.raises(MisboundRecord, match="round"):
        ex.fetch_delta(0, 1, "w0")
    ex.publish_delta(0, 1, "w1", vec(ex, 0.3), tokens=10)
    assert agg.poll_once()
    _, commit = ex.fetch_mean(0, 1)
    assert commit["weights"] == {"w1": 1.0}
    assert ex.rejections(0, 1)["w0"].startswith("MisboundRecord")
    # w0 restarts and sends round 1: the slot is taken; it goes on with its own value
    published = ex.publish_delta(0, 1, "w0", vec(ex, 0.4), tokens=10)
    assert not published.created
    assert np.array_equal(published.decoded, vec(ex, 0.4))
    assert "unusable" in published.commit


def test_a_mean_record_copied_to_another_round_is_refused():
    _, ex = make_run(BLOCKING)
    for w in ("w0", "w1"):
        ex.publish_delta(0, 0, w, vec(ex, 0.1), tokens=10)
    Aggregator(open_run(ex.store)).poll_once()
    ex.store.put_if_absent(layout.mean_commit(0, 1), ex.store.get(layout.mean_commit(0, 0)))
    with pytest.raises(MisboundRecord):
        ex.fetch_mean(0, 1)


def test_the_norm_guard_rejects_a_huge_contribution():
    """One value of 1e30 in round 2 (after the guard's two warm-up rounds) is
    rejected and the mean is the other worker's alone; the canonical model stays
    finite and moves as much as a normal round moves it."""
    _, ex = make_run(BLOCKING, steps=6)
    agg = Aggregator(open_run(ex.store))
    for r in range(3):
        for w in ("w0", "w1"):
            x = vec(ex, 0.01 * (r + 1))
            if (w, r) == ("w1", 2):
                x[7] = 1e30
            ex.publish_delta(0, r, w, x, tokens=10)
        assert agg.poll_once()
    reason = ex.rejections(0, 2)["w1"]
    assert reason.startswith("OutsizedContribution") and "norm guard" in reason
    mean, commit = ex.fetch_mean(0, 2)
    assert commit["weights"] == {"w0": 1.0}
    assert np.array_equal(mean, vec(ex, 0.03))
    assert torch.isfinite(agg.canonical(0)).all()
    assert float(agg.canonical(0).abs().max()) < 10.0
    # a restarted aggregator reads the same history from the committed means
    assert Aggregator(open_run(ex.store))._norms_of(0, 1) == pytest.approx(
        [float(np.linalg.norm(vec(ex, 0.02)))] * 2)


def test_the_norm_guard_rejects_a_huge_contribution_in_round_zero():
    """No history yet: one value of 1e30 in w1's first contribution is far above
    norm_guard_params (20) times the norm of the fragment's parameters, so
    it is rejected from round 0 (it used to be applied, and the model became 1e26)."""
    _, ex = make_run(BLOCKING, steps=4)
    agg = Aggregator(open_run(ex.store))
    for w in ("w0", "w1"):
        x = vec(ex, 0.05)
        if w == "w1":
            x[7] = 1e30
        ex.publish_delta(0, 0, w, x, tokens=10)
    assert agg.poll_once()
    reason = ex.rejections(0, 0)["w1"]
    assert "the fragment's parameters" in reason and reason.startswith("OutsizedContribution")
    mean, commit = ex.fetch_mean(0, 0)
    assert commit["weights"] == {"w0": 1.0}
    assert float(agg.canonical(0).abs().max()) < 10.0


def test_a_contribution_far_above_the_others_of_its_mean_is_rejected_from_round_zero():
    """Three workers in round 0: w2's outer gradient is 50 times the others' (under
    the parameters' bound, a finite plausible-looking value): more than norm_guard
    (10) times the median of the three, so rejected; 9 times is accepted."""
    for factor, rejected in ((50.0, True), (9.0, False)):
        _, ex = make_run(BLOCKING, workers=("w0", "w1", "w2"), steps=4)
        agg = Aggregator(open_run(ex.store))
        for w, v in (("w0", 0.01), ("w1", 0.012), ("w2", 0.011 * factor)):
            ex.publish_delta(0, 0, w, vec(ex, v), tokens=10)
        assert agg.poll_once()
        _, commit = ex.fetch_mean(0, 0)
        assert ("w2" in commit["rejected"]) is rejected
        assert sorted(commit["weights"]) == (["w0", "w1"] if rejected else ["w0", "w1", "w2"])
        if rejected:
            assert "median of the 3 contributions" in commit["rejected"]["w2"]
            assert ex.rejections(0, 0)["w2"] == commit["rejected"]["w2"]


def test_a_token_claim_beyond_what_the_member_could_train_is_rejected():
    """32 tokens a step (batch 4 x 8 tokens), a send every 2 steps: w1 claims 6,400
    tokens for round 0 (100 x the 64 it could have trained) and is rejected; the
    same claim honestly sized (64) in round 1 is used."""
    u = f"memory://trust/{uuid.uuid4().hex}"
    new_run(ObjectStore(u), Blocks(), BLOCKING, workers=["w0", "w1"], total_steps=4,
            user_config={"data": {"batch_size": 4, "seq_len": 8}, "optim": {"grad_accum": 1}})
    ex = open_run(ObjectStore(u))
    agg = Aggregator(open_run(ex.store))
    for r, claim in ((0, 6400), (1, 64)):
        ex.publish_delta(0, r, "w0", vec(ex, 0.1), tokens=64)
        ex.publish_delta(0, r, "w1", vec(ex, 0.2), tokens=claim)
        assert agg.poll_once()
    reason = ex.rejections(0, 0)["w1"]
    assert reason.startswith("ImplausibleClaim") and "claims 6400 tokens" in reason
    assert ex.fetch_mean(0, 0)[1]["weights"] == {"w0": 1.0}
    assert ex.fetch_mean(0, 1)[1]["weights"] == {"w0": 0.5, "w1": 0.5}


def test_a_fragment_whose_every_contribution_is_rejected_halts_the_aggregator():
    """Three rounds in a row with nothing usable: the aggregator stops with RunHalted
    (a job's non-zero exit) instead of recording empty rounds for ever."""
    from diloco.trust import HALT_AFTER_REJECTED, RunHalted  # noqa: PLC0415

    _, ex = make_run(BLOCKING, steps=2 * (HALT_AFTER_REJECTED + 1))
    agg = Aggregator(open_run(ex.store))
    for r in range(HALT_AFTER_REJECTED):
        for w in ("w0", "w1"):
            ex.publish_delta(0, r, w, vec(ex, 0.1), tokens=10)
            corrupt_chunk(ex, 0, r, w)
        if r < HALT_AFTER_REJECTED - 1:
            assert agg.poll_once()
    with pytest.raises(RunHalted, match="every contribution of its last 3 rounds"):
        agg.poll_once()
    assert agg.next_round[0] == HALT_AFTER_REJECTED - 1  # the halting round is not applied


def test_the_norm_guard_is_off_when_set_to_zero():
    _, ex = make_run(BLOCKING.changed(guard={"ratio": 0.0}), steps=6)
    agg = Aggregator(open_run(ex.store))
    for r in range(3):
        for w in ("w0", "w1"):
            ex.publish_delta(0, r, w, vec(ex, 100.0 if (w, r) == ("w1", 2) else 0.01),
                             tokens=10)
        assert agg.poll_once()
    assert ex.rejections(0, 2) == {}


def test_a_round_with_every_contribution_rejected_is_not_a_step():
    """Round 1's two contributions are both corrupt: the mean is recorded with no
    weights, and the outer parameters and momentum stay as round 0 left them (a
    zero step would still move them through the momentum)."""
    _, ex = make_run(BLOCKING, steps=4)
    agg = Aggregator(open_run(ex.store))
    for w in ("w0", "w1"):
        ex.publish_delta(0, 0, w, vec(ex, 0.1), tokens=10)
    assert agg.poll_once()
    params, momentum = agg.canonical(0).clone(), agg.momentum(0).clone()
    for w in ("w0", "w1"):
        ex.publish_delta(0, 1, w, vec(ex, 0.2), tokens=10)
        corrupt_chunk(ex, 0, 1, w)
    assert agg.poll_once()
    _, commit = ex.fetch_mean(0, 1)
    assert commit["weights"] == {} and sorted(commit["rejected"]) == ["w0", "w1"]
    assert torch.equal(agg.canonical(0), params)
    assert torch.equal(agg.momentum(0), momentum)
    assert agg.done


def test_a_restarted_worker_goes_on_when_its_own_sent_round_is_unreadable():
    """A worker's checkpoint lists a round in flight; its delta was corrupted in the
    store. Resuming, it reads its own contribution back: it must not fail for ever
    on an object it can never replace. Its own part is taken as zero (the aggregator
    counts it with weight 0) and the round's mean is still awaited."""
    _, ex = make_run(BLOCKING)
    ex.publish_delta(0, 0, "w0", vec(ex, 0.1), tokens=10)
    corrupt_chunk(ex, 0, 0, "w0")
    inflight = InFlight(ex, "w0", 1, BLOCKING, lambda s: None)
    try:
        inflight.load_state_dict({"residual": [None], "sent": [
            {"fragment": 0, "round": 0, "own_weight": 0.5, "own_applied": True,
             "correction_applied": False}]})
        sent = inflight.get(0, 0)
        assert torch.equal(inflight.own(sent), torch.zeros(ex.manifest.numel(0)))
        ex.publish_delta(0, 0, "w1", vec(ex, 0.2), tokens=10)
        Aggregator(open_run(ex.store)).poll_once()
        mean, commit = inflight.wait_mean(sent)
        assert commit["weights"] == {"w1": 1.0}
    finally:
        inflight.close()


class Outage(Exchange):
    """A store that fails every request for ``seconds`` after the first one."""

    def __init__(self, ex: Exchange, seconds: float):
        super().__init__(ex.store, ex.manifest)
        self.until = None
        self.seconds = seconds
        self.failures = 0

    def fetch_mean(self, fragment, round):
        self.until = self.until or time.monotonic() + self.seconds
        if time.monotonic() < self.until:
            self.failures += 1
            raise TransientStoreError("get mean.json failed after 6 attempts; 503")
        return super().fetch_mean(fragment, round)


def test_a_worker_waiting_for_a_mean_rides_out_an_outage():
    cfg = BLOCKING.changed(liveness={"outage_s": 30.0, "poll_max_s": 0.05, "poll_interval_s": 0.01})
    _, ex = make_run(cfg)
    flaky = Outage(ex, seconds=1.0)
    inflight = InFlight(flaky, "w0", 1, cfg, lambda s: None)
    try:
        inflight.send(0, 0, torch.full((ex.manifest.numel(0),), 0.1), tokens=10,
                      final=False, step=2)
        ex.publish_delta(0, 0, "w1", vec(ex, 0.2), tokens=10)
        inflight.drain()
        Aggregator(open_run(ex.store)).poll_once()
        mean, commit = inflight.wait_mean(inflight.get(0, 0))
        assert sorted(commit["weights"]) == ["w0", "w1"]
        assert flaky.failures >= 2
    finally:
        inflight.close()


def test_outlast_gives_up_after_its_patience_and_when_told_to_stop():
    log = __import__("logging").getLogger("test")
    calls = []

    def failing():
        calls.append(1)
        raise TransientStoreError("down")

    start = time.monotonic()
    with pytest.raises(TransientStoreError):
        outlast(failing, patience_s=0.3, what="x", log=log, pause_s=0.05)
    assert 0.3 <= time.monotonic() - start < 5 and len(calls) >= 3
    calls.clear()
    with pytest.raises(TransientStoreError):
        outlast(failing, patience_s=60, what="x", log=log, pause_s=0.05, stop=lambda: True)
    assert len(calls) == 1


def test_a_stalled_round_is_reported_with_who_is_missing():
    cfg = BLOCKING.changed(liveness={"stall_after_s": 0.2}, membership={"deadline_s": 600.0})
    _, ex = make_run(cfg)
    reports: list[list[Stall]] = []
    agg = Aggregator(open_run(ex.store), on_stall=reports.append)
    ex.publish_delta(0, 0, "w0", vec(ex, 0.1), tokens=10)
    stop = threading.Event()
    t = threading.Thread(target=agg.run, args=(stop,), kwargs={"poll_interval": 0.02})
    t.start()
    try:
        deadline = time.monotonic() + 10
        while not reports and time.monotonic() < deadline:
            time.sleep(0.02)
        assert reports, "no stall was reported"
        (stall,) = reports[0]
        assert (stall.fragment, stall.round, stall.missing) == (0, 0, ["w1"])
        assert "waits for w1 since" in stall.describe()
        ex.publish_delta(0, 0, "w1", vec(ex, 0.1), tokens=10)
        while reports[-1] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert reports[-1] == [] and agg.stalled == []
    finally:
        stop.set()
        t.join(10)


def test_a_dead_worker_costs_one_deadline_then_rounds_go_on_without_it():
    """Default quorum (half the workers): round 0 is reduced without the silent w1
    once the deadline passes; w1 is then absent, and later rounds do not wait for
    it beyond ``absent_deadline_s``; when it sends again in time it counts again."""
    cfg = BLOCKING.changed(membership={"deadline_s": 0.2, "absent_deadline_s": 0.0})
    assert cfg.membership.quorum == 0.5
    _, ex = make_run(cfg, steps=6)
    agg = Aggregator(open_run(ex.store))
    ex.publish_delta(0, 0, "w0", vec(ex, 0.1), tokens=10)
    assert not agg.poll_once()
    time.sleep(0.25)
    assert agg.poll_once()
    assert set(agg.gate.absent) == {"w1"}
    ex.publish_delta(0, 1, "w0", vec(ex, 0.1), tokens=10)
    assert agg.poll_once()  # no deadline wait: w1 is absent
    for w in ("w0", "w1"):
        ex.publish_delta(0, 2, w, vec(ex, 0.1), tokens=10)
    assert agg.poll_once()
    assert sorted(ex.fetch_mean(0, 2)[1]["weights"]) == ["w0", "w1"]
    assert set(agg.gate.absent) == set()


def test_diloco_status_shows_a_stall(tmp_path, monkeypatch):
    """`diloco status` prints who the stalled rounds wait for, from the aggregator's
    status in the store (what a user sees from any machine)."""
    from typer.testing import CliRunner  # noqa: PLC0415 - the command room, one test

    from cli.app import app  # noqa: PLC0415
    from workers.status import StatusBoard  # noqa: PLC0415

    monkeypatch.chdir(tmp_path)
    store = ObjectStore(f"file://{tmp_path}/runs/stalled-run")
    new_run(store, Blocks(), BLOCKING, workers=["w0", "w1"], total_steps=4)
    stall = Stall(0, 1, ["w1"], "2026-11-24T10:00:00+00:00", 75.0)
    StatusBoard(store, "aggregator").update(
        "running", force=True, rounds=1, total_rounds=2,
        stalled=[{**stall.__dict__, "text": stall.describe()}])
    result = CliRunner().invoke(app, ["status", "stalled-run"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "stalled" in result.output
    assert "fragment 0 round 1 waits for w1 since 10:00:00 UTC (75 s)" in result.output


def test_a_worker_waiting_long_for_a_mean_says_so():
    """With no aggregator, a merge's wait is reported every ``stall_after_s`` (the
    worker's status shows it) instead of waiting silently."""
    cfg = BLOCKING.changed(liveness={"stall_after_s": 0.3})
    _, ex = make_run(cfg)
    told: list[tuple[int, int, float]] = []
    stop = threading.Event()
    inflight = InFlight(ex, "w0", 1, cfg, lambda s: None, stop=stop, stop_patience_s=0.0,
                        on_stall=lambda p, r, s: (told.append((p, r, s)), stop.set()))
    try:
        inflight.send(0, 0, torch.zeros(ex.manifest.numel(0)), tokens=1, final=False, step=2)
        with pytest.raises(Exception, match="stopped while waiting"):
            inflight.wait_mean(inflight.get(0, 0))
        assert told and told[0][:2] == (0, 0) and told[0][2] >= 0.3
    finally:
        inflight.close()


def test_a_checkpoint_write_that_fails_once_does_not_step_the_round_twice(monkeypatch):
    """The outer step is taken, then the canonical checkpoint's write fails (an
    outage): the next poll adopts the committed mean and must end with the state of
    an aggregator whose write never failed (once stepped, error feedback intact).
    Found by the fault campaign's flaky-S3 trial."""
    import diloco.aggregator as aggregator_module  # noqa: PLC0415
    from storage.errors import TransientStoreError  # noqa: PLC0415

    cfg = BLOCKING.changed(codec={"down": "int8", "feedback_down": True})
    states = []
    for fail in (False, True):
        _, ex = make_run(cfg, steps=4)
        for r in range(2):
            for i, w in enumerate(("w0", "w1")):
                ex.publish_delta(0, r, w, vec(ex, 0.1 * (i + 1) + 0.03 * r), tokens=10)
        agg = Aggregator(open_run(ex.store))
        real, failed = aggregator_module.write_checkpoint, []

        def flaky(*args, real=real, failed=failed, fail=fail, **kwargs):
            if fail and not failed:
                failed.append(1)
                raise TransientStoreError("put failed: the store is down")
            return real(*args, **kwargs)

        monkeypatch.setattr(aggregator_module, "write_checkpoint", flaky)
        if fail:
            with pytest.raises(TransientStoreError):
                agg.poll_once()
        while agg.poll_once():
            pass
        assert agg.next_round == [2]
        states.append((agg.canonical(0).clone(), agg.momentum(0).clone(), agg.residual[0].clone()))
    for a, b in zip(*states, strict=True):
        assert torch.equal(a, b)


def test_the_audit_ignores_commits_of_names_that_are_not_members():
    """A commit planted in the slot of 'mallory' (no member of the run) is ignored by
    the aggregator; the audit counts it as ignored, not as lost or pending."""
    from diloco.audit import audit  # noqa: PLC0415

    _, ex = make_run(BLOCKING, steps=4)
    agg = Aggregator(open_run(ex.store))
    for r in range(2):
        for w in ("w0", "w1", "mallory"):
            ex.publish_delta(0, r, w, vec(ex, 0.1), tokens=10)
        assert agg.poll_once()
    assert sorted(ex.fetch_mean(0, 1)[1]["weights"]) == ["w0", "w1"]
    report = audit(ex)
    assert (report["applied"], report["ignored"], report["pending"]) == (4, 2, 0)
    assert report["lost"] == [] and report["double"] == []


def test_the_audit_counts_a_late_contribution_as_late():
    """w1's round 0 is held out of its round (as if late) and folded into round 1's
    mean as w1@0: the audit says one applied late, three applied on time; a quick
    check that needs no slow elastic run."""
    from diloco.audit import audit  # noqa: PLC0415

    _, ex = make_run(BLOCKING.changed(membership={"grace_s": 0.0, "late": "fold"}), steps=4)
    agg = Aggregator(open_run(ex.store),
                     hold_back=lambda p, r, w: (r, w) == (0, "w1"))
    for r in range(2):
        for w in ("w0", "w1"):
            ex.publish_delta(0, r, w, vec(ex, 0.1), tokens=10)
        assert agg.poll_once()
    assert sorted(ex.fetch_mean(0, 0)[1]["weights"]) == ["w0"]
    assert sorted(ex.fetch_mean(0, 1)[1]["weights"]) == ["w0", "w1", "w1@0"]
    report = audit(ex)
    assert (report["applied"], report["applied_late"], report["pending"]) == (3, 1, 0)


def test_a_contribution_exactly_at_the_norm_guard_is_used():
    """The guard rejects norms above the limit, not at it: with powers of two the norm
    of 2**-4 values equals 8 x the median norm of 2**-7 values exactly."""
    cfg = BLOCKING.changed(guard={"ratio": 8.0, "warmup": 1})
    _, ex = make_run(cfg, steps=4)
    agg = Aggregator(open_run(ex.store))
    for w in ("w0", "w1"):
        ex.publish_delta(0, 0, w, vec(ex, 2.0**-7), tokens=10)
    assert agg.poll_once()
    ex.publish_delta(0, 1, "w0", vec(ex, 2.0**-7), tokens=10)
    ex.publish_delta(0, 1, "w1", vec(ex, 2.0**-4), tokens=10)  # exactly 8 x the median
    assert agg.poll_once()
    assert ex.rejections(0, 1) == {}
    assert sorted(ex.fetch_mean(0, 1)[1]["weights"]) == ["w0", "w1"]


def test_a_worker_does_not_step_on_a_round_whose_every_contribution_was_rejected():
    """Blocking DiLoCo, H 2: rounds 0 and 1 build up outer momentum; every contribution
    of round 2 is rejected. Each worker's outer parameters and momentum stay as round 1
    left them (a zero step would still move them through the momentum), equal to the
    aggregator's, and round 3 steps again."""
    from replicas import data, train_replicas  # noqa: PLC0415
    from storage.errors import ImplausibleClaim  # noqa: PLC0415

    made: list[Aggregator] = []

    def aggregate(stop):
        made.append(Aggregator(open_run(ObjectStore(url))))
        honest = made[0].trust.claim

        def claim(p, k, w, tokens):
            if k == 2:
                raise ImplausibleClaim("planted for the test")
            honest(p, k, w, tokens)

        made[0].trust.claim = claim
        made[0].run(stop, 120)
        return made[0]

    outer: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def on_step(worker, step, sync):
        momentum = sync.outer_momentum(0)
        outer.setdefault(worker, {})[step] = (
            sync.outer_params(0).clone(),
            None if momentum is None else momentum.clone())

    url = f"memory://trust/{uuid.uuid4().hex}"
    train_replicas(url, Blocks, data, BLOCKING, total_steps=8, on_step=on_step,
                   aggregate=aggregate)
    assert made[0].exchange.fetch_mean(0, 2)[1]["weights"] == {}
    for w in ("w0", "w1"):
        params4, momentum4 = outer[w][4]  # after round 1
        params6, momentum6 = outer[w][6]  # after round 2: nothing usable
        assert float(momentum4.abs().max()) > 0
        assert torch.equal(params4, params6) and torch.equal(momentum4, momentum6)
        assert not torch.equal(outer[w][8][0], params6)  # round 3 steps again
        assert torch.equal(outer[w][8][0], made[0].canonical(0))


def test_a_late_contribution_is_dropped_by_default():
    """``late: drop`` (the default, measured best): w1's round 0, kept out of its round,
    is not folded into round 1's mean; it is recorded dropped (reason ``late``), and
    the audit counts it dropped, not lost."""
    from diloco.audit import audit  # noqa: PLC0415

    _, ex = make_run(BLOCKING.changed(membership={"grace_s": 0.0}), steps=4)
    assert ex.manifest.sync["membership"]["late"] == "drop"
    agg = Aggregator(open_run(ex.store),
                     hold_back=lambda p, r, w: (r, w) == (0, "w1"))
    for r in range(2):
        for w in ("w0", "w1"):
            ex.publish_delta(0, r, w, vec(ex, 0.1), tokens=10)
        assert agg.poll_once()
    _, commit = ex.fetch_mean(0, 1)
    assert sorted(commit["weights"]) == ["w0", "w1"]
    assert commit["dropped"] == [{"worker": "w1", "round": 0, "reason": "late"}]
    report = audit(ex)
    assert (report["applied"], report["applied_late"], report["dropped_stale"]) == (3, 0, 1)
