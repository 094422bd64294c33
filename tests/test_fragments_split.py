"""Fragments that split tensors (``sync.schedule.split_tensors``, docs/algorithms.md
"Fragments") through the real Synchronizer and Aggregator: a run restarted from its
checkpoints ends with the bits of one never stopped, the canonical model reassembles
the split tensors, and a run written before tensors could be split keeps whole ones.
Replicas and aggregators run as threads on memory:// stores (tests/replicas.py)."""

from __future__ import annotations

import json
import uuid
import warnings

import pytest
import torch
from test_aggregator import state_hash, with_kills

from diloco.aggregator import Aggregator
from diloco.bootstrap import canonical_after
from diloco.config import SyncConfig
from diloco.flat_keys import FLAT_KEYS
from diloco.run import load_canonical, open_run, plan_for
from diloco.synchronizer import Synchronizer
from replicas import Blocks, data, train_replicas
from storage.layout import MANIFEST
from storage.objectstore import ObjectStore
from storage.spec import FragmentEntry

# Blocks has 337 parameters (4 -> 8, four 8 x 8 layers, 8 -> 1); with blocks of 32
# values P = 2 cuts at 160 and P = 4 at 64, 160, 224: inside layer weights.
CONFIGS = {
    2: SyncConfig(
        schedule={"mode": "streaming", "sync_every": 4, "fragments": 2, "overlap": 1, "alpha": 0.5},
        codec={"up": "int4", "down": "int4", "block_size": 32},
    ),
    4: SyncConfig(
        schedule={"mode": "streaming", "sync_every": 8, "fragments": 4, "overlap": 1, "alpha": 0.5},
        codec={"up": "int4", "down": "int4", "block_size": 32},
    ),
}
STEPS = 18


def url() -> str:
    return f"memory://split/{uuid.uuid4().hex}"


def outer(res, worker: str, fragments: int) -> torch.Tensor:
    sync = res.traces[worker].sync
    return torch.cat([sync.outer_params(p) for p in range(fragments)])


_PLAIN: dict[int, tuple[str, object]] = {}


def plain_run(p: int):
    """(url, result) of the run of CONFIGS[p] never stopped, trained once per module:
    the reference of the restarted run and the run whose canonical model is read."""
    if p not in _PLAIN:
        u = url()
        _PLAIN[p] = u, train_replicas(u, Blocks, data, CONFIGS[p], total_steps=STEPS,
                                      inner_lr=0.05)
    return _PLAIN[p]


@pytest.mark.parametrize("p", [2, 4])
def test_split_run_restarted_from_checkpoints_ends_with_the_same_bits(p):
    """Workers restarted from their state (a fragment in flight) and an aggregator
    killed and restarted from the store reach the bits of a run never stopped."""
    cfg = CONFIGS[p]
    plan = plan_for(Blocks(), cfg)
    assert any(not s.whole for f in plan.fragments for s in f.params), "a tensor is cut"
    sizes = [f.numel for f in plan.fragments]
    assert max(sizes) - 337 / p < cfg.codec.block_size
    _, plain = plain_run(p)
    u = url()
    restarts: list[int] = []
    kills = {("published", 0, 1), ("stepped", 1, 0), ("checkpointed", p - 1, 0)}
    resumed = train_replicas(u, Blocks, data, cfg, total_steps=STEPS, inner_lr=0.05,
                             restart_at={"w0": 5, "w1": 10},
                             aggregate=with_kills(u, kills, restarts))
    assert len(restarts) == len(kills)
    assert state_hash(resumed.aggregator) == state_hash(plain.aggregator)
    assert state_hash(Aggregator(open_run(ObjectStore(u)))) == state_hash(
        plain.aggregator)
    for w in ("w0", "w1"):
        assert plain.traces[w].losses == resumed.traces[w].losses
        assert torch.equal(outer(plain, w, p), outer(resumed, w, p))
        for name, value in plain.traces[w].model.state_dict().items():
            assert torch.equal(resumed.traces[w].model.state_dict()[name], value), name


@pytest.mark.parametrize("p", [2, 4])
def test_the_canonical_model_reassembles_split_tensors(p):
    """The newest canonical checkpoints, loaded into a fresh model (what a continuation
    starts from), give every worker's final model tensor for tensor (after finish()
    each holds the canonical parameters); the round-0 model from canonical_after (what
    an export of round 0 writes) is the initial model."""
    cfg = CONFIGS[p]
    u, res = plain_run(p)
    ex = open_run(ObjectStore(u))
    fresh = Blocks()
    plan = plan_for(fresh, cfg)
    assert min(load_canonical(ex, plan, fresh)) >= 2
    for w in ("w0", "w1"):
        live = res.traces[w].model.state_dict()
        for name, value in fresh.state_dict().items():
            assert torch.equal(value, live[name]), (w, name)
    _, params = canonical_after(ex, cfg, 0)
    for i, flat in enumerate(params):
        plan.scatter(fresh, i, flat)
    for name, value in Blocks().state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_a_manifest_from_before_split_tensors_resumes_with_whole_tensors():
    """Its sync (and config.sync) is flat, as then, and lacks split_tensors: opened,
    they say false, and a worker planning from them gets the run's whole-tensor
    fragments."""
    cfg = CONFIGS[2].changed(schedule={"split_tensors": False})
    u = url()
    res = train_replicas(u, Blocks, data, cfg, total_steps=8, inner_lr=0.05)
    store = ObjectStore(u)
    old = json.loads(store.get(MANIFEST))
    flat = {key: old["sync"][section][field] for key, (section, field) in FLAT_KEYS.items()
            if key != "split_tensors"}
    old["sync"], old["config"] = flat, {"sync": dict(flat)}
    store.put(MANIFEST, json.dumps(old).encode())

    ex = open_run(store)
    assert ex.manifest.sync["split_tensors"] is False
    assert ex.manifest.config["sync"]["split_tensors"] is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an old run is read without a warning
        resumed = SyncConfig.stored(ex.manifest.sync)
    assert not resumed.schedule.split_tensors
    model = Blocks()
    whole = plan_for(model, resumed)
    assert all(s.whole for f in whole.fragments for s in f.params)
    Synchronizer(model, ex, "w0", whole, initialise=False).close()
    with pytest.raises(ValueError, match="fragment 0"):  # what the default would plan
        plan_for(model, resumed.changed(schedule={"split_tensors": True})).check_against(
            ex.manifest.model_dump()["fragments"])
    _, params = canonical_after(ex, resumed)
    for i, flat in enumerate(params):
        assert torch.equal(flat, res.aggregator.canonical(i))


def test_manifest_entries_carry_slices_and_check_them():
    plan = plan_for(Blocks(), CONFIGS[4])
    entries = [FragmentEntry.model_validate(d) for d in plan.describe()]
    assert [e.model_dump() for e in entries] == plan.describe()
    bad = plan.describe()[1]
    bad["params"][0]["slice"] = [0, 10_000]
    with pytest.raises(ValueError, match=r"slice \[0, 10000\] must be"):
        FragmentEntry.model_validate(bad)


MICRO = [
    "model.overrides={d_model: 32, n_layers: 2, n_heads: 2, max_seq_len: 64}",
    "data.seq_len=16", "data.batch_size=4", "train.steps=8", "sync.schedule.sync_every=4",
    "sync.schedule.fragments=2", "sync.schedule.overlap=1",
]


@pytest.mark.parametrize("child", [["sync.schedule.split_tensors=false"], ["sync.schedule.fragments=1"]])
def test_a_continuation_with_other_fragments_starts_from_the_parents_model(tmp_path, child):
    """The parent's canonical model is read with the parent's fragments (split at
    P = 2), then cut the child's way: the child's initial parameters are the parent's
    model, tensor for tensor."""
    from workers.config import load_config  # noqa: PLC0415 - the worker layer, only here
    from workers.data.prepare import prepare_data  # noqa: PLC0415
    from workers.export import canonical_model  # noqa: PLC0415
    from workers.runs import continuation, create_run  # noqa: PLC0415

    data_url = str(tmp_path / "data")
    prepare_data(["builtin:shakespeare/tragedies/*"], data_url, max_bytes=20_000)
    parent_url = str(tmp_path / "parent")
    create_run(load_config("tiny", [*MICRO, f"data.dataset={data_url}"]), parent_url)
    parent = canonical_model(open_run(parent_url), 0)  # reassembled from split pieces
    described = open_run(parent_url).manifest.model_dump()["fragments"]
    assert any("slice" in p for f in described for p in f["params"])

    cfg = continuation(parent_url, child)
    child_ex = create_run(cfg, str(tmp_path / "child"), init_from=parent_url)
    model = canonical_model(child_ex, 0).model
    assert [f.numel for f in child_ex.manifest.fragments] != [f["numel"] for f in described]
    for name, value in parent.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
