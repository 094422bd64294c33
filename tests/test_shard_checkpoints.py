"""Sharded checkpoints (an fsdp island's model and AdamW state, written with
torch.distributed.checkpoint) through every store backend: the bytes go through the
store's own fsspec filesystem (its endpoint and credentials), a resume gets the
same bits, and the bytes are counted in the store's traffic. One process here; the
two-rank island is in tests/test_fsdp.py."""

from __future__ import annotations

import torch

from workers import checkpoint
from workers.island import Island
from workers.model import ModelConfig, build_model

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(CONFIG, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    return model, opt


def test_shards_round_trip_through_the_store(make_store):
    store = make_store("solo-checkpoints")
    model, opt = _trained(seed=0)
    key = checkpoint.shards_key("solo", 7)
    ref = Island(model, None, 0, 1).save_shards(opt, store, key)
    assert ref["key"] == key and key.startswith("workers/solo/ckpt/00000007/dcp-")
    files = {k.rsplit("/", 1)[-1] for k in store.list(key)}
    assert files == {".metadata", "__0_0.distcp"}
    assert ref["bytes"] == sum(store.size(f"{key}/{f}") for f in files)
    assert store.traffic.bytes_up >= ref["bytes"]  # the bill sees them

    other, opt2 = _trained(seed=1)
    Island(other, None, 0, 1).load_shards(opt2, store, ref)
    for name, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], value), name
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], opt2.state[q][k]), k
    whole = checkpoint.read_shards(store, ref)
    assert set(whole["model"]) == set(model.state_dict())
