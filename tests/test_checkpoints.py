"""Checkpoints on every backend: named numpy arrays plus metadata, committed once.

Every test runs on memory://, file:// and s3:// through the ``make_store`` fixture
of conftest.py. Run: ``.venv/bin/pytest tests/test_checkpoints.py -q``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from storage import layout
from storage.checkpoints import (
    committed_keys,
    has_checkpoint,
    read_checkpoint,
    write_checkpoint,
)
from storage.errors import CorruptObject, ObjectMissing, PartialObject
from storage.objectstore import ObjectStore, RetryPolicy

FAST = RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.005)
PREFIX, COMMIT = layout.global_state(0, 3), layout.global_commit(0, 3)


def sample_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "params": rng.standard_normal(1000, dtype=np.float32),
        "momentum": rng.standard_normal((25, 40), dtype=np.float32),
        "data_position": np.array([12, 2**40 + 3, -5], dtype=np.int64),
        "rng_state": rng.integers(0, 256, size=(4, 5, 6), dtype=np.uint8),
        "mask": np.array([True, False, True]),
        "float64": np.array([np.pi, -0.0, 1e-300]),
        "float16": np.array([1.5, -2.25], dtype=np.float16),
        "non_contiguous": np.arange(20, dtype=np.int32)[::3],  # 7 values, a strided view
        "fortran": np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
        "empty": np.zeros(0, dtype=np.float32),
        "empty_rows": np.zeros((0, 3), dtype=np.uint8),
    }


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        assert got[name].shape == value.shape, name
        # byte for byte (-0.0 stays -0.0, NaN payloads would stay too)
        assert got[name].tobytes() == np.ascontiguousarray(value).tobytes(), name


def test_round_trip_of_dtypes_and_shapes(make_store):
    writer, reader = make_store("aggregator"), make_store("worker")
    arrays = sample_arrays()
    meta = {"fragment": 0, "round": 3, "weights": {"w0": 0.5, "w1": 0.5}, "writer": "agg"}
    assert not has_checkpoint(reader, COMMIT)
    assert write_checkpoint(writer, PREFIX, COMMIT, arrays, meta) is True
    assert has_checkpoint(reader, COMMIT)
    got, got_meta = read_checkpoint(reader, COMMIT)
    assert_same(got, arrays)
    assert got_meta == meta
    np.testing.assert_array_equal(got["non_contiguous"], [0, 3, 6, 9, 12, 15, 18])


def test_empty_arrays_store_no_chunks(make_store):
    """A 0-length array is supported: only its zarr.json is written, and it reads back."""
    store = make_store()
    write_checkpoint(store, PREFIX, COMMIT, {"empty": np.zeros(0, np.float32)})
    body = json.loads(store.get(COMMIT))
    assert list(body["arrays"]["empty"]["objects"]) == ["zarr.json"]
    got, meta = read_checkpoint(store, COMMIT)
    assert got["empty"].shape == (0,) and got["empty"].dtype == np.float32 and meta == {}


@pytest.mark.parametrize(
    "value",
    [np.int64(123456789012), np.array(2.5, dtype=np.float32), np.array(7, dtype=np.uint8)],
    ids=["int64-scalar", "float32-0d", "uint8-0d"],
)
def test_zero_dimensional_arrays_round_trip(make_store, value):
    store = make_store()
    assert write_checkpoint(store, PREFIX, COMMIT, {"step": value}) is True
    got, _ = read_checkpoint(store, COMMIT)
    assert got["step"].shape == () and got["step"].dtype == np.asarray(value).dtype
    assert got["step"].item() == np.asarray(value).item()


def test_non_native_byte_order_round_trips(make_store):
    store = make_store()
    value = np.arange(5, dtype=">i4")
    write_checkpoint(store, PREFIX, COMMIT, {"big_endian": value})
    got, _ = read_checkpoint(store, COMMIT)
    np.testing.assert_array_equal(got["big_endian"], [0, 1, 2, 3, 4])


def test_checkpoint_is_immutable(make_store):
    first, second = make_store("first"), make_store("second")
    original = {"params": np.arange(10, dtype=np.float32)}
    assert write_checkpoint(first, PREFIX, COMMIT, original, {"writer": "first"}) is True
    keys_before = first.list("global")
    replacement = {"params": np.ones(10, dtype=np.float32), "extra": np.zeros(3, np.int64)}
    assert write_checkpoint(second, PREFIX, COMMIT, replacement, {"writer": "second"}) is False
    assert second.list("global") == keys_before  # the loser wrote nothing at all
    got, meta = read_checkpoint(second, COMMIT)
    assert_same(got, original)
    assert meta == {"writer": "first"}


def test_committed_keys_lists_commit_records_in_order(make_store):
    store = make_store()
    for r in (10, 2, 1):
        write_checkpoint(
            store, layout.global_state(0, r), layout.global_commit(0, r),
            {"params": np.full(4, r, np.float32)},
        )
    write_checkpoint(  # another fragment: a sibling prefix, not listed
        store, layout.global_state(1, 0), layout.global_commit(1, 0), {"p": np.zeros(1)}
    )
    # rounds are zero-padded (r000002 < r000010), so string order is round order;
    # the arrays' own zarr.json files sit deeper and are not commit records
    assert committed_keys(store, layout.global_states(0)) == [
        "global/frag/0/r000001.json",
        "global/frag/0/r000002.json",
        "global/frag/0/r000010.json",
    ]
    assert committed_keys(store, layout.global_states(1)) == ["global/frag/1/r000000.json"]
    assert committed_keys(store, layout.global_states(2)) == []
    got, _ = read_checkpoint(store, committed_keys(store, layout.global_states(0))[-1])
    np.testing.assert_array_equal(got["params"], [10, 10, 10, 10])


def _chunk_key(store: ObjectStore, array: str) -> str:
    """The one chunk of a small array: ``c/0`` for 1-D, ``c/0/0/0`` for 3-D."""
    entry = json.loads(store.get(COMMIT))["arrays"][array]
    chunks = [name for name in entry["objects"] if name != "zarr.json"]
    assert chunks == ["c/" + "/".join("0" * len(entry["shape"]))]
    return f"{entry['prefix']}/{chunks[0]}"


def test_flipped_byte_is_corrupt(make_store):
    store, vandal = make_store("worker"), make_store("vandal", retry=FAST)
    write_checkpoint(store, PREFIX, COMMIT, sample_arrays())
    key = _chunk_key(store, "rng_state")
    body = bytearray(vandal.get(key))
    body[0] ^= 0x10
    vandal.put(key, bytes(body))
    with pytest.raises(CorruptObject) as info:
        read_checkpoint(store, COMMIT)
    message = str(info.value)
    assert "rng_state" in message and store.full_url(COMMIT) in message
    assert store.full_url(key) in message and "sha256" in message


def test_missing_part_is_partial(make_store):
    store, vandal = make_store("worker"), make_store("vandal", retry=FAST)
    write_checkpoint(store, PREFIX, COMMIT, sample_arrays())
    key = _chunk_key(store, "params")
    vandal.delete_prefix(key.rsplit("/", 1)[0])  # .../params/c, holding c/0
    with pytest.raises(PartialObject) as info:
        read_checkpoint(store, COMMIT)
    assert "params" in str(info.value) and store.full_url(COMMIT) in str(info.value)


def test_truncated_part_is_partial(make_store):
    store, vandal = make_store("worker"), make_store("vandal", retry=FAST)
    write_checkpoint(store, PREFIX, COMMIT, {"params": np.arange(100, dtype=np.float32)})
    key = _chunk_key(store, "params")
    body = vandal.get(key)
    assert len(body) == 4 * 100 + 4  # float32 values + crc32c
    vandal.put(key, body[:200])
    with pytest.raises(PartialObject, match="has 200 bytes, its commit says 404"):
        read_checkpoint(store, COMMIT)


def test_missing_checkpoint_is_object_missing(make_store):
    store = make_store()
    with pytest.raises(ObjectMissing, match=store.full_url(COMMIT)):
        read_checkpoint(store, COMMIT)
