"""A sharded aggregator (aggregator.shards: K): K = 1 and K = 4 reach the same bits
(canonical state, momentum, residual and every mean), each shard reads only its own
chunk objects, bad contributions are rejected by all shards alike, and a shard
killed and restarted continues to the same bits."""

from __future__ import annotations

import hashlib
import re
import sys
import threading
import uuid
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch
from torch import nn

from diloco.aggregator import Aggregator
from diloco.config import SyncConfig
from diloco.run import latest_global, new_run, open_run
from diloco.shards import ShardAggregator
from replicas import Blocks
from storage import layout
from storage.checkpoints import read_checkpoint
from storage.exchange import Prepared
from storage.objectstore import ObjectStore
from storage.shards import fetch_delta_part, span

CFG = SyncConfig(
    schedule={"mode": "diloco", "sync_every": 2, "fragments": 2},
    codec={"up": "int4", "down": "int4", "block_size": 32},
    guard={"ratio": 5.0, "warmup": 1},
)
ROUNDS = 4
WORKERS = ("w0", "w1", "w2")


def model() -> nn.Module:
    return Blocks(width=48, depth=4)  # fragments of about 4,700 values


def make_run(shards: int, bad: dict[tuple[int, int, str], str] | None = None,
             cfg: SyncConfig = CFG) -> str:
    """A run with every contribution of every round committed up front: the same
    values whatever K (seeded per fragment, round and worker); ``bad`` spoils some."""
    u = f"memory://shards/{uuid.uuid4().hex}"
    new_run(ObjectStore(u), model(), cfg, workers=list(WORKERS), total_steps=2 * ROUNDS,
            user_config={"aggregator": {"shards": shards}})
    ex = open_run(ObjectStore(u))
    for p, rounds in enumerate(ex.manifest.rounds):
        for r in range(rounds):
            for i, w in enumerate(WORKERS):
                rng = np.random.default_rng(1000 * r + 10 * p + i)
                x = rng.standard_normal(ex.manifest.numel(p)).astype(np.float32) * 0.01
                how = (bad or {}).get((p, r, w))
                if how == "huge":
                    x *= 1000
                prepared = ex.prepare_delta(p, r, w, x)
                if how == "nan":  # a NaN in its last chunk, checksums made to match
                    spoil_last_chunk(prepared)
                commit = ex.publish_prepared(prepared, tokens=10 + i).commit
                if how == "corrupt":  # its last chunk: only the last shard reads it
                    last = max(k for k in commit["objects"] if k.startswith("c/"))
                    key = f"{commit['payload']}/{last}"
                    blob = bytearray(ex.store.get(key))
                    blob[-1] ^= 0xFF
                    ex.store.put(key, bytes(blob))
    return u


def spoil_last_chunk(prepared: Prepared) -> None:
    """Put a NaN in the last zarr chunk of an uncompressed (codec none) contribution,
    with its crc32c and sha256 made to match: only decoding that chunk finds it."""
    last = max((k for k in prepared.record if k.startswith("c/")), key=lambda k: int(k[2:]))
    key = f"{prepared.payload}/{last}"
    payload = bytearray(prepared.blobs[key][:-4])
    payload[4:8] = np.array([np.nan], "<f4").tobytes()
    blob = bytes(payload) + np.array([google_crc32c.value(bytes(payload))], "<u4").tobytes()
    prepared.blobs[key] = blob
    prepared.record[last] = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}


def aggregate(u: str, shards: int, fault=None) -> list[Aggregator]:
    """Run the aggregator (K = 1) or its K shards, each in its own thread, to the end."""
    if shards == 1:
        agg = Aggregator(open_run(ObjectStore(u)))
        agg.run(timeout=20.0, poll_interval=0.01)
        return [agg]
    out: list[Aggregator | None] = [None] * shards
    errors: list[BaseException] = []

    def one(s: int) -> None:
        try:
            while True:
                a = ShardAggregator(open_run(ObjectStore(u)), shard=s,
                                    fault=fault and (lambda st, p, r, s=s: fault(s, st, p, r)))
                try:
                    a.run(timeout=20.0, poll_interval=0.01)
                    out[s] = a
                    return
                except Killed:
                    continue
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(s,)) for s in range(shards)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40.0)
    assert not errors, errors
    return out


class Killed(Exception):
    pass


def store_rounds(u: str) -> list[int]:
    return open_run(ObjectStore(u)).manifest.rounds


def canonical(u: str) -> list[dict[str, np.ndarray]]:
    ex = open_run(ObjectStore(u))
    return [read_checkpoint(ex.store, latest_global(ex, p)[1])[0]
            for p in range(len(ex.manifest.fragments))]


def means(u: str) -> list[tuple[np.ndarray, dict]]:
    ex = open_run(ObjectStore(u))
    return [ex.fetch_mean(p, r) for p in range(len(ex.manifest.fragments))
            for r in range(ex.manifest.rounds[p])]


def assert_same_bits(u1: str, u4: str) -> None:
    for a, b in zip(canonical(u1), canonical(u4), strict=True):
        assert sorted(a) == sorted(b) == ["momentum", "params", "residual"]
        for name in a:
            assert a[name].tobytes() == b[name].tobytes(), name
    for (m1, c1), (m4, c4) in zip(means(u1), means(u4), strict=True):
        assert m1.tobytes() == m4.tobytes()
        assert c1["weights"] == c4["weights"] and c1["rejected"].keys() == c4["rejected"].keys()
        assert c4["shards"] == 4 and "shards" not in c1


@pytest.fixture(scope="module")
def reference() -> tuple[str, Aggregator]:
    """The K = 1 run of CFG aggregated to the end, which every K = 4 run of CFG must
    match bit for bit (`make_run` is seeded: the same contributions every time); the
    tests only read it."""
    u1 = make_run(1)
    [one] = aggregate(u1, 1)
    return u1, one


def test_one_and_four_shards_give_the_same_bits(reference):
    (u1, one), u4 = reference, make_run(4)
    shards = aggregate(u4, 4)
    assert_same_bits(u1, u4)
    for p in range(2):  # the shards' slices in memory are the canonical state too
        whole = torch.cat([s.canonical(p) for s in shards])
        assert torch.equal(whole, one.canonical(p))
    # K = 1 keeps today's layout: no decision, parts or checks
    keys = ObjectStore(u1).list("frag")
    assert not [k for k in keys if "/part/" in k or "/check/" in k or "decision" in k]
    assert all(k.endswith(("/c/0", "zarr.json", ".json")) for k in keys)


def test_a_shard_reads_only_its_own_chunk_objects():
    u = make_run(4)
    ex = open_run(ObjectStore(u))
    got: list[str] = []
    real = ex.store.get_many

    def counting(keys, *a, **k):
        got.extend(keys)
        return real(keys, *a, **k)

    ex.store.get_many = counting
    sp = span(ex, 0, 2)
    assert len(sp.chunks) == 1 and sp.lo > 0
    part, _ = fetch_delta_part(ex, 0, 0, "w1", sp)
    assert sorted(k.split("/", 6)[-1] for k in got) == ["c/2", "zarr.json"], got
    whole, _ = ex.fetch_delta(0, 0, "w1")
    assert part.tobytes() == whole[sp.lo:sp.hi].tobytes()


def test_bad_contributions_are_rejected_by_every_shard_alike():
    """A chunk only the last shard reads is corrupt, and a contribution is huge, which
    the norm guard sees only through the shards' summed squares: both rejected in
    K = 4 as in K = 1, with the same means and state."""
    bad = {(0, 1, "w2"): "corrupt", (1, 2, "w0"): "huge"}
    u1, u4 = make_run(1, bad), make_run(4, bad)
    aggregate(u1, 1)
    aggregate(u4, 4)
    assert_same_bits(u1, u4)
    ex = open_run(ObjectStore(u4))
    assert list(ex.rejections(0, 1)) == ["w2"]
    assert ex.rejections(0, 1)["w2"].startswith("CorruptObject")
    assert list(ex.rejections(1, 2)) == ["w0"]
    assert ex.rejections(1, 2)["w0"].startswith("OutsizedContribution")
    assert "w2" not in ex.fetch_mean(0, 1)[1]["weights"]


@pytest.mark.parametrize("stage", ["published", "stepped", "checkpointed"])
def test_a_killed_shard_resumes_to_the_same_bits(stage, reference):
    (u1, _), u4 = reference, make_run(4)
    kills = {(2, stage, 0, 1), (0, stage, 1, 2), (3, stage, 1, 0)}
    lock = threading.Lock()

    def fault(shard, st, p, r):
        with lock:
            if (shard, st, p, r) in kills:
                kills.discard((shard, st, p, r))
                raise Killed(f"shard {shard}: {st} {p} {r}")

    aggregate(u4, 4, fault)
    assert not kills
    assert_same_bits(u1, u4)
    # every shard's parts are create-only: one commit per (fragment, round, shard)
    store = ObjectStore(u4)
    for p in range(2):
        for r in range(store_rounds(u4)[p]):
            assert all(store.exists(layout.mean_part(p, r, s)) for s in range(4))


def test_the_peers_way_down_with_shards_carries_the_decision_only():
    """mean_from: peers with top-k up: the parts commit no payload, the mean a reader
    sums from the contributions is the K = 1 mean, and the state is the same."""
    cfg = SyncConfig(
        schedule={"mode": "diloco", "sync_every": 2, "fragments": 2},
        codec={"up": "topk2", "down": "none", "chunk": 512, "k": 16, "mean_from": "peers"},
    )
    u1, u4 = make_run(1, cfg=cfg), make_run(4, cfg=cfg)
    aggregate(u1, 1)
    aggregate(u4, 4)
    for a, b in zip(canonical(u1), canonical(u4), strict=True):
        assert a["params"].tobytes() == b["params"].tobytes()
        assert a["momentum"].tobytes() == b["momentum"].tobytes()
    for (m1, c1), (m4, c4) in zip(means(u1), means(u4), strict=True):
        assert m1.tobytes() == m4.tobytes()
        assert c4["mean_from"] == "peers" and c1["weights"] == c4["weights"]
    store = ObjectStore(u4)
    assert not [k for k in store.list("frag") if "/mean/" in k]


def test_shard_jobs_follow_shard_0_and_the_launchers_start_them(reference):
    """``python -m flows.aggregator --shard S`` (run_shard_job) reduces its slice until
    every round is done, to the K = 1 bits; a start launches K jobs, each named and
    commanded for its shard; a shard outside 1..K-1 is refused before anything runs."""
    from flows.aggregator import run_shard_job  # noqa: PLC0415 - Prefect is slow to import
    from flows.jobs import to_launch  # noqa: PLC0415
    from flows.launchers import DeploymentLauncher, LocalLauncher  # noqa: PLC0415

    (u1, _), u4 = reference, make_run(4)
    outs: dict[int, dict] = {}
    jobs = [threading.Thread(target=lambda s=s: outs.__setitem__(s, run_shard_job(u4, shard=s)))
            for s in (1, 2, 3)]
    for t in jobs:
        t.start()
    ShardAggregator(open_run(ObjectStore(u4)), shard=0).run(timeout=20.0, poll_interval=0.01)
    for t in jobs:
        t.join(20.0)
    assert [outs[s]["state"] for s in (1, 2, 3)] == ["finished"] * 3
    assert_same_bits(u1, u4)
    with pytest.raises(ValueError, match=r"--shard must be in 1\.\.3"):
        run_shard_job(u4, shard=4)
    ex = open_run(ObjectStore(u4))
    snap = {"aggregator": {}, "workers": {}}
    assert to_launch(ex, snap)[:4] == ["aggregator", "aggregator-s1", "aggregator-s2",
                                       "aggregator-s3"]
    assert LocalLauncher(detached=True).command(u4, "aggregator-s2")[-4:] == [
        "--run", u4, "--shard", "2"]
    remote = DeploymentLauncher(key="k")
    assert remote.deployment_for("aggregator-s3") == remote.deployment_for("aggregator")
    assert remote.parameters(u4, "aggregator-s3")["shard"] == 3


def test_diloco_run_with_two_aggregator_shards(tmp_path):
    """As a user runs it: ``--set aggregator.shards=2`` starts two aggregator jobs,
    every round is reduced with both workers, each shard commits its part of every
    mean, and the end-of-run gc keeps the parts' payloads (they are the mean)."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    from cli_runs import SHORT, clean_env  # noqa: PLC0415

    env = clean_env(tmp_path, shared_prefect=True, DILOCO_TRACKING="off")
    diloco = str(Path(sys.executable).parent / "diloco")
    done = subprocess.run([diloco, "run", *SHORT, "--set", "aggregator.shards=2"], cwd=tmp_path,
                          env=env, text=True, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "participation 100%, 0 rejected" in done.stdout
    said = " ".join(done.stdout.split())
    rounds = re.search(r"aggregator-s1 finished \((\d+)/(\d+) rounds\)", said)
    assert rounds and rounds[1] == rounds[2], said[-2000:]  # the report lists shard 1
    run = next(p for p in (tmp_path / "runs").iterdir() if p.name.startswith("tiny-"))
    store = ObjectStore(str(run))
    keys = set(store.list())
    last = max(k for k in keys if k.startswith("frag/0/") and k.endswith("/mean.json"))
    base = last.removesuffix("/mean.json")
    for s in (0, 1):
        part = json.loads(store.get(f"{base}/part/{s}.json"))
        assert any(k.startswith(part["payload"].rstrip("/") + "/") for k in keys), part
