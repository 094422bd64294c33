"""The whole protocol on every backend: replicas, the aggregator and a restart, on
memory://, a local directory and two S3 servers on loopback (moto's, and SeaweedFS,
a real object store), or the endpoint in DILOCO_TEST_S3_ENDPOINT such as MinIO."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco.aggregator import Aggregator
from diloco.config import SyncConfig
from diloco.run import load_canonical, open_run, plan_for
from replicas import Blocks, data, train_replicas
from storage.errors import RunExists
from storage.objectstore import ObjectStore


@pytest.mark.parametrize("mode", ["streaming", "eager"])
def test_run_on_backend(store_url, mode):
    url, opts = store_url["url"], store_url["storage_options"]
    cfg = SyncConfig(
        schedule={"mode": mode, "sync_every": 4, "fragments": 2, "overlap": 1, "alpha": 0.5},
        codec={"up": "int4", "down": "int8", "block_size": 32},
    )
    res = train_replicas(url, Blocks, data, cfg, total_steps=10, inner_lr=0.05,
                         storage_options=opts, timeout=120)
    agg = res.aggregator
    assert agg.done
    ex = open_run(ObjectStore(url, storage_options=opts))
    assert sum(ex.manifest.rounds) == len(agg.stats.rounds)
    # the canonical model in the store is the aggregator's
    model = Blocks()
    load_canonical(ex, plan_for(model, cfg), model)
    for p in range(2):
        assert torch.equal(plan_for(model, cfg).gather(model, p), agg.canonical(p))
    # a restarted aggregator finds nothing left to do and the same state
    again = Aggregator(ex)
    assert again.done
    for p in range(2):
        assert torch.equal(again.canonical(p), agg.canonical(p))
    # traffic was counted per worker, and both sent the same number of bytes
    ups = [t.sync.exchange.store.traffic.bytes_up for t in res.traces.values()]
    assert ups[0] > 0 and ups[0] == ups[1]
    downs = [t.sync.exchange.store.traffic.bytes_down for t in res.traces.values()]
    assert all(d > 0 for d in downs)
    # creating the run again is refused
    with pytest.raises(RunExists, match="already exists"):
        from diloco.run import new_run  # noqa: PLC0415

        new_run(ObjectStore(url, storage_options=opts), Blocks(), cfg, workers=["w0"],
                total_steps=1)
    assert np.isfinite(agg.canonical(0).numpy()).all()
