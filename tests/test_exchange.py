"""The exchange protocol on every backend: what workers and aggregators rely on.

Every test runs on memory://, file:// and s3:// (moto's server and SeaweedFS on
loopback, or DILOCO_TEST_S3_ENDPOINT) through the ``make_store`` fixture of
conftest.py. Each
simulated party (workers w0, w1, w2 and the aggregator ``agg``) has its own
`ObjectStore`, so traffic is counted per party as it would be across regions; a
separate ``vandal`` store damages objects the way a bad disk, an interrupted
upload or a buggy writer would.

Run: ``.venv/bin/pytest tests/test_exchange.py -q`` (``-m "not s3"`` skips S3).

The run used throughout: fragment 0 holds 1000 values (one 100 x 10 weight),
fragment 1 holds 300 (a 20 x 10 weight and a 100-vector bias); outer gradients go
up as int4 and means come down as int8, both with blocks of B = 128.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np
import pytest

from storage import layout
from storage.codecs import CodecSpec, encoded_nbytes, roundtrip
from storage.errors import (
    CorruptObject,
    ManifestInvalid,
    NonFiniteValues,
    ObjectMissing,
    PartialObject,
    RunExists,
    ShapeMismatch,
)
from storage.exchange import Exchange, Published
from storage.objectstore import ObjectStore, RetryPolicy
from storage.spec import (
    CodecEntry,
    FragmentEntry,
    ParamEntry,
    RunManifest,
    read_manifest,
    write_manifest,
)

FAST = RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.005)
WORKERS = ["w0", "w1", "w2"]
CODECS = ["none", "int8", "int4"]
B = 128
N0, N1 = 1000, 300  # values in fragments 0 and 1


def fragment_entries(n0: int = N0) -> list[FragmentEntry]:
    return [
        FragmentEntry(
            index=0, numel=n0, params=[ParamEntry(name="blocks.0.weight", shape=[n0 // 10, 10])]
        ),
        FragmentEntry(
            index=1,
            numel=N1,  # 20 * 10 + 100 = 300
            params=[
                ParamEntry(name="blocks.1.weight", shape=[20, 10]),
                ParamEntry(name="blocks.1.bias", shape=[100]),
            ],
        ),
    ]


def make_manifest(codec_up: str = "int4", codec_down: str = "int8", n0: int = N0) -> RunManifest:
    return RunManifest(
        run_id="run-test",
        workers=WORKERS,
        total_steps=40,
        rounds=[4, 4],
        codec_up=CodecEntry(name=codec_up, block_size=B),
        codec_down=CodecEntry(name=codec_down, block_size=B),
        fragments=fragment_entries(n0),
        sync={"sync_every": 10, "split_tensors": True},  # as every new manifest has it
        config={"model": "tiny"},
    )


def gradient(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32)


def bits(x: np.ndarray) -> np.ndarray:
    """The uint32 bit patterns of float32 values: equal bits, not merely equal floats."""
    assert x.dtype == np.float32
    return x.view(np.uint32)


@dataclass
class Run:
    """One run in the store and an Exchange per party, each on its own ObjectStore."""

    manifest: RunManifest
    parties: dict[str, Exchange]
    vandal: ObjectStore  # damages objects; its traffic is nobody's

    def __getitem__(self, name: str) -> Exchange:
        return self.parties[name]


@pytest.fixture
def new_run(make_store) -> Callable[..., Run]:
    """``new_run(codec_up="int4")``: create the run, open it from every party."""

    def make(codec_up: str = "int4", codec_down: str = "int8") -> Run:
        manifest = make_manifest(codec_up, codec_down)
        write_manifest(make_store("admin"), manifest)
        parties = {}
        for name in [*WORKERS, "agg"]:
            store = make_store(name, retry=FAST)
            parties[name] = Exchange(store, read_manifest(store))
            store.traffic.reset()  # count the exchange only, not reading run.json
        return Run(manifest, parties, make_store("vandal", retry=FAST))

    return make


@pytest.fixture
def run(new_run) -> Run:
    return new_run()


def assert_refused(error: type[Exception], fn: Callable[[], Any], *needles: str) -> str:
    """``fn()`` must raise ``error`` (never return an array, zeros or otherwise), with
    every needle in its message; returns the message."""
    try:
        result = fn()
    except error as exc:
        message = str(exc)
        for needle in needles:
            assert needle in message, f"{needle!r} not in {message!r}"
        return message
    pytest.fail(f"expected {error!r} to be raised, got a {type(result).__name__} back")


def forge_commit(run: Run, fragment: int, round: int, worker: str, commit: dict) -> None:
    """Overwrite a worker's commit record (only a buggy or hostile writer would)."""
    key = layout.delta_commit(fragment, round, worker)
    run.vandal.put(key, json.dumps(commit, sort_keys=True).encode())


def chunk_key(commit: dict) -> str:
    """A 1-D payload of <= 2**26 values is one zarr chunk, ``c/0``."""
    assert set(commit["objects"]) == {"zarr.json", "c/0"}
    return f"{commit['payload']}/c/0"


# -- the run manifest -----------------------------------------------------------------


def test_open_run_returns_the_manifest_created(make_store):
    store = make_store()
    manifest = make_manifest()
    write_manifest(store, manifest)
    opened = read_manifest(make_store("other"))
    assert opened == manifest
    assert opened.numel(0) == 1000 and opened.numel(1) == 300  # 20 * 10 + 100


def test_create_run_twice_raises_run_exists_naming_the_url(make_store):
    store = make_store()
    write_manifest(store, make_manifest())
    before = store.get(layout.MANIFEST)
    assert_refused(
        RunExists,
        lambda: write_manifest(make_store("second"), make_manifest(codec_up="int8")),
        store.full_url(layout.MANIFEST),
    )
    assert store.get(layout.MANIFEST) == before  # the first manifest stays


def test_open_run_without_manifest_names_the_url(make_store):
    store = make_store()
    assert_refused(ManifestInvalid, lambda: read_manifest(store), store.full_url(layout.MANIFEST))


def test_open_run_with_garbage_json(make_store):
    store = make_store()
    store.put(layout.MANIFEST, b'{"format": "diloco-flows/run/1", "run_id": ')
    assert_refused(
        ManifestInvalid, lambda: read_manifest(store), store.full_url(layout.MANIFEST), "not valid JSON"
    )


def _write_manifest_dict(store: ObjectStore, edit: Callable[[dict], None]) -> None:
    data = json.loads(make_manifest().to_json())
    edit(data)
    store.put(layout.MANIFEST, json.dumps(data).encode())


def test_open_run_with_unknown_field(make_store):
    store = make_store()
    _write_manifest_dict(store, lambda d: d.update(codec_upp={"name": "int4"}))
    assert_refused(
        ManifestInvalid, lambda: read_manifest(store), store.full_url(layout.MANIFEST), "codec_upp"
    )


def test_open_run_with_fragment_numel_not_matching_param_shapes(make_store):
    store = make_store()

    def edit(d: dict) -> None:
        d["fragments"][1]["numel"] = 301  # its params hold 20 * 10 + 100 = 300

    _write_manifest_dict(store, edit)
    assert_refused(
        ManifestInvalid,
        lambda: read_manifest(store),
        store.full_url(layout.MANIFEST),
        "fragments.1",
        "numel 301 != sum of parameter sizes 300",
    )


def test_open_run_with_unknown_codec(make_store):
    store = make_store()
    _write_manifest_dict(store, lambda d: d["codec_down"].update(name="int3"))
    assert_refused(
        ManifestInvalid,
        lambda: read_manifest(store),
        store.full_url(layout.MANIFEST),
        "'int3'",
        "allowed: none, fp16, int8, int4, fp4-e3m0",
    )


def test_open_run_with_unknown_codec_names_the_field(make_store):
    store = make_store()
    _write_manifest_dict(store, lambda d: d["codec_down"].update(name="int3"))
    message = assert_refused(ManifestInvalid, lambda: read_manifest(store))
    # as a location ("codec_down", "codec_down.name: ..."), not inside pydantic's
    # echo of the input ("{'codec_down': {...") which names every field
    assert re.search(r"(?<!')\bcodec_down\b(?!')", message), message


# -- publish, discover, fetch -----------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
def test_publish_then_discover_and_fetch_bit_for_bit(new_run, codec):
    run = new_run(codec_up=codec)
    x0 = gradient(N0, seed=0)
    # hand-made first block: absmax s = 7; int4 (qmax 7) has step s / 7 = 1, so
    # 7 -> 7, 3.5 -> rint(3.5) = 4 (half to even), 1 -> 1
    x0[:B] = 0.0
    x0[:3] = [7.0, 3.5, 1.0]
    sent = {
        "w0": run["w0"].publish_delta(0, 0, "w0", x0, tokens=4096),
        "w1": run["w1"].publish_delta(0, 0, "w1", gradient(N0, seed=1), tokens=2048),
        "w2": run["w2"].publish_delta(1, 0, "w2", gradient(N1, seed=2), tokens=1024),
    }
    assert all(p.created for p in sent.values())
    agg = run["agg"]
    assert agg.committed_workers(0, 0) == ["w0", "w1"]
    assert agg.committed_workers(1, 0) == ["w2"]
    assert agg.committed_workers(0, 1) == []  # nothing in the next round yet

    for worker, fragment, tokens in [("w0", 0, 4096), ("w1", 0, 2048), ("w2", 1, 1024)]:
        value, commit = agg.fetch_delta(fragment, 0, worker)
        assert value.dtype == np.float32 and value.shape == (run.manifest.numel(fragment),)
        np.testing.assert_array_equal(bits(value), bits(sent[worker].decoded))
        assert commit["tokens"] == tokens and commit["worker"] == worker
        assert commit["codec"] == {"name": codec, "block_size": B}
        assert commit == sent[worker].commit

    decoded = sent["w0"].decoded
    expected_first = {"none": [7.0, 3.5, 1.0], "int4": [7.0, 4.0, 1.0]}.get(codec)
    if expected_first is not None:
        np.testing.assert_array_equal(decoded[:3], expected_first)
    if codec == "none":
        np.testing.assert_array_equal(bits(decoded), bits(x0))
    else:
        # the published value is the pinned codec's decode(encode(x)) (docs/algorithms.md section 7)
        _, reference = roundtrip(x0, CodecSpec(codec, B))
        np.testing.assert_array_equal(bits(decoded), bits(reference))


def test_uncommitted_payload_is_not_discovered(run):
    prepared = run["w1"].prepare_delta(0, 0, "w1", gradient(N0, seed=1))
    run["w1"].store.put_many(prepared.blobs)  # uploaded, then the worker died
    agg = run["agg"]
    assert agg.store.list(prepared.payload)  # the bytes are there ...
    assert agg.committed_workers(0, 0) == []  # ... but nobody sees them
    assert_refused(
        ObjectMissing,
        lambda: agg.fetch_delta(0, 0, "w1"),
        agg.store.full_url(layout.delta_commit(0, 0, "w1")),
    )


def test_second_publish_returns_the_first_value(run):
    w0 = run["w0"]
    first = w0.publish_delta(0, 2, "w0", gradient(N0, seed=10), tokens=100)
    again = w0.publish_delta(0, 2, "w0", gradient(N0, seed=11), tokens=999)  # a restart
    assert first.created and not again.created
    np.testing.assert_array_equal(bits(again.decoded), bits(first.decoded))
    assert again.commit == first.commit and again.commit["tokens"] == 100
    value, _ = run["agg"].fetch_delta(0, 2, "w0")
    np.testing.assert_array_equal(bits(value), bits(first.decoded))
    # exactly one commit and one payload: the second attempt uploaded nothing
    keys = run.vandal.list(layout.round_prefix(0, 2))
    assert keys == sorted(
        [layout.delta_commit(0, 2, "w0")]
        + [f"{first.commit['payload']}/{name}" for name in first.commit["objects"]]
    )


def test_publish_rejects_wrong_shape_before_any_io(run):
    w0 = run["w0"]
    assert_refused(
        ShapeMismatch,
        lambda: w0.publish_delta(0, 0, "w0", gradient(N1, seed=0), tokens=1),
        "worker w0", "fragment 0 round 0", "(1000,)",
    )
    assert w0.store.traffic.requests == 0


# -- failure modes: each its own error, naming the object --------------------------------


@pytest.fixture
def published(run) -> tuple[Run, Published]:
    """w1's int4 outer gradient of fragment 0 round 3, and w0's beside it."""
    run["w0"].publish_delta(0, 3, "w0", gradient(N0, seed=0), tokens=10)
    return run, run["w1"].publish_delta(0, 3, "w1", gradient(N0, seed=1), tokens=10)


def test_commit_with_a_deleted_part_is_partial(published):
    run, pub = published
    key = chunk_key(pub.commit)
    run.vandal.delete_prefix(f"{pub.commit['payload']}/c")
    assert not run.vandal.exists(key)
    agg = run["agg"]
    assert agg.committed_workers(0, 3) == ["w0", "w1"]  # listing does not verify ...
    assert_refused(
        PartialObject,
        lambda: agg.fetch_delta(0, 3, "w1"),  # ... fetching does
        "worker w1", "fragment 0 round 3", agg.store.full_url(key),
    )
    agg.fetch_delta(0, 3, "w0")  # one bad contribution spoils nothing else


def test_commit_with_a_truncated_part_is_partial(published):
    run, pub = published
    key = chunk_key(pub.commit)
    body = run.vandal.get(key)
    # int4, 1000 values, B = 128: 8 scales * 4 + 500 code bytes = 532, + 4 crc32c = 536
    assert len(body) == encoded_nbytes(N0, CodecSpec("int4", B)) + 4 == 536
    run.vandal.put(key, body[:-1])
    agg = run["agg"]
    assert_refused(
        PartialObject,
        lambda: agg.fetch_delta(0, 3, "w1"),
        "worker w1", "fragment 0 round 3", agg.store.full_url(key), "535 bytes",
        "its commit says 536",
    )


@pytest.mark.parametrize("fix_sha", [False, True], ids=["sha256-catches", "crc32c-catches"])
def test_flipped_byte_is_corrupt(published, fix_sha):
    """With the commit's sha256 left alone it catches the flip; with the sha256
    rewritten to match (a writer that hashed bad bytes), the chunk's crc32c does."""
    run, pub = published
    key = chunk_key(pub.commit)
    body = bytearray(run.vandal.get(key))
    body[100] ^= 0x01  # a code byte (after the 32 bytes of scales)
    run.vandal.put(key, bytes(body))
    if fix_sha:
        commit = json.loads(json.dumps(pub.commit))
        commit["objects"]["c/0"]["sha256"] = hashlib.sha256(bytes(body)).hexdigest()
        forge_commit(run, 0, 3, "w1", commit)
    agg = run["agg"]
    needle = "sha256" if not fix_sha else "checksum do not match"
    assert_refused(
        CorruptObject, lambda: agg.fetch_delta(0, 3, "w1"),
        "worker w1", "fragment 0 round 3", needle,
    )


def test_commit_with_wrong_numel_is_a_shape_mismatch(published):
    run, pub = published
    commit = dict(pub.commit, numel=999)
    forge_commit(run, 0, 3, "w1", commit)
    assert_refused(
        ShapeMismatch,
        lambda: run["agg"].fetch_delta(0, 3, "w1"),
        "worker w1", "fragment 0 round 3", "999 values, the run expects 1000",
    )


@pytest.mark.parametrize("forge_numel", [False, True], ids=["honest-commit", "forged-numel"])
def test_payload_of_another_size_is_a_shape_mismatch(run, make_store, forge_numel):
    """w2 runs with a manifest that says fragment 0 has 1200 values. Its commit says
    1200 (caught from the commit); forged to say 1000, the zarr shape gives it away."""
    bigger = Exchange(make_store("w2-stale", retry=FAST), make_manifest(n0=1200))
    pub = bigger.publish_delta(0, 1, "w2", gradient(1200, seed=2), tokens=5)
    assert pub.created and pub.commit["numel"] == 1200
    needle = "1200 values, the run expects 1000"
    if forge_numel:
        forge_commit(run, 0, 1, "w2", dict(pub.commit, numel=1000))
        needle = "shape (1200,), expected (1000,)"
    assert_refused(
        ShapeMismatch,
        lambda: run["agg"].fetch_delta(0, 1, "w2"),
        "worker w2", "fragment 0 round 1", needle,
    )


def test_commit_with_another_codec_is_corrupt(published):
    run, pub = published
    forge_commit(run, 0, 3, "w1", dict(pub.commit, codec={"name": "int8", "block_size": B}))
    assert_refused(
        CorruptObject, lambda: run["agg"].fetch_delta(0, 3, "w1"),
        "worker w1", "fragment 0 round 3", "int8",
    )


def test_commit_that_is_not_json_is_corrupt(published):
    run, _ = published
    key = layout.delta_commit(0, 3, "w1")
    run.vandal.put(key, b'{"kind": "delta", "payl')
    assert_refused(
        CorruptObject, lambda: run["agg"].fetch_delta(0, 3, "w1"), run.vandal.full_url(key)
    )


def _nan_payload(run: Run) -> None:
    """w1's codec-none payload of fragment 0 round 0 with a NaN written in, and its
    crc32c, sha256 and size made consistent: only a NaN check can catch it."""
    x = gradient(N0, seed=1)
    pub = run["w1"].publish_delta(0, 0, "w1", x, tokens=10)
    key = chunk_key(pub.commit)
    body = run.vandal.get(key)
    # codec none: 1000 float32 = 4000 bytes, then the crc32c of those bytes, little-endian
    assert len(body) == 4 * N0 + 4 == 4004
    assert body[:-4] == x.tobytes()
    assert body[-4:] == np.uint32(google_crc32c.value(body[:-4])).tobytes()  # we can forge it
    values = x.copy()
    values[17] = np.nan
    data = values.tobytes()
    forged = data + np.uint32(google_crc32c.value(data)).tobytes()
    run.vandal.put(key, forged)
    commit = json.loads(json.dumps(pub.commit))
    commit["objects"]["c/0"] = {"size": len(forged), "sha256": hashlib.sha256(forged).hexdigest()}
    forge_commit(run, 0, 0, "w1", commit)


def test_nan_contribution_is_non_finite_values(new_run):
    run = new_run(codec_up="none")
    _nan_payload(run)
    assert_refused(
        NonFiniteValues, lambda: run["agg"].fetch_delta(0, 0, "w1"),
        "worker w1", "fragment 0 round 0", "NaN", "not applied",
    )


def test_commit_that_omits_a_chunk_is_partial_not_zeros(published):
    run, pub = published
    commit = json.loads(json.dumps(pub.commit))
    del commit["objects"]["c/0"]
    forge_commit(run, 0, 3, "w1", commit)
    assert_refused(
        PartialObject, lambda: run["agg"].fetch_delta(0, 3, "w1"), "worker w1",
        "fragment 0 round 3",
    )


def test_fetch_mean_before_any_mean_is_none(run):
    assert run["w0"].fetch_mean(0, 0) is None
    assert run["w0"].mean_commit(1, 3) is None
    run["w0"].publish_delta(0, 0, "w0", gradient(N0, seed=0), tokens=1)
    assert run["w0"].fetch_mean(0, 0) is None  # deltas are not means


def test_corrupt_mean_is_refused(run):
    agg = run["agg"]
    pub = agg.publish_mean(1, 0, "agg", gradient(N1, seed=3), weights={"w2": 1.0})
    key = chunk_key(pub.commit)
    body = bytearray(run.vandal.get(key))
    body[-10] ^= 0x80
    run.vandal.put(key, bytes(body))
    assert_refused(
        CorruptObject, lambda: run["w2"].fetch_mean(1, 0), "mean of fragment 1 round 0"
    )


# -- means ------------------------------------------------------------------------------


def test_publish_mean_then_fetch_bit_for_bit(run):
    x = gradient(N0, seed=5)
    pub = run["agg"].publish_mean(0, 0, "agg", x, weights={"w1": 2048, "w0": 4096})
    assert pub.created
    _, reference = roundtrip(x, CodecSpec("int8", B))  # codec_down
    np.testing.assert_array_equal(bits(pub.decoded), bits(reference))
    for worker in WORKERS:
        value, commit = run[worker].fetch_mean(0, 0)
        np.testing.assert_array_equal(bits(value), bits(pub.decoded))
        assert commit["weights"] == {"w0": 4096.0, "w1": 2048.0}
        assert commit["writer"] == "agg"


def test_racing_aggregators_publish_exactly_one_mean(run, make_store):
    """Two aggregators publish the means of 8 rounds, released together by a barrier
    each round, with different inputs: one wins each round and both return its mean."""
    rounds = 8
    racers = {
        name: Exchange(make_store(name, retry=FAST), run.manifest) for name in ("agg-a", "agg-b")
    }
    inputs = {
        (name, r): gradient(N1, seed=100 * i + r)
        for i, name in enumerate(racers)
        for r in range(rounds)
    }
    barrier = threading.Barrier(len(racers))

    def race(name: str) -> list[Published]:
        out = []
        for r in range(rounds):
            barrier.wait(timeout=30)
            out.append(
                racers[name].publish_mean(1, r, name, inputs[name, r], weights={"w2": 1.0})
            )
        return out

    with ThreadPoolExecutor(len(racers)) as pool:
        futures = {name: pool.submit(race, name) for name in racers}
        results = {name: f.result(timeout=60) for name, f in futures.items()}

    for r in range(rounds):
        a, b = results["agg-a"][r], results["agg-b"][r]
        assert sorted([a.created, b.created]) == [False, True]
        np.testing.assert_array_equal(bits(a.decoded), bits(b.decoded))
        assert a.commit == b.commit
        winner = a.commit["writer"]
        _, reference = roundtrip(inputs[winner, r], CodecSpec("int8", B))
        np.testing.assert_array_equal(bits(a.decoded), bits(reference))
        mean_commits = [
            k for k in run.vandal.list(layout.round_prefix(1, r)) if k.endswith("mean.json")
        ]
        assert mean_commits == [layout.mean_commit(1, r)]
        value, _ = run["w2"].fetch_mean(1, r)
        np.testing.assert_array_equal(bits(value), bits(a.decoded))


# -- rejections -------------------------------------------------------------------------


def test_rejections_round_trip(run):
    agg = run["agg"]
    assert agg.rejections(0, 0) == {}
    agg.record_rejection(0, 0, "w1", "PartialObject: c/0 missing")
    agg.record_rejection(0, 0, "w2", "deadline passed")
    agg.record_rejection(0, 0, "w1", "a second opinion")  # the first note wins
    agg.record_rejection(1, 0, "w0", "NonFiniteValues")
    assert run["w0"].rejections(0, 0) == {
        "w1": "PartialObject: c/0 missing",
        "w2": "deadline passed",
    }
    assert run["w0"].rejections(1, 0) == {"w0": "NonFiniteValues"}
    assert agg.rejections(0, 1) == {}
    assert agg.committed_workers(0, 0) == []  # a rejection is not a contribution


# -- traffic ----------------------------------------------------------------------------


def test_traffic_is_counted_per_party(run):
    w0, w1, agg = run["w0"], run["w1"], run["agg"]
    pub = w0.publish_delta(0, 0, "w0", gradient(N0, seed=0), tokens=8)
    commit_key = layout.delta_commit(0, 0, "w0")
    commit_bytes = len(run.vandal.get(commit_key))
    parts = {f"{pub.commit['payload']}/{k}": v["size"] for k, v in pub.commit["objects"].items()}
    # int4, 1000 values, B = 128: ceil(1000/128) = 8 scales * 4 + 1000/2 code bytes = 532
    payload = encoded_nbytes(N0, CodecSpec("int4", B))
    assert payload == 532
    assert parts[chunk_key(pub.commit)] == payload + 4  # + the chunk's crc32c

    up = w0.store.traffic.snapshot()
    assert up["bytes_up"] >= payload
    assert up["bytes_up"] == sum(parts.values()) + commit_bytes  # bodies only
    assert up["objects_up"] == dict(sorted({**parts, commit_key: commit_bytes}.items()))
    assert up["bytes_down"] == 0 and up["retries"] == 0
    assert up["by_op"] == {"exists": 1, "put": 2, "put_if_absent": 1}
    assert w1.store.traffic.snapshot()["requests"] == 0  # w1 did nothing, counted nothing

    before = agg.store.traffic.bytes_down
    assert agg.committed_workers(0, 0) == ["w0"]
    agg.fetch_delta(0, 0, "w0")
    down = agg.store.traffic.snapshot()
    assert down["bytes_down"] - before == sum(parts.values()) + commit_bytes
    assert down["objects_down"] == up["objects_up"]
    assert down["bytes_up"] == 0

    w1.publish_delta(1, 0, "w1", gradient(N1, seed=1), tokens=8)
    # fragment 1, 300 values: ceil(300/128) = 3 scales * 4 + 150 code bytes = 162
    assert encoded_nbytes(N1, CodecSpec("int4", B)) == 162
    assert w1.store.traffic.bytes_up >= 162 + 4
    assert w0.store.traffic.snapshot() == up  # w1's upload is not on w0's counter


# -- transient faults -------------------------------------------------------------------


class FlakyWrites:
    """Raises ConnectionResetError on the first ``failures`` calls, then delegates."""

    def __init__(self, method: Callable[..., Any], failures: int) -> None:
        self.method, self.failures, self.calls = method, failures, 0

    def _fail(self) -> bool:
        self.calls += 1
        return self.calls <= self.failures

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fail():
            raise ConnectionResetError("injected reset")
        return self.method(*args, **kwargs)

    async def call_async(self, *args: Any, **kwargs: Any) -> Any:
        if self._fail():
            raise ConnectionResetError("injected reset")
        return await self.method(*args, **kwargs)


def inject_write_faults(store: ObjectStore, monkeypatch: pytest.MonkeyPatch, failures: int):
    """Make the store's raw object writes fail ``failures`` times.

    Where a write reaches the backend: s3fs's coroutine ``_pipe_file`` (what
    ``put_many`` gathers), fsspec's memory ``pipe_file``; the file backend writes with
    ``open`` and ``os.replace`` rather than through fsspec, so its ``_put_raw`` is
    wrapped instead.
    """
    if store.url.startswith("s3://"):
        flaky = FlakyWrites(store.fs._pipe_file, failures)
        assert inspect.iscoroutinefunction(store.fs._pipe_file)
        monkeypatch.setattr(store.fs, "_pipe_file", flaky.call_async)
    elif store.url.startswith("memory://"):
        flaky = FlakyWrites(store.fs.pipe_file, failures)
        monkeypatch.setattr(store.fs, "pipe_file", flaky)
    else:
        flaky = FlakyWrites(store._put_raw, failures)
        monkeypatch.setattr(store, "_put_raw", flaky)
    return flaky


def test_publish_survives_transient_write_faults(run, monkeypatch):
    w0 = run["w0"]
    flaky = inject_write_faults(w0.store, monkeypatch, failures=2)
    pub = w0.publish_delta(0, 0, "w0", gradient(N0, seed=0), tokens=3)
    monkeypatch.undo()
    assert pub.created and flaky.calls >= 4  # 2 resets + zarr.json and c/0 written
    snap = w0.store.traffic.snapshot()
    # put_many writes zarr.json and c/0 together: both fail once (2 retries), then land
    assert snap["retries"] == 2 and snap["retries_by_op"] == {"put": 2}
    assert snap["by_op"]["put"] == 4  # 2 failed attempts + 2 that landed
    value, _ = run["agg"].fetch_delta(0, 0, "w0")
    np.testing.assert_array_equal(bits(value), bits(pub.decoded))


@pytest.mark.parametrize("codec", ["none", "fp16", "int8", "int4", "fp4-e3m0"])
@pytest.mark.parametrize("n", [1, 127, 128, 1000, 4099])
def test_fast_encoding_is_byte_identical_to_zarr(codec, n):
    """encode_array builds one-chunk coded vectors without zarr's write path; the
    objects must be exactly what zarr writes, so any zarr reader decodes them."""
    from storage.arrays import encode_array, encode_array_with_zarr  # noqa: PLC0415
    from storage.codecs import CodecSpec  # noqa: PLC0415

    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    spec = CodecSpec(codec, 128)
    blobs, _record, decoded = encode_array("p", x, spec)
    assert blobs == encode_array_with_zarr("p", x, spec)
    reference = encode_array_with_zarr("q", x, spec)
    assert set(reference) == {"q/zarr.json", "q/c/0"}
    from storage.codecs import roundtrip  # noqa: PLC0415

    assert np.array_equal(decoded, roundtrip(x, spec)[1])


@pytest.mark.parametrize("codec", ["none", "fp16", "int8", "int4", "fp4-e3m0", "topk2"])
@pytest.mark.parametrize(("n", "parts"), [(4500, 1), (5001, 2), (1300, 2), (10000, 4)])
def test_chunked_encoding_is_byte_identical_to_zarr(codec, n, parts, monkeypatch):
    """Above one chunk (MAX_CHUNK made small) or for a sharded aggregator, encode_array
    encodes chunk by chunk straight into the decoded array: the objects must be zarr's
    (its last chunk padded with zeros), the decoded value what zarr reads back."""
    from storage import arrays  # noqa: PLC0415
    from storage.codecs import CodecSpec  # noqa: PLC0415

    monkeypatch.setattr(arrays, "MAX_CHUNK", 2048)
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    spec = CodecSpec(codec, 128, chunk=512, k=10)
    blobs, record, decoded = arrays.encode_array("p", x, spec, parts, 256)
    assert blobs == arrays.encode_array_with_zarr("p", x, spec, parts, 256)
    assert len(blobs) - 1 >= 2  # several chunks, not one
    store = ObjectStore(f"memory://chunked/{codec}-{n}-{parts}")
    store.put_many(blobs)
    zarr_read = arrays.read_array(store, "p", record, shape=(n,))
    assert np.array_equal(decoded.view(np.uint32), zarr_read.view(np.uint32))
