"""Worker checkpoints (workers/checkpoint.py): one format, torch.distributed.checkpoint.

A one-process worker's checkpoint is a DCP directory plus a create-only commit record
through every store backend: the bytes go through the store's own fsspec filesystem,
the record pins each file by size and sha256, a restore gets the same bits (model,
AdamW, and the rest: RNG, numpy arrays, bfloat16 and float8 tensors, tuples, integer
keys), the bytes are counted in the store's traffic. A missing, truncated or altered
file is refused in one line; a checkpoint in the format before this one still loads.
The two-rank fsdp island is in tests/test_fsdp.py."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from storage import layout
from storage.checkpoints import write_checkpoint
from storage.errors import CorruptObject, ObjectMissing
from storage.objectstore import ObjectStore
from workers import checkpoint
from workers.island import Island
from workers.model import build_model
from workers.model_config import ModelConfig

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)


def _trained(seed: int, steps: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(CONFIG, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for step in range(steps):
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed + step))
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def _rest() -> dict:
    """The rest of a worker's state, with every kind of value a worker keeps."""
    return {
        "rng": torch.get_rng_state(),
        "data": {"position": 1234, "epoch": 3, "order": np.arange(7, dtype=np.uint32)},
        "tokens": 123_456,
        "warm_from": None,
        "sync": {"outer": [{"params": torch.randn(5), "momentum": torch.randn(5)}],
                 "residual": [np.linspace(-1, 1, 6, dtype=np.float32), np.arange(3, dtype=">f4")],
                 "sent": {3: (2, "int4", 0.25)}, "scale": np.float64(0.125),
                 "bf16": torch.randn(4, 6).to(torch.bfloat16),
                 "fp8": torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn),
                 "empty": torch.zeros(0, 3), "count": torch.tensor(7)},
    }


def same(a, b, where: str = "") -> None:
    """Nested states hold the same values, types and bits (a numpy scalar comes back
    as the Python number it holds, as in the zarr format; any dict is a dict)."""
    b = b.item() if isinstance(b, np.generic) else b
    assert type(a) is type(b) or isinstance(a, dict) and isinstance(b, dict), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, np.ndarray):
        # stored in native byte order, as the zarr format did: the same values
        assert a.dtype.newbyteorder("=") == b.dtype.newbyteorder("=") and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _restored(store: ObjectStore, seed: int = 9) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    model = build_model(CONFIG, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    rest = checkpoint.restore(store, checkpoint.latest(store, "solo"), Island(model, None, 0, 1), opt)
    return model, opt, rest


def test_a_checkpoint_is_a_dcp_directory_and_a_commit_record(make_store):
    store = make_store("solo-checkpoints")
    model, opt = _trained(seed=0, steps=2)
    rest = _rest()
    assert checkpoint.save(store, "solo", 7, Island(model, None, 0, 1), opt, rest)

    base = f"{layout.worker_checkpoints('solo')}/00000007"
    keys = store.list(layout.worker_checkpoints("solo"))
    record = json.loads(store.get(f"{base}.json"))
    directory = record["dcp"]["key"]
    assert directory.startswith(f"{base}/dcp-")
    assert keys == [f"{base}.json", f"{directory}/.metadata", f"{directory}/__0_0.distcp"]
    assert record["format"] == "torch.distributed.checkpoint" and record["dcp"]["ranks"] == 1
    for name, pinned in record["dcp"]["files"].items():  # hashed as written: the bytes stored
        data = store.get(f"{directory}/{name}")
        assert pinned == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert record["dcp"]["bytes"] == sum(f["size"] for f in record["dcp"]["files"].values())
    assert store.traffic.bytes_up >= record["dcp"]["bytes"]  # the bill sees them
    assert record["state"]["tokens"] == 123_456  # the skeleton is plain JSON

    other, opt2, got = _restored(store)
    same(got, rest)
    same(other.state_dict(), model.state_dict())
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        same(opt2.state[q], opt.state[p])
    step, whole = checkpoint.load(store, "solo")  # all of it in one process, for tools
    assert step == 7 and set(whole["model"]) == set(model.state_dict())
    same(whole["sync"], rest["sync"])


def test_a_step_is_written_once_and_keep_deletes_whole_prefixes(tmp_path):
    store = ObjectStore(str(tmp_path))
    model, opt = _trained(seed=0)
    island = Island(model, None, 0, 1)
    assert checkpoint.save(store, "solo", 5, island, opt, _rest(), keep=2)
    assert not checkpoint.save(store, "solo", 5, island, opt, _rest(), keep=2)  # committed
    assert len(store.list(f"{layout.worker_checkpoints('solo')}/00000005")) == 2  # one dir
    assert checkpoint.save(store, "solo", 9, island, opt, _rest(), keep=2)
    assert checkpoint.save(store, "solo", 12, island, opt, _rest(), keep=2)
    left = {k.split("/")[3][:8] for k in store.list(layout.worker_checkpoints("solo"))}
    assert left == {"00000009", "00000012"}  # step 5's record and directory went together


def test_a_crash_before_the_commit_leaves_the_previous_checkpoint_newest(tmp_path):
    store = ObjectStore(str(tmp_path))
    model, opt = _trained(seed=0)
    island = Island(model, None, 0, 1)
    checkpoint.save(store, "solo", 5, island, opt, _rest())
    at_5 = copy.deepcopy(model.state_dict())
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    model(x, x)[1].backward()
    opt.step()  # step 9's files are written, then the worker dies before the commit
    orphan = island.save_state(opt, store, checkpoint.dcp_key("solo", 9))
    assert store.exists(f"{orphan['key']}/.metadata")
    assert checkpoint.latest_step(store, "solo") == 5
    other, _, _ = _restored(store)
    same(other.state_dict(), at_5)


def test_a_save_before_the_first_step_holds_no_optimizer_state(tmp_path):
    """AdamW has no state before its first step; saving one would mean taking a step
    (what DCP's get_state_dict does), and a resume would differ from the straight run."""
    store = ObjectStore(str(tmp_path))
    model, opt = _trained(seed=0, steps=0)
    checkpoint.save(store, "solo", 0, Island(model, None, 0, 1), opt, _rest())
    assert not opt.state
    assert checkpoint.latest(store, "solo").dcp["optimizer"] is False
    other, opt2, _ = _restored(store)
    assert not opt2.state
    same(other.state_dict(), model.state_dict())


def _one_checkpoint(tmp_path: Path) -> tuple[ObjectStore, Path]:
    store = ObjectStore(str(tmp_path))
    model, opt = _trained(seed=0)
    checkpoint.save(store, "solo", 7, Island(model, None, 0, 1), opt, _rest())
    return store, tmp_path / checkpoint.latest(store, "solo").dcp["key"]


def _flip_a_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "error", "message"), [
    (lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:-100]),
     CorruptObject, r"__0_0\.distcp has \d+ bytes; its commit record says \d+$"),
    (lambda d: (d / "__0_0.distcp").unlink(), ObjectMissing, r"__0_0\.distcp"),
    (lambda d: _flip_a_byte(d / "__0_0.distcp", 5000), CorruptObject,
     r"__0_0\.distcp fails its check: \d+ bytes with sha256 \w+\.\.\., its commit record"),
    (lambda d: _flip_a_byte(d / ".metadata", 200), CorruptObject, r"\.metadata fails its check"),
], ids=["truncated", "missing", "altered", "altered-metadata"])
def test_a_damaged_file_is_refused_in_one_line(tmp_path, damage, error, message):
    store, directory = _one_checkpoint(tmp_path)
    damage(directory)
    for read in (lambda: _restored(store), lambda: checkpoint.load(store, "solo")):
        with pytest.raises(error, match=message) as raised:
            read()
        assert "\n" not in str(raised.value)


def test_a_checkpoint_in_an_unknown_format_is_refused_in_one_line(tmp_path):
    store = ObjectStore(str(tmp_path))
    store.put(f"{layout.worker_checkpoints('solo')}/00000003.json",
              json.dumps({"format": "safetensors", "state": {}}).encode())
    with pytest.raises(CorruptObject, match=r"00000003\.json: checkpoint format "
                                            r"'safetensors' is not 'torch\.distributed"):
        checkpoint.latest(store, "solo")


def _legacy_flatten(obj, arrays: dict[str, np.ndarray]):
    """What the zarr format (before torch.distributed.checkpoint) wrote as the skeleton."""
    if isinstance(obj, torch.Tensor):
        key, t = f"t{len(arrays)}", obj.detach()
        bits = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}
        arrays[key] = (t.view(bits[t.dtype]) if t.dtype in bits else t).numpy()
        return {"__tensor__": key, "dtype": str(t.dtype).removeprefix("torch.")}
    if isinstance(obj, np.ndarray):
        arrays[f"t{len(arrays)}"] = obj
        return {"__ndarray__": f"t{len(arrays) - 1}"}
    if isinstance(obj, dict):
        return {(f"__int__{k}" if isinstance(k, int) else k): _legacy_flatten(v, arrays)
                for k, v in obj.items()}
    if isinstance(obj, tuple):
        return {"__tuple__": [_legacy_flatten(v, arrays) for v in obj]}
    if isinstance(obj, list):
        return [_legacy_flatten(v, arrays) for v in obj]
    return obj.item() if isinstance(obj, np.generic) else obj


def test_a_legacy_zarr_checkpoint_still_loads(tmp_path):
    """A run written before this format resumes: its model, AdamW and rest load."""
    store = ObjectStore(str(tmp_path))
    model, opt = _trained(seed=0, steps=2)
    rest = _rest()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "shards": None, **rest}
    arrays: dict[str, np.ndarray] = {}
    skeleton = _legacy_flatten(state, arrays)
    key = f"{layout.worker_checkpoints('solo')}/00000011"
    write_checkpoint(store, key, f"{key}.json", arrays,
                     {"worker": "solo", "step": 11, "state": skeleton})

    assert checkpoint.latest(store, "solo").legacy is not None
    other, opt2, got = _restored(store)
    same(other.state_dict(), model.state_dict())
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        same(opt2.state[q], opt.state[p])
    for name in rest:
        same(got[name], rest[name], name)
