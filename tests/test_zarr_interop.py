"""Every array a run stores is a zarr array that zarr itself opens and decodes to
the values the project's readers return, bit for bit.

The project writes chunks and decodes coded vectors without zarr's codec pipeline
(storage/arrays.py says why); these tests hold that fast path to zarr. A small
run is written through the normal writers (`Exchange.publish_delta` and
`publish_mean`, the shards' `publish_part`, `write_checkpoint` for the canonical
state and its initial value, `write_array` for lossless arrays of other dtypes and
shapes; worker checkpoints are torch.distributed.checkpoint, not zarr) into a local directory and into memory://, and
each array is opened with a plain ``zarr.open_array(store=..., mode="r")`` after
``import storage.zarr_codec`` (which registers the project's codec), through
zarr's LocalStore, its FsspecStore and an fsspec mapper: the values must equal the
project reader's, dtype, shape and bytes. For the lossy codecs that is the decoded
value, not the original.

Run: ``.venv/bin/pytest tests/test_zarr_interop.py -q``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import zarr
import zarr.storage

import storage.zarr_codec  # noqa: F401  registers diloco.blockquant with zarr
from storage import arrays, layout
from storage.checkpoints import read_checkpoint, write_checkpoint
from storage.codecs import CODEC_NAMES, CodecSpec
from storage.exchange import Exchange
from storage.objectstore import ObjectStore
from storage.shards import fetch_part, publish_part, span
from storage.spec import CodecEntry, FragmentEntry, ParamEntry, RunManifest

N0, N1 = 1000, 300  # values of fragments 0 and 1 (N0 pads the last chunk when sharded)
WORKERS = ["w0", "w1"]


def manifest(codec: str, shards: int) -> RunManifest:
    """Both ways in ``codec`` (small sparse chunks, so a payload has several), means
    published as payloads, ``shards`` aggregator shards."""
    entry = CodecEntry.of(CodecSpec(codec, 128, chunk=256, k=8))
    return RunManifest(
        run_id="run-interop", workers=WORKERS, total_steps=10, rounds=[2, 2],
        codec_up=entry, codec_down=entry,
        fragments=[
            FragmentEntry(index=0, numel=N0,
                          params=[ParamEntry(name="a.weight", shape=[N0 // 10, 10])]),
            FragmentEntry(index=1, numel=N1,
                          params=[ParamEntry(name="b.weight", shape=[N1])]),
        ],
        sync={"sync_every": 5, "mean_from": "aggregator"},
        config={"model": "tiny", "aggregator": {"shards": shards}},
    )


@pytest.fixture(params=["file", "memory"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[ObjectStore, Any]]:
    """(the run's store, ``open(prefix)``: the zarr stores that see ``prefix`` of it)."""
    if request.param == "file":
        root = tmp_path / "bucket"
        root.mkdir()

        def stores(prefix: str) -> list[Any]:
            return [zarr.storage.LocalStore(root / prefix, read_only=True),
                    zarr.storage.FsspecStore.from_url(f"file://{root}/{prefix}",
                                                      read_only=True),
                    fsspec.get_mapper(f"file://{root}/{prefix}")]

        yield ObjectStore(str(root)), stores
        return
    url = f"memory://interop-{uuid.uuid4().hex}"

    def memory_stores(prefix: str) -> list[Any]:
        return [zarr.storage.FsspecStore.from_url(f"{url}/{prefix}", read_only=True),
                fsspec.get_mapper(f"{url}/{prefix}")]

    yield ObjectStore(url), memory_stores
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def same(got: np.ndarray, want: np.ndarray) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


def assert_zarr_reads(stores: Any, prefix: str, want: np.ndarray, what: str) -> None:
    """Every zarr store at ``prefix`` opens as an array whose values are ``want``."""
    for zstore in stores(prefix):
        got = zarr.open_array(store=zstore, mode="r")[...]
        assert same(np.asarray(got), want), f"{what}: zarr reads other values ({zstore})"


def gradient(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32)


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_deltas_and_means_open_with_zarr(where, codec, shards):
    """Deltas of every codec (one chunk, or cut for two shards with the last chunk
    padded) and means (whole, or a shard's part) read the same through zarr as
    through `Coded` (the fast path) and `read_array`."""
    store, stores = where
    base = f"{codec}-{shards}"
    run = store.child(base)
    ex = Exchange(run, manifest(codec, shards))
    for fragment, n in ((0, N0), (1, N1)):
        for i, worker in enumerate(WORKERS):
            pub = ex.publish_delta(fragment, 0, worker, gradient(n, 10 * fragment + i), tokens=5)
            value, commit = ex.fetch_delta(fragment, 0, worker)
            assert same(value, pub.decoded)
            if shards > 1:
                assert len(commit["objects"]) - 1 >= 2  # several chunks
            assert_zarr_reads(stores, f"{base}/{commit['payload']}", value,
                              f"delta {codec} {worker}")
        mean = gradient(n, 99 + fragment) * np.float32(0.5)
        if shards == 1:
            ex.publish_mean(fragment, 0, "agg", mean, weights={w: 0.5 for w in WORKERS})
            value, commit = ex.fetch_mean(fragment, 0)
            assert_zarr_reads(stores, f"{base}/{commit['payload']}", value,
                              f"mean {codec}")
            continue
        for s in range(shards):
            part = span(ex, fragment, s)
            decoded, created = publish_part(ex, fragment, 0, part, "agg", mean[part.lo:part.hi])
            assert created
            value = fetch_part(ex, fragment, 0, part)
            assert same(value, decoded)
            commit = json.loads(run.get(layout.mean_part(fragment, 0, s)))
            assert_zarr_reads(stores, f"{base}/{commit['payload']}", value,
                              f"part {s} of the mean {codec}")


def assert_checkpoint_reads(store: ObjectStore, stores: Any, commit_key: str) -> dict:
    """Each array of a committed checkpoint opens with zarr as `read_checkpoint` reads
    it; returns those arrays."""
    got, _meta = read_checkpoint(store, commit_key)
    entries = json.loads(store.get(commit_key))["arrays"]
    assert set(entries) == set(got)
    for name, entry in entries.items():
        assert_zarr_reads(stores, entry["prefix"], got[name], f"{commit_key} {name}")
    return got


def test_canonical_checkpoints_and_lossless_arrays_open_with_zarr(where):
    """The canonical state of a round and its initial value (lossless float32), and
    lossless arrays of other dtypes and shapes (integers, a scalar, a matrix, bools,
    an empty array), read the same through zarr as through the project."""
    store, stores = where
    params = gradient(N0, 3)
    assert write_checkpoint(store, layout.global_init(0), f"{layout.global_init(0)}.json",
                            {"params": params}, {"fragment": 0})
    assert write_checkpoint(store, layout.global_state(0, 1), layout.global_commit(0, 1),
                            {"params": params * np.float32(2)}, {"fragment": 0, "round": 1})
    init = assert_checkpoint_reads(store, stores, f"{layout.global_init(0)}.json")
    assert same(init["params"], params)
    assert_checkpoint_reads(store, stores, layout.global_commit(0, 1))
    for key, value in {
        "data/tokens": np.arange(700, dtype=np.uint16),
        "data/offsets": np.array([0, 360, 700]),
        "data/scalar": np.array(2.5),
        "data/matrix": np.arange(12, dtype=np.float64).reshape(3, 4),
        "data/flags": np.array([True, False, True]),
        "data/empty": np.zeros((0, 3), np.float32),
    }.items():
        record, _ = arrays.write_array(store, key, value)
        got = arrays.read_array(store, key, record, shape=value.shape, dtype=value.dtype)
        assert same(got, value)
        assert_zarr_reads(stores, key, got, key)


@pytest.mark.parametrize(("value", "max_chunk"), [
    (np.arange(5000, dtype=np.float32), None),
    (np.arange(5001, dtype=np.float32), 2048),  # three chunks, the last padded
    (np.arange(3001, dtype=np.int64) - 1500, 1024),
    (np.arange(4097, dtype=np.uint16), 1024),
    (np.linspace(-1, 1, 24, dtype=np.float16).reshape(2, 3, 4), None),
    (np.arange(6, dtype=np.complex64), None),
    (np.array([True, False]), None),
    (np.array(-3, np.int8), None),
    (np.zeros(0, np.float32), None),
    (np.zeros((0, 3), np.float64), None),
    (np.arange(6, dtype=">f4"), None),  # stored little-endian, as zarr does
], ids=lambda v: getattr(v, "dtype", v))
def test_lossless_chunks_are_zarrs_own(value, max_chunk, monkeypatch):
    """`encode_array` builds the chunks of lossless arrays itself (raw bytes and their
    crc32c, the last chunk padded with zeros): the objects must be exactly those
    zarr writes for the array, and the decoded value the array itself."""
    if max_chunk:
        monkeypatch.setattr(arrays, "MAX_CHUNK", max_chunk)
    blobs, record, decoded = arrays.encode_array("p", value)
    assert blobs == arrays.encode_array_with_zarr("p", value.astype(value.dtype.newbyteorder("=")))
    assert set(record) == {k[2:] for k in blobs}
    assert np.array_equal(decoded, value) and decoded.dtype.isnative
    if max_chunk:
        assert len(blobs) - 1 >= 3


def test_a_dtype_zarr_stores_otherwise_is_refused():
    """A dtype zarr stores with other codecs than raw bytes and crc32c (variable-length
    strings) is refused, rather than written as chunks zarr would read differently."""
    with pytest.raises(ValueError, match="only raw bytes"):
        arrays.encode_array("p", np.array(["a", "bc"], dtype=np.dtypes.StringDType()))
