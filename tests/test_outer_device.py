"""``sync.outer.device``: where a worker keeps its outer state. On the CPU both
choices are the same placement, so they must give the same bits (on a GPU ``device``
moves deltas and means through pinned memory: diloco/fragments.py ``to_host`` and
``to_device``)."""

from __future__ import annotations

import uuid

import pytest
import torch
from pydantic import ValidationError

from diloco.config import SyncConfig
from replicas import Blocks, data, train_replicas
from workers.config import load_config


def _run(cfg: SyncConfig):
    return train_replicas(f"memory://outer-device/{uuid.uuid4().hex}", Blocks, data, cfg,
                          total_steps=12, inner_lr=0.05)


@pytest.mark.parametrize("sync", [
    ({"mode": "streaming", "overlap": 1}, {"up": "int4", "down": "int8", "block_size": 32}),
    # pure eager waits for the round before (adaptive's result depends on which means
    # have arrived: timing); its end applies the outstanding parts as a correction
    ({"mode": "eager", "eager_rule": "pure"}, {"up": "int8", "block_size": 32}),
    # naive delayed: its end steps the outstanding means, one outer step each
    ({"mode": "eager", "eager_rule": "naive"}, {"up": "int8", "block_size": 32}),
], ids=["streaming-int4", "eager-pure", "eager-naive"])
def test_outer_state_on_the_device_gives_the_bits_of_the_cpu(sync):
    """Outer parameters, momentum, error-feedback residuals and the live model agree
    bit for bit after a run with either placement (the device here is the CPU)."""
    schedule, codec = sync
    common = dict(schedule={"sync_every": 4, "fragments": 2, "alpha": 0.5, **schedule},
                  codec=codec)
    cpu = _run(SyncConfig(outer={"device": "cpu"}, **common))
    dev = _run(SyncConfig(outer={"device": "device"}, **common))
    assert cpu.traces.keys() == dev.traces.keys()
    for worker, a in cpu.traces.items():
        b = dev.traces[worker]
        for p in range(2):
            assert torch.equal(a.sync.outer_params(p), b.sync.outer_params(p)), (worker, p)
            assert torch.equal(a.sync.outer_momentum(p), b.sync.outer_momentum(p))
            ra, rb = a.sync.residual[p], b.sync.residual[p]
            assert (ra is None and rb is None) or torch.equal(ra, rb), (worker, p)
        for name, value in a.model.state_dict().items():
            assert torch.equal(value, b.model.state_dict()[name]), (worker, name)
    assert cpu.traces["w0"].sync.outer_params(0).device.type == "cpu"


def test_a_bad_outer_device_is_refused_naming_the_field_and_the_choices():
    with pytest.raises(ValidationError, match=r"outer.device\n.*'cpu' or 'device'"):
        SyncConfig(outer={"device": "gpu"})
    with pytest.raises(ValueError, match=r"sync.outer.device: .*'cpu' or 'device'"):
        load_config("tiny", ["sync.outer.device=gpu"])
