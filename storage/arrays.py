"""Immutable zarr arrays in an object store, verified on read.

An array is encoded in memory with zarr (our block codecs or plain bytes, always
with a crc32c per chunk), uploaded object by object through the ObjectStore (so
bytes are counted and transient errors retried), and described by a small record:
the objects written with their sizes and sha256. Readers fetch exactly the objects
in the record and check sizes and hashes before zarr decodes anything: with zarr
3.1 a missing chunk silently reads as the fill value, so presence is never inferred
from a zarr read.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from typing import Any

import google_crc32c
import numpy as np
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

from storage.codecs import CodecSpec, roundtrip
from storage.errors import (
    CorruptObject,
    NonFiniteValues,
    ObjectMissing,
    PartialObject,
    ShapeMismatch,
)
from storage.objectstore import ObjectStore
from storage.zarr_codec import zarr_array_codecs

# Largest chunk in elements; payloads above it are split so uploads run in parallel.
MAX_CHUNK = 1 << 26


def _chunks(shape: tuple[int, ...], spec: CodecSpec | None, parts: int = 1,
            align: int = 64) -> tuple[int, ...]:
    """One zarr chunk up to MAX_CHUNK values; above, the fewest chunks of at most
    about MAX_CHUNK values that split n evenly in whole codec blocks (whole sparse
    chunks for topk*), so the block grid is the one-chunk grid and zarr's padding of
    the last chunk is under one block per chunk (a 250M-value fragment is 4 chunks
    of 62.5M, not 4 of 67.1M). The padding changes nothing for the dense codecs; a
    sparse last chunk shorter than C then keeps k entries (zeros too), not min(k, L).

    ``parts`` > 1 (an aggregator of that many shards): a multiple of ``parts``
    chunks, each a whole number of blocks and of ``align`` values (64, and the
    blocks of the codec the mean goes down with), so every shard reads
    whole chunk objects and its slice of the vector starts where the one-chunk grid
    has a block boundary (the same bits, K = 1 or K = 4)."""
    if len(shape) != 1 or (shape[0] <= MAX_CHUNK and parts <= 1):
        return tuple(max(1, d) for d in shape) if shape else ()
    if spec is None:
        b = 1
    else:
        b = spec.chunk if spec.is_sparse else spec.block_size
    count = math.ceil(shape[0] / MAX_CHUNK)
    if parts > 1:
        b = math.lcm(b, align)
        count = parts * math.ceil(count / parts)
    return (max(b, b * math.ceil(math.ceil(shape[0] / count) / b)),)


def chunk_grid(n: int, spec: CodecSpec | None, parts: int = 1,
               align: int = 64) -> tuple[int, int]:
    """(values per zarr chunk, number of chunks) of a coded vector of ``n`` values
    written for an aggregator of ``parts`` shards."""
    (size,) = _chunks((n,), spec, parts, align)
    return size, max(1, math.ceil(n / size))


def _zarr_array(objects: dict, shape: tuple[int, ...], dtype: np.dtype,
                codec: CodecSpec | None, parts: int = 1, align: int = 64) -> zarr.Array:
    kwargs = zarr_array_codecs(codec) if codec is not None else {
        "compressors": [zarr.codecs.Crc32cCodec()]
    }
    return zarr.create_array(
        store=MemoryStore(objects),
        shape=shape,
        chunks=_chunks(shape, codec, parts, align),
        dtype=dtype,
        fill_value=0,
        config={"write_empty_chunks": True},
        **kwargs,
    )


@functools.lru_cache(maxsize=256)
def _metadata(n: int, codec: CodecSpec) -> bytes:
    """The zarr.json of a one-chunk coded vector of ``n`` values (cached)."""
    objects: dict = {}
    _zarr_array(objects, (n,), np.dtype(np.float32), codec)
    return objects["zarr.json"].to_bytes()


def encode_array(
    prefix: str, x: np.ndarray, codec: CodecSpec | None = None, parts: int = 1,
    align: int = 64,
) -> tuple[dict[str, bytes], dict[str, dict[str, Any]], np.ndarray]:
    """Encode ``x`` as a zarr array in memory: (objects by key, record, decoded value).

    With ``codec`` (a 1-D float32 outer gradient), the decoded value is what every
    reader will get back, which the caller needs for error feedback. Without it the
    array is stored losslessly in its own dtype (checkpoints).

    A coded vector that fits one chunk (the usual case) is built directly: the
    chunk is the codec's payload followed by its crc32c, exactly what zarr writes
    (a test holds the two paths byte-identical), and the decoded value comes from
    the codec's round trip instead of a second pass through zarr. ``parts``: cut
    into a multiple of that many chunks (see `_chunks`), for a sharded aggregator.
    """
    x = np.asarray(x, order="C")  # keeps 0-d arrays 0-d (ascontiguousarray would not)
    if not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    if codec is not None and (x.ndim != 1 or x.dtype != np.float32):
        raise ValueError(f"coded arrays are 1-D float32, got {x.dtype} {x.shape}")
    if codec is not None and 0 < x.size <= MAX_CHUNK and parts <= 1:
        payload, decoded = roundtrip(x, codec)
        crc = np.array([google_crc32c.value(payload)], dtype="<u4").tobytes()
        blobs = {f"{prefix}/zarr.json": _metadata(x.size, codec), f"{prefix}/c/0": payload + crc}
    else:
        objects: dict = {}
        arr = _zarr_array(objects, x.shape, x.dtype, codec, parts, align)
        arr[...] = x
        decoded = np.asarray(arr[...]) if codec is not None else x
        blobs = {f"{prefix}/{k}": v.to_bytes() for k, v in objects.items()}
    record = {
        k[len(prefix) + 1 :]: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
        for k, b in blobs.items()
    }
    return blobs, record, decoded


def encode_array_with_zarr(
    prefix: str, x: np.ndarray, codec: CodecSpec | None = None
) -> dict[str, bytes]:
    """The objects zarr itself writes for ``x`` (the reference for the fast path)."""
    objects: dict = {}
    arr = _zarr_array(objects, x.shape, x.dtype, codec)
    arr[...] = x
    return {f"{prefix}/{k}": v.to_bytes() for k, v in objects.items()}


def write_array(
    store: ObjectStore, prefix: str, x: np.ndarray, codec: CodecSpec | None = None
) -> tuple[dict[str, dict[str, Any]], np.ndarray]:
    """Encode ``x`` (see :func:`encode_array`) and upload it under ``prefix``."""
    blobs, record, decoded = encode_array(prefix, x, codec)
    store.put_many(blobs)
    return record, decoded


def read_array(
    store: ObjectStore,
    prefix: str,
    record: dict[str, dict[str, Any]],
    *,
    shape: tuple[int, ...] | None = None,
    dtype: np.dtype | str | None = None,
    finite: bool = False,
    what: str = "",
) -> np.ndarray:
    """Fetch, verify and decode the array written by :func:`write_array`.

    ``what`` names the object in error messages (e.g. "delta of worker w1 for
    fragment 0 round 3"). Raises PartialObject, CorruptObject, ShapeMismatch or
    NonFiniteValues; never returns data that failed a check.
    """
    label = what or store.full_url(prefix)
    arr = _open_verified(store, prefix, record, list(record), label)
    # zarr 3.1 reads a chunk that is absent as the fill value: every chunk the array
    # has must be in the record, or the read would silently produce zeros.
    if all(arr.shape):
        grid = itertools.product(*(range(n) for n in arr.cdata_shape))
        for coords in grid:
            name = arr.metadata.encode_chunk_key(coords)
            if name not in record:
                raise PartialObject(
                    f"{label}: chunk {store.full_url(f'{prefix}/{name}')} is not in its record"
                )
    if shape is not None and tuple(arr.shape) != tuple(shape):
        raise ShapeMismatch(f"{label}: shape {tuple(arr.shape)}, expected {tuple(shape)}")
    if dtype is not None and np.dtype(arr.dtype) != np.dtype(dtype):
        raise ShapeMismatch(f"{label}: dtype {arr.dtype}, expected {np.dtype(dtype)}")
    return _decoded(arr, ..., label, finite)


def _open_verified(store: ObjectStore, prefix: str, record: dict[str, dict[str, Any]],
                   names: list[str], label: str) -> zarr.Array:
    """Fetch the objects ``names`` of the record (zarr.json among them), check each
    one's size and sha256, and open them as a read-only zarr array."""
    if "zarr.json" not in record:
        raise CorruptObject(f"{label}: its record lists no zarr.json ({store.full_url(prefix)})")
    for name in names:
        if name not in record:
            raise PartialObject(
                f"{label}: chunk {store.full_url(f'{prefix}/{name}')} is not in its record")
    keys = [f"{prefix}/{k}" for k in names]
    try:
        blobs = store.get_many(keys)
    except ObjectMissing as exc:
        raise PartialObject(f"{label}: a part is missing: {exc}") from exc
    proto = default_buffer_prototype().buffer
    contents = {}
    for name in names:
        meta = record[name]
        key = f"{prefix}/{name}"
        data = blobs.get(key)
        if data is None:
            raise PartialObject(f"{label}: part {store.full_url(key)} is missing")
        if len(data) != meta["size"]:
            raise PartialObject(
                f"{label}: part {store.full_url(key)} has {len(data)} bytes, "
                f"its commit says {meta['size']}"
            )
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise CorruptObject(f"{label}: part {store.full_url(key)} fails its sha256 check")
        contents[name] = proto.from_bytes(data)
    try:
        return zarr.open_array(store=MemoryStore(contents, read_only=True), mode="r")
    except Exception as exc:
        raise CorruptObject(f"{label}: not a readable zarr array: {exc}") from exc


def read_array_part(
    store: ObjectStore,
    prefix: str,
    record: dict[str, dict[str, Any]],
    chunks: range,
    *,
    n: int,
    chunk_len: int,
    finite: bool = True,
    what: str = "",
) -> np.ndarray:
    """Fetch, verify and decode only the zarr chunks ``chunks`` of a coded vector of
    ``n`` values cut into chunks of ``chunk_len`` (a shard of the aggregator reads
    its own chunk objects and nothing else): the float32 values they hold."""
    label = what or store.full_url(prefix)
    names = ["zarr.json", *(f"c/{c}" for c in chunks)]  # zarr 3's default chunk keys
    arr = _open_verified(store, prefix, record, names, label)
    if tuple(arr.shape) != (n,) or tuple(arr.chunks) != (chunk_len,):
        raise ShapeMismatch(f"{label}: shape {tuple(arr.shape)} in chunks of {arr.chunks}, "
                            f"expected ({n},) in chunks of ({chunk_len},)")
    if np.dtype(arr.dtype) != np.float32:
        raise ShapeMismatch(f"{label}: dtype {arr.dtype}, expected float32")
    if any(arr.metadata.encode_chunk_key((c,)) != f"c/{c}" for c in chunks):
        raise CorruptObject(f"{label}: its chunks are not named c/<i>")
    lo, hi = chunks.start * chunk_len, min(n, chunks.stop * chunk_len)
    return _decoded(arr, slice(lo, hi), label, finite)


def _decoded(arr: Any, selection: Any, label: str, finite: bool) -> np.ndarray:
    """``arr[selection]`` decoded, or the named error: a codec's refusal of NaN/Inf
    stays NonFiniteValues, anything else zarr or a codec raises is CorruptObject."""
    try:
        out = np.asarray(arr[selection])
    except NonFiniteValues as exc:
        raise NonFiniteValues(f"{label}: {exc}; it is not applied") from exc
    except Exception as exc:
        raise CorruptObject(f"{label}: cannot be decoded: {exc}") from exc
    if finite and not np.isfinite(out).all():
        bad = int((~np.isfinite(out)).sum())
        raise NonFiniteValues(f"{label}: {bad} NaN or Inf values; it is not applied")
    return out
