"""SparseLoCo's pieces in the synchroniser and the aggregator: the decayed
error-feedback accumulator, the averaged outer step, and the peers way down (the
aggregator commits only the weights; each worker sums the contributions itself).
Replicas and the aggregator run as threads on memory:// stores."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from diloco import rules
from diloco.config import SyncConfig
from diloco.inflight import InFlight
from diloco.run import new_run, open_run
from replicas import Blocks, data, train_replicas
from storage.checkpoints import read_checkpoint
from storage.codecs import roundtrip
from storage.exchange import contribution_of, weighted_sum
from storage.objectstore import ObjectStore


def url() -> str:
    return f"memory://sparse-sync/{uuid.uuid4().hex}"


def _outer(res, worker: str) -> torch.Tensor:
    sync = res.traces[worker].sync
    return torch.cat([sync.outer_params(p) for p in range(len(sync.plan))])


CODECS = ["int4", "topk2"]


@pytest.mark.parametrize("codec", CODECS)
def test_a_peers_mean_gives_every_party_the_aggregators_bits(codec):
    """mean_from peers: the mean's commit has no payload, every worker's outer state
    equals the aggregator's checkpoint of each round bit for bit, and the mean is
    the weighted float32 sum of the contributions it names (no second rounding)."""
    cfg = SyncConfig(
        schedule={"mode": "streaming", "sync_every": 4, "fragments": 2, "overlap": 1},
        codec={"up": codec, "down": "int8", "mean_from": "peers", "block_size": 32, "chunk": 64, "k": 8},
    )
    res = train_replicas(url(), Blocks, data, cfg, total_steps=14, inner_lr=0.05)
    ex = res.aggregator.exchange
    for p in range(2):
        for r in range(ex.manifest.rounds[p]):
            commit = ex.mean_commit(p, r)
            assert commit["mean_from"] == "peers" and "payload" not in commit
            values = {k: ex.fetch_delta(p, *reversed(contribution_of(k, r)))[0]
                      for k in commit["weights"]}
            expected = weighted_sum(ex.manifest.numel(p), values, commit["weights"])
            mean, _ = ex.fetch_mean(p, r)
            assert np.array_equal(mean, expected)
        arrays, _ = read_checkpoint(ex.store, f"global/frag/{p}/r{ex.manifest.rounds[p] - 1:06d}.json")
        for w in ("w0", "w1"):
            sync = res.traces[w].sync
            assert torch.equal(sync.outer_params(p), torch.from_numpy(arrays["params"]))
            assert torch.equal(sync.outer_momentum(p), torch.from_numpy(arrays["momentum"]))
    assert not list(ex.store.list("frag/0/r000000/mean/"))  # no mean payload written


def test_a_peers_mean_reads_only_the_other_workers_contributions():
    cfg = SyncConfig(
        schedule={"mode": "streaming", "sync_every": 4, "fragments": 2, "overlap": 1},
        codec={"up": "int4", "mean_from": "peers", "block_size": 32},
    )
    res = train_replicas(url(), Blocks, data, cfg, total_steps=8, inner_lr=0.05)
    for w, other in (("w0", "w1"), ("w1", "w0")):
        read = res.traces[w].sync.exchange.store.traffic.objects_down
        assert any(f"/delta/{other}/" in k for k in read)
        assert not any(f"/delta/{w}/" in k for k in read), sorted(read)


def test_the_averaged_outer_step_moves_by_the_mean_without_momentum():
    """outer_step average: eta 1, no momentum, theta_(r+1) = theta_r - mean_r exactly
    (with eta 1 the new outer parameters are the average of the replicas)."""
    cfg = SyncConfig(
        schedule={"mode": "diloco", "sync_every": 3, "fragments": 1},
        outer={"step": "average"},
    )
    assert (cfg.outer.lr, cfg.outer.momentum) == (1.0, 0.0)
    res = train_replicas(url(), Blocks, data, cfg, total_steps=9, inner_lr=0.05)
    ex = res.aggregator.exchange
    theta = torch.from_numpy(read_checkpoint(ex.store, "global/init/0.json")[0]["params"])
    for r in range(3):
        mean, _ = ex.fetch_mean(0, r)
        theta = theta - torch.from_numpy(mean)
        arrays, _ = read_checkpoint(ex.store, f"global/frag/0/r{r:06d}.json")
        assert torch.equal(torch.from_numpy(arrays["params"]), theta)
        assert "momentum" not in arrays
    assert torch.equal(_outer(res, "w0"), theta)
    with pytest.raises(ValueError, match="outer.momentum must be 0 or unset"):
        SyncConfig(outer={"step": "average", "momentum": 0.9})


def test_the_accumulator_decays_by_beta_before_the_next_outer_gradient():
    """e = beta * e + delta; sent = decode(encode(e)); e = e - sent (SparseLoCo),
    checked through the real encoder thread against the codec's own round trip."""
    cfg = SyncConfig(
        schedule={"mode": "streaming", "sync_every": 4, "fragments": 1},
        codec={"up": "int4", "block_size": 32, "error_decay": 0.5},
    )
    model = Blocks()
    store = ObjectStore(url())
    new_run(store, model, cfg, workers=["w0"], total_steps=8)
    ex = open_run(store)
    flight = InFlight(ex, "w0", 1, cfg, on_wait=lambda s: None)
    n = ex.manifest.numel(0)
    g = torch.Generator().manual_seed(3)
    d1, d2 = (torch.randn(n, generator=g) for _ in range(2))
    try:
        flight.send(0, 0, d1, tokens=1, final=False, step=4)
        flight.get(0, 0).encoded.result()
        e1 = d1 - torch.from_numpy(roundtrip(d1.numpy(), cfg.up)[1])
        assert torch.equal(flight.residual[0], e1)
        flight.send(0, 1, d2, tokens=1, final=False, step=8)
        flight.get(0, 1).encoded.result()
        x2 = d2 + e1 * torch.tensor(0.5)
        assert torch.equal(flight.residual[0], x2 - torch.from_numpy(roundtrip(x2.numpy(), cfg.up)[1]))
    finally:
        flight.close()


def test_beta_defaults_and_plain_feedback_is_unchanged():
    assert SyncConfig(codec={"up": "topk2"}).codec.error_decay == 0.95
    assert SyncConfig(codec={"up": "int4"}).codec.error_decay == 1.0
    d, e = torch.randn(100), torch.randn(100)
    assert torch.equal(rules.with_residual(d, e, 1.0), d + e)
    assert torch.equal(rules.with_residual(d, e, 0.95), d + e * np.float32(0.95))
    with pytest.raises(ValueError, match=r"codec.error_decay\n  Input should be greater than 0"):
        SyncConfig(codec={"error_decay": 0.0})


@pytest.mark.parametrize("codec", CODECS)
def test_a_worker_resumes_exactly_with_a_decayed_accumulator(codec):
    """The accumulator is in the worker's checkpoint: a worker restarted mid-run
    (a fragment in flight) continues bit for bit, peers mean and all."""
    cfg = SyncConfig(
        schedule={"mode": "streaming", "sync_every": 4, "fragments": 2, "overlap": 1, "alpha": 0.5},
        outer={"step": "average"},
        codec={"up": codec, "error_decay": 0.8, "mean_from": "peers", "block_size": 32, "chunk": 64, "k": 4},
    )
    plain = train_replicas(url(), Blocks, data, cfg, total_steps=14, inner_lr=0.05)
    resumed = train_replicas(url(), Blocks, data, cfg, total_steps=14, inner_lr=0.05,
                             restart_at={"w0": 5, "w1": 8})
    for w in ("w0", "w1"):
        assert plain.traces[w].losses == resumed.traces[w].losses
        assert torch.equal(_outer(plain, w), _outer(resumed, w))


def test_the_sparse_codecs_take_the_peers_way_down_unless_told_otherwise():
    assert SyncConfig(codec={"up": "topk2"}).codec.mean_from == "peers"
    assert SyncConfig(codec={"up": "int4"}).codec.mean_from == "aggregator"
    assert SyncConfig(codec={"up": "topk4", "mean_from": "aggregator"}).codec.mean_from == "aggregator"
    cfg = SyncConfig(
        schedule={"mode": "streaming", "sync_every": 4, "fragments": 2, "overlap": 1},
        codec={"up": "topk2", "chunk": 64, "k": 8},
    )
    res = train_replicas(url(), Blocks, data, cfg, total_steps=4, inner_lr=0.05)
    assert res.aggregator.exchange.mean_commit(0, 0)["mean_from"] == "peers"


@pytest.mark.parametrize("mean_from", ["aggregator", "peers"])
def test_gc_keeps_the_contributions_a_peers_mean_is_made_of(mean_from):
    """A finished run's contributions beyond the retention go, unless the means are
    sums of them (peers): then they are the means and stay, and every round's mean
    still reads back."""
    from workers import gc  # noqa: PLC0415

    cfg = SyncConfig(
        schedule={"mode": "streaming", "sync_every": 4, "fragments": 2, "overlap": 1},
        codec={"up": "topk2", "mean_from": mean_from, "chunk": 64, "k": 8},
    )
    res = train_replicas(url(), Blocks, data, cfg, total_steps=8, inner_lr=0.05)
    ex = res.aggregator.exchange
    todo = gc.plan(ex, contributions=0, finished=True)
    dropped = {d.kind for d in todo.deletions}
    assert ("contributions" in dropped) == (mean_from == "aggregator")
    gc.collect(ex, todo)
    for p in range(2):
        for r in range(ex.manifest.rounds[p]):
            assert ex.fetch_mean(p, r) is not None


def test_eager_with_a_peers_mean_applies_every_contribution_once():
    """Adaptive eager, top-k up, peers way down, averaged step: whichever means came
    late, after finish() every worker's outer parameters equal the canonical model's
    (each contribution applied exactly once, with the sum the aggregator made)."""
    cfg = SyncConfig(
        schedule={"mode": "eager", "overlap": 1, "alpha": 0.5, "sync_every": 4, "fragments": 2},
        outer={"step": "average"},
        codec={"up": "topk2", "chunk": 64, "k": 8},
    )
    res = train_replicas(url(), Blocks, data, cfg, total_steps=16, inner_lr=0.05)
    canonical = torch.cat([res.aggregator.canonical(p) for p in range(2)])
    for w in ("w0", "w1"):
        torch.testing.assert_close(_outer(res, w), canonical, rtol=1e-5, atol=1e-6)
