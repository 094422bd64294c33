"""Numeric identities of DiLoCo (docs/algorithms.md section 4) and MaxText's two-replica
linear-regression case, re-derived by hand. Replicas and the aggregator run as
threads on one memory:// store."""

from __future__ import annotations

import uuid
import zlib

import pytest
import torch
from torch import nn

from diloco.config import SyncConfig
from replicas import train_replicas

# -- MaxText's two-replica case --------------------------------------------------------
# y = x.w + b, MSE loss, inner plain SGD lr 0.1, H = 3, outer SGD lr 1.0, momentum
# 0.9, Nesterov, codec none, one fragment. Model starts at w = [2, 1], b = 1.
# Replica 0: x = [[0,1],[1,0]], y = [1,2]; replica 1: x = [[1,0],[0,1]], y = [2,3].
DATA = {
    "w0": (torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([[1.0], [2.0]])),
    "w1": (torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[2.0], [3.0]])),
}


def linear() -> nn.Module:
    m = nn.Linear(2, 1)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[2.0, 1.0]]))
        m.bias.fill_(1.0)
    return m


def url() -> str:
    return f"memory://numerics/{uuid.uuid4().hex}"


def test_maxtext_two_replicas():
    cfg = SyncConfig(
        schedule={"mode": "diloco", "sync_every": 3, "fragments": 1},
        outer={"lr": 1.0, "momentum": 0.9},
    )
    res = train_replicas(url(), linear, lambda w, t: DATA[w], cfg, total_steps=4)
    t0, t1 = res.traces["w0"], res.traces["w1"]
    mean_loss = [(a + b) / 2 for a, b in zip(t0.losses, t1.losses, strict=True)]
    # Step 1: both replicas predict 2, 3 (resp. 3, 2) against 1, 2 (2, 3): errors
    # +-1, MSE 1.0. Steps 2 and 3 follow plain SGD: 0.65, 0.4481.
    # Step 4 runs from the synced model below: 0.574244.
    assert mean_loss == pytest.approx([1.0, 0.65, 0.4481, 0.574244], rel=1e-5)

    # Mean outer gradient of round 0 = mean over replicas of (start - after 3 steps):
    # w = [0.245, -0.026], b = 0.219.
    mean, commit = res.aggregator.exchange.fetch_mean(0, 0)
    # fragment 0 flattens weight then bias
    assert mean.tolist() == pytest.approx([0.245, -0.026, 0.219], abs=1e-6)
    assert commit["weights"] == {"w0": 0.5, "w1": 0.5}

    # First outer step moves by lr * (1 + mu) * delta = 1.9 * delta:
    # w = [2 - 0.4655, 1 + 0.0494] = [1.5345, 1.0494], b = 1 - 0.4161 = 0.5839.
    expected = [1.5345, 1.0494, 0.5839]
    for trace in (t0, t1):
        after_sync = trace.params[2]  # parameters after step 3 (the sync)
        got = after_sync["weight"].flatten().tolist() + after_sync["bias"].tolist()
        assert got == pytest.approx(expected, abs=1e-5)
    # The canonical model after round 0 is the aggregator's checkpoint of round 0.
    from diloco.run import latest_global  # noqa: PLC0415
    from storage.checkpoints import read_checkpoint  # noqa: PLC0415
    assert latest_global(res.aggregator.exchange, 0)[0] == 1  # round 0 and the final round
    arrays, _ = read_checkpoint(res.aggregator.exchange.store, "global/frag/0/r000000.json")
    assert arrays["params"].tolist() == pytest.approx(expected, abs=1e-5)
    # after the final round every replica holds the canonical model, bit for bit
    for trace in (t0, t1):
        assert torch.equal(trace.sync.outer_params(0), res.aggregator.canonical(0))


# -- Section 2 identities --------------------------------------------------------------
def _regression_data(worker: str, step: int):
    # a stable seed: hash() of a str is salted per process
    g = torch.Generator().manual_seed(zlib.crc32(f"{worker}/{step}".encode()))
    x = torch.randn(8, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1
    return x, y


def _small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def test_fedavg_identity():
    """Outer lr 1, momentum 0: the outer parameters become the mean of the workers'."""
    cfg = SyncConfig(
        schedule={"mode": "diloco", "sync_every": 5},
        outer={"lr": 1.0, "momentum": 0.0},
    )
    res = train_replicas(url(), _small, _regression_data, cfg, total_steps=5)
    # The replicas' parameters at step 5, just before the merge, are reconstructed from
    # the published deltas (codec none): theta_m = theta_0 - delta_m. After the merge
    # every replica equals their mean: theta_0 - mean(delta) = mean(theta_m).
    ex = res.aggregator.exchange
    d0, _ = ex.fetch_delta(0, 0, "w0")
    d1, _ = ex.fetch_delta(0, 0, "w1")
    init = torch.cat([p.detach().flatten() for p in _small().parameters()])
    live0, live1 = init - torch.from_numpy(d0), init - torch.from_numpy(d1)
    expected = (live0 + live1) / 2
    got = res.aggregator.canonical(0)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    for w in ("w0", "w1"):
        final = res.traces[w].params[-1]
        flat = torch.cat([final[k].flatten() for k in final])
        torch.testing.assert_close(flat, expected, rtol=1e-6, atol=1e-7)


def test_one_worker_equals_plain_training():
    """One worker, outer lr 1, momentum 0: identical to plain training."""
    cfg = SyncConfig(
        schedule={"mode": "diloco", "sync_every": 3},
        outer={"lr": 1.0, "momentum": 0.0},
    )
    steps = 9
    res = train_replicas(url(), _small, _regression_data, cfg, workers=("w0",),
                         total_steps=steps)
    model = _small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = []
    for t in range(1, steps + 1):
        x, y = _regression_data("w0", t)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        plain.append(float(loss))
    assert res.traces["w0"].losses == pytest.approx(plain, rel=1e-6)
    final = res.traces["w0"].params[-1]
    for name, p in model.named_parameters():
        torch.testing.assert_close(final[name], p.detach(), rtol=1e-6, atol=1e-7)


def test_h1_equals_data_parallel_sgd():
    """H = 1, inner SGD, outer lr 1 momentum 0: synchronous SGD on the mean gradient."""
    cfg = SyncConfig(
        schedule={"mode": "diloco", "sync_every": 1},
        outer={"lr": 1.0, "momentum": 0.0},
    )
    steps = 4
    res = train_replicas(url(), _small, _regression_data, cfg, total_steps=steps)
    model = _small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for t in range(1, steps + 1):
        opt.zero_grad()
        for w in ("w0", "w1"):
            x, y = _regression_data(w, t)
            (nn.functional.mse_loss(model(x), y) / 2).backward()
        opt.step()
    for w in ("w0", "w1"):
        final = res.traces[w].params[-1]
        for name, p in model.named_parameters():
            torch.testing.assert_close(final[name], p.detach(), rtol=1e-5, atol=1e-6)
