"""Large objects (storage/multipart.py): multipart uploads and parallel ranged reads on
a real S3 server (SeaweedFS on loopback), each part retried on its own, a failed upload
aborted, and the same options accepted (and ignored) by the file and memory stores.

The threshold is lowered to S3's smallest part (5 MiB) so a 17 MiB object is 4 parts
(5, 5, 5, 2 MiB) and the tests stay small.
"""

from __future__ import annotations

import errno
import uuid
from collections.abc import Callable
from typing import Any

import boto3
import numpy as np
import pytest

from storage.arrays import read_array, write_array
from storage.errors import TransientStoreError
from storage.multipart import LargeObjects
from storage.objectstore import ObjectStore, RetryPolicy

MIB = 1 << 20
SMALL = {"multipart_threshold": 5 * MIB, "part_size": 5 * MIB}
FAST = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.02)
SIZE = 17 * MIB  # 4 parts: 5, 5, 5, 2 MiB


def payload(size: int = SIZE, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.fixture
def large_store(store_url: dict[str, Any]) -> Callable[..., ObjectStore]:
    """Stores on the test's backend with the lowered thresholds."""

    def make(**overrides: Any) -> ObjectStore:
        options = {**store_url["storage_options"], **SMALL}
        return ObjectStore(store_url["url"], storage_options=options, retry=FAST, **overrides)

    return make


@pytest.fixture
def s3_store(s3_endpoint: tuple[str, dict], s3_bucket: str) -> Any:
    """A store with the lowered thresholds under a fresh prefix of the test bucket."""
    root = f"mp-{uuid.uuid4().hex[:12]}"
    store = ObjectStore(f"s3://{s3_bucket}/{root}", retry=FAST,
                        storage_options={**s3_endpoint[1], **SMALL})
    yield store
    ObjectStore(f"s3://{s3_bucket}", storage_options=s3_endpoint[1]).delete_prefix(root)


def in_progress(store: ObjectStore, s3_endpoint: tuple[str, dict]) -> list[str]:
    """Keys of the multipart uploads the server still holds open under the store."""
    url, options = s3_endpoint
    client = boto3.client("s3", endpoint_url=url, aws_access_key_id=options["key"],
                          aws_secret_access_key=options["secret"], region_name="us-east-1")
    prefix = store.fs_path("x").split("/", 1)[1][:-1]
    out = client.list_multipart_uploads(Bucket=store.bucket, Prefix=prefix)
    return [u["Key"] for u in out.get("Uploads", [])]


def faulty(monkeypatch: pytest.MonkeyPatch, store: ObjectStore, method: str,
           fails: Callable[[dict], bool]) -> list[dict]:
    """Make s3fs's ``method`` calls for which ``fails(kwargs)`` is true raise a
    connection reset (a transient fault) before reaching the server; returns the
    kwargs of every ``method`` call."""
    real = store.fs._call_s3
    calls: list[dict] = []

    async def call(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == method:
            calls.append(kwargs)
            if fails(kwargs):
                raise ConnectionResetError(errno.ECONNRESET, "injected reset")
        return await real(name, *args, **kwargs)

    monkeypatch.setattr(store.fs, "_call_s3", call)
    return calls


def test_options_are_validated_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^storage_options.part_size must be an integer "
                                         r"between 5242880 and 5368709120"):
        ObjectStore("memory://mp-bad", storage_options={"part_size": 1000})
    with pytest.raises(ValueError, match=r"^storage_options.multipart_threshold must be an "
                                         r"integer >= 16777216 \(part_size\), got 1"):
        ObjectStore("memory://mp-bad", storage_options={"multipart_threshold": 1})
    with pytest.raises(ValueError, match="part_concurrency .* got '4'"):
        LargeObjects.from_options({"part_concurrency": "4"})
    opts, rest = LargeObjects.from_options({"part_size": 8 * MIB, "anon": True})
    assert (opts.part_size, opts.multipart_threshold, rest) == (8 * MIB, 64 * MIB, {"anon": True})


@pytest.mark.s3_backends("seaweedfs")  # the real object store of the brief
def test_large_object_round_trips_in_parts(large_store: Callable[..., ObjectStore],
                                           store_url: dict) -> None:
    store = large_store()
    data = payload()
    store.put("big/obj", data)
    snap = store.traffic.snapshot()
    if store.bucket is None:  # file and memory: a plain write
        assert snap["by_op"] == {"put": 1}
    else:  # create, 4 parts, complete
        assert snap["by_op"] == {"put": 6}
    assert snap["bytes_up"] == SIZE and snap["objects_up"] == {"big/obj": SIZE}
    store.traffic.reset()
    got = store.get("big/obj")
    assert got == data and store.size("big/obj") == SIZE
    snap = store.traffic.snapshot()
    # s3: a 5 MiB first range, a HEAD for the size, 3 more ranges (and our size())
    assert snap["by_op"] == ({"get": 4, "size": 2} if store.bucket else {"get": 1, "size": 1})
    assert snap["bytes_down"] == SIZE and snap["objects_down"] == {"big/obj": SIZE}
    # get_many reads large and small objects side by side, exactly
    store.put("big/small", b"tiny")
    store.put("big/empty", b"")
    store.put("big/edge", data[:5 * MIB])  # exactly the threshold: one part, one PUT
    assert store.get_many(["big/obj", "big/small", "big/empty", "big/edge"]) == {
        "big/obj": data, "big/small": b"tiny", "big/empty": b"", "big/edge": data[:5 * MIB]}
    assert store.get("big/empty") == b"" and store.get("big/edge") == data[:5 * MIB]


@pytest.mark.s3_backends("seaweedfs")
def test_zarr_array_of_the_exchange_round_trips(large_store: Callable[..., ObjectStore]) -> None:
    store = large_store()
    x = np.random.default_rng(1).standard_normal(SIZE // 4 + 1000).astype(np.float32)
    record, _ = write_array(store, "frag/0/r1/delta/w1", x)
    assert record["c/0"]["size"] > 5 * MIB  # the chunk object went in parts
    y = read_array(store, "frag/0/r1/delta/w1", record, shape=x.shape, dtype=np.float32)
    assert y.tobytes() == x.tobytes()


@pytest.mark.s3_backends("seaweedfs")
def test_a_part_that_fails_once_is_retried_alone(s3_store: ObjectStore,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    store = s3_store
    seen: set[int] = set()

    def once(kwargs: dict) -> bool:
        first = kwargs["PartNumber"] == 2 and 2 not in seen
        seen.add(kwargs["PartNumber"])
        return first

    calls = faulty(monkeypatch, store, "upload_part", once)
    data = payload(seed=2)
    store.put("retry/obj", data)
    assert sorted(c["PartNumber"] for c in calls) == [1, 2, 2, 3, 4]
    assert store.traffic.retries == 1
    assert store.traffic.snapshot()["by_op"]["put"] == 7  # 6 requests and the failed one
    assert store.get("retry/obj") == data


@pytest.mark.s3_backends("seaweedfs")
def test_a_part_that_always_fails_aborts_the_upload(
        s3_store: ObjectStore, monkeypatch: pytest.MonkeyPatch,
        s3_endpoint: tuple[str, dict]) -> None:
    store = s3_store
    faulty(monkeypatch, store, "upload_part", lambda kw: kw["PartNumber"] == 3)
    with pytest.raises(TransientStoreError, match=r"part 3 of s3://.*/dead/obj failed after 3"):
        store.put("dead/obj", payload(seed=3))
    assert in_progress(store, s3_endpoint) == []
    assert not store.exists("dead/obj")
    assert store.traffic.snapshot()["by_op"]["delete"] == 1  # the abort


@pytest.mark.s3_backends("seaweedfs")
def test_a_range_that_fails_once_is_retried(s3_store: ObjectStore,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    store = s3_store
    data = payload(seed=4)
    store.put("ranges/obj", data)
    store.traffic.reset()
    failed: list[str] = []

    def once(kwargs: dict) -> bool:
        hit = kwargs.get("Range") == f"bytes={10 * MIB}-{15 * MIB - 1}" and not failed
        if hit:
            failed.append(kwargs["Range"])
        return hit

    calls = faulty(monkeypatch, store, "get_object", once)
    assert store.get("ranges/obj") == data
    assert failed and len(calls) == 5  # head range, 3 ranges, the retried one
    assert store.traffic.retries == 1


@pytest.mark.s3_backends("seaweedfs")
def test_a_range_that_always_fails_is_not_read_again_whole(
        s3_store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store = s3_store
    store.put("ranges/dead", payload(seed=5))
    calls = faulty(monkeypatch, store, "get_object",
                   lambda kw: kw.get("Range") == f"bytes={15 * MIB}-{SIZE - 1}")
    with pytest.raises(TransientStoreError, match="failed after 3 attempts"):
        store.get("ranges/dead")
    assert len(calls) == 1 + 3 + 2  # one whole read: head range, 3 ranges, 2 retries
