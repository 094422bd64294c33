"""Immutable zarr arrays in an object store, verified on read.

Every array a run stores is an ordinary zarr v3 array, a ``zarr.json`` and its
chunk objects ``c/...``: outer gradients in every codec, means and the parts of a
sharded mean, the canonical state and its initial value, worker checkpoints.
Each object is uploaded through the
ObjectStore (so bytes are counted and transient errors retried) and described by
a small record: the objects written with their sizes and sha256.

What zarr gives
---------------
Self-describing arrays. ``zarr.json`` names the shape, dtype, chunk grid and
codecs (the project's ``diloco.blockquant`` with its configuration, then crc32c),
so any zarr reader opens any of these arrays with ``zarr.open_array`` once
``storage.zarr_codec`` has registered the codec, and gets the values the
project's own readers return, bit for bit (tests/test_zarr_interop.py holds this
for every kind of array a run writes). A stored run can be inspected, or read by
other tools, without this code's readers and without a format of our own.

What the fast path does, and why
--------------------------------
zarr's own write runs every chunk through its codec pipeline with copies of the
values and the bytes, and hands back only the stored bytes, while a worker needs
the decoded value of what it sent at once (error feedback), and the aggregator
sums many contributions without holding a decoded copy of each. So zarr
describes the arrays and the project moves the bytes:

* Writing: `encode_array` builds every chunk object of every array with one
  function, `_encode_chunks`: the serializer's bytes (the codec's payload, or
  the raw little-endian values of a lossless array), zarr's zero padding of the
  last chunk included, followed by their crc32c, which is what zarr's
  ``Crc32cCodec`` appends. The decoded value comes from the codec's round trip
  of the same chunk. ``zarr.json`` is zarr's own, built once per shape, dtype,
  codec and grid. Tests hold the objects byte-identical to zarr's write
  (`encode_array_with_zarr`).
* Reading a coded vector: `hold_vector` opens ``zarr.json`` with zarr and checks
  that it names the project's codec and crc32c; `Coded` then decodes chunk by
  chunk with `storage.codecs.decode`, the function the zarr codec itself calls,
  into reused scratch, so it returns exactly what a zarr read returns.
* Lossless arrays (checkpoints) and the parts of a sharded mean
  are read through zarr (`read_array`).

Readers fetch exactly the objects in the record and check sizes and hashes
before anything is decoded: zarr reads a missing chunk as the fill value, so
presence is never inferred from a zarr read.
"""

from __future__ import annotations

import functools
import hashlib
import io
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

from storage.codecs import CodecSpec, decode, roundtrip
from storage.errors import (
    CorruptObject,
    NonFiniteValues,
    ObjectMissing,
    PartialObject,
    ShapeMismatch,
)
from storage.objectstore import ObjectStore
from storage.zarr_codec import ZARR_CODEC_NAME, BlockQuantCodec, zarr_array_codecs

# Largest chunk in elements; payloads above it are split so uploads run in parallel.
MAX_CHUNK = 1 << 26
_FINITE_BLOCK = 1 << 16  # values checked finite at a time when a chunk is decoded


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
                codec: CodecSpec | None, chunks: tuple[int, ...]) -> zarr.Array:
    """An empty zarr array in ``objects``: our codec (or zarr's raw bytes for a
    lossless array), then crc32c."""
    kwargs = zarr_array_codecs(codec) if codec is not None else {
        "compressors": [zarr.codecs.Crc32cCodec()]
    }
    return zarr.create_array(
        store=MemoryStore(objects),
        shape=shape,
        chunks=chunks,
        dtype=dtype,
        fill_value=0,
        config={"write_empty_chunks": True},
        **kwargs,
    )


@functools.lru_cache(maxsize=256)
def _layout(shape: tuple[int, ...], dtype: np.dtype, codec: CodecSpec | None,
            chunks: tuple[int, ...]) -> tuple[bytes, tuple[str, ...]]:
    """(the ``zarr.json`` zarr writes, the names of the chunk objects in grid order)
    of an array of ``shape`` and ``dtype`` cut into ``chunks``; cached, since a run
    writes the same few layouts every round.

    `_encode_chunks` writes what zarr's serializer and crc32c write; should zarr
    choose other codecs for a dtype, this refuses it rather than store chunks that
    zarr would read differently."""
    objects: dict = {}
    arr = _zarr_array(objects, shape, dtype, codec, chunks)
    codecs = arr.metadata.codecs
    serializer = BlockQuantCodec if codec is not None else zarr.codecs.BytesCodec
    if (len(codecs) != 2 or not isinstance(codecs[0], serializer)
            or not isinstance(codecs[1], zarr.codecs.Crc32cCodec)):
        raise ValueError(f"zarr stores {dtype} arrays with codecs {codecs}; "
                         f"only raw bytes or {ZARR_CODEC_NAME}, then crc32c, are written")
    keys = tuple(arr.metadata.encode_chunk_key(coords)
                 for coords in itertools.product(*(range(n) for n in arr.cdata_shape)))
    return objects["zarr.json"].to_bytes(), keys


def _metadata(n: int, codec: CodecSpec | None) -> bytes:
    """The ``zarr.json`` of a vector of ``n`` float32 values (coded with ``codec``,
    or lossless); `diloco.arithmetic` counts its bytes."""
    return _layout((n,), np.dtype(np.float32), codec, _chunks((n,), codec))[0]


def encode_array(
    prefix: str, x: np.ndarray, codec: CodecSpec | None = None, parts: int = 1,
    align: int = 64,
) -> tuple[dict[str, bytes], dict[str, dict[str, Any]], np.ndarray]:
    """Encode ``x`` as a zarr array in memory: (objects by key, record, decoded value).

    With ``codec`` (a 1-D float32 outer gradient), the decoded value is what every
    reader will get back, which the caller needs for error feedback. Without it the
    array is stored losslessly in its own dtype (checkpoints) and is its own
    decoded value. ``parts``: cut into a multiple of that many chunks (see
    `_chunks`), for a sharded aggregator. The objects are those zarr writes for
    ``x`` (module docstring), built without zarr's write path.
    """
    x = np.asarray(x, order="C")  # keeps 0-d arrays 0-d (ascontiguousarray would not)
    if not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    if codec is not None and (x.ndim != 1 or x.dtype != np.float32):
        raise ValueError(f"coded arrays are 1-D float32, got {x.dtype} {x.shape}")
    chunks = _chunks(x.shape, codec, parts, align)
    metadata, keys = _layout(x.shape, x.dtype, codec, chunks)
    objects, decoded = _encode_chunks(x, codec, math.prod(chunks), len(keys))
    blobs = {f"{prefix}/zarr.json": metadata}
    blobs.update((f"{prefix}/{keys[c]}", objects.pop(c)) for c in range(len(keys)))
    record = {
        k[len(prefix) + 1 :]: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
        for k, b in blobs.items()
    }
    return blobs, record, decoded


def _chunk_object(payload: bytes | np.ndarray) -> bytes:
    """A stored zarr chunk: the serializer's bytes, then their crc32c (little-endian
    uint32, as zarr's ``Crc32cCodec`` appends it). Built in a buffer sized up front,
    whose ``getvalue`` hands the buffer over, so the payload is copied once."""
    if isinstance(payload, np.ndarray):
        payload = payload.view(np.uint8)  # 1-D, C-contiguous: its raw bytes
    size = len(payload)
    out = io.BytesIO()
    out.seek(size + 3)
    out.write(b"\0")
    out.seek(0)
    out.write(payload)
    out.write(_checksum(payload))
    return out.getvalue()


def _checksum(payload: bytes | np.ndarray) -> bytes:
    """The 4 bytes zarr's ``Crc32cCodec`` stores after a chunk's payload."""
    return np.array([google_crc32c.value(payload)], "<u4").tobytes()


def _encode_chunks(x: np.ndarray, codec: CodecSpec | None, size: int,
                   count: int) -> tuple[dict[int, bytes], np.ndarray]:
    """The ``count`` chunk objects of ``x`` (C order, ``size`` values a chunk: a
    vector is cut along its length, any other array is one chunk) by grid index,
    and the decoded value: ``x`` itself when lossless.

    Coded, each chunk's payload is the codec's round trip written straight into
    the one decoded array, so the peak is the input, the decoded value and the
    payloads (zarr's write and read back held a second encoded copy and a
    decoded chunk besides). zarr pads the last chunk with the fill value 0 to the
    full chunk length before encoding; so does this. The padded last chunk goes
    first, while the pages of the rest are not yet touched, so its padded copy
    adds nothing to the peak; the decoded array has room for its padding (under
    a block a chunk), so every chunk decodes straight into place."""
    flat = x.reshape(-1)
    n = flat.size
    decoded = x if codec is None else np.empty(count * size, np.float32)
    objects = {}
    for c in [count - 1, *range(count - 1)] if count else []:
        lo, hi = c * size, min(n, (c + 1) * size)
        part = flat[lo:hi]
        if hi - lo < size:
            part = np.zeros(size, x.dtype)
            part[: hi - lo] = flat[lo:hi]
        if codec is None:
            objects[c] = _chunk_object(part)
        else:
            objects[c] = _chunk_object(roundtrip(part, codec, out=decoded[lo:lo + size])[0])
        del part
    return objects, (x if codec is None else decoded[:n])


def encode_array_with_zarr(
    prefix: str, x: np.ndarray, codec: CodecSpec | None = None, parts: int = 1,
    align: int = 64,
) -> dict[str, bytes]:
    """The objects zarr itself writes for ``x`` (the reference `encode_array` is
    held to; nothing in a run writes through it)."""
    x = np.asarray(x, order="C")
    objects: dict = {}
    arr = _zarr_array(objects, x.shape, x.dtype, codec, _chunks(x.shape, codec, parts, align))
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
    # zarr reads a chunk that is absent as the fill value: every chunk the array
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
    proto = default_buffer_prototype().buffer
    contents = {k: proto.from_bytes(v)
                for k, v in _verified_objects(store, prefix, record, names, label).items()}
    try:
        return zarr.open_array(store=MemoryStore(contents, read_only=True), mode="r")
    except Exception as exc:
        raise CorruptObject(f"{label}: not a readable zarr array: {exc}") from exc


def _verified_objects(store: ObjectStore, prefix: str, record: dict[str, dict[str, Any]],
                      names: list[str], label: str) -> dict[str, bytes]:
    """The objects ``names`` of the record by name, each checked for size and sha256."""
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
        contents[name] = data
    return contents


@dataclass
class Coded:
    """A coded float32 vector, or the zarr chunks ``chunks`` of one, fetched and
    verified (sizes, sha256, every chunk present, our codec) but kept encoded.

    It is decoded a zarr chunk at a time (`pieces`), so a party that sums several
    contributions holds their encoded bytes, its sum and one chunk of scratch, never
    a decoded copy of each. A chunk decodes to exactly what zarr's read gives: the
    same codec on the same chunk bytes (zarr pads the last chunk; so does this)."""

    spec: CodecSpec
    payloads: dict[int, bytes]  # chunk index -> the codec's payload
    crcs: dict[int, bytes]  # chunk index -> the crc32c stored after it
    chunks: range
    chunk_len: int
    n: int
    label: str

    @property
    def lo(self) -> int:
        return min(self.n, self.chunks.start * self.chunk_len)

    @property
    def hi(self) -> int:
        return min(self.n, self.chunks.stop * self.chunk_len)

    def _chunk(self, c: int, out: np.ndarray) -> int:
        """Decode chunk ``c`` into ``out`` (``chunk_len`` values: zarr pads the last
        chunk), checked; returns how many of them are real."""
        payload = self.payloads[c]
        if self.crcs[c] != _checksum(payload):
            raise CorruptObject(f"{self.label}: chunk c/{c} fails its crc32c check "
                                f"(stored and computed checksum do not match)")
        try:
            decode(payload, self.chunk_len, self.spec, out=out)
        except NonFiniteValues as exc:
            raise NonFiniteValues(f"{self.label}: {exc}; it is not applied") from exc
        except Exception as exc:
            raise CorruptObject(f"{self.label}: cannot be decoded: {exc}") from exc
        real = min(self.n, (c + 1) * self.chunk_len) - c * self.chunk_len
        for i in range(0, real, _FINITE_BLOCK):  # no chunk-sized boolean array
            block = out[i:min(real, i + _FINITE_BLOCK)]
            if not np.isfinite(block).all():
                raise NonFiniteValues(f"{self.label}: NaN or Inf values in chunk c/{c}; "
                                      f"it is not applied")
        return real

    def pieces(self, scratch: np.ndarray | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """(offset from ``lo``, decoded values) of each chunk in turn, checked finite.
        The values live in ``scratch`` (float32, ``chunk_len``; allocated if None),
        overwritten by the next piece: use each before asking for the next."""
        buf = scratch if scratch is not None else np.empty(self.chunk_len, np.float32)
        for c in self.chunks:
            real = self._chunk(c, buf)
            yield c * self.chunk_len - self.lo, buf[:real]

    def decode(self) -> np.ndarray:
        """All its values in one new array (what `read_array` returns): every chunk
        decodes straight into place (the array has room for the last one's padding,
        under a block a chunk)."""
        out = np.empty(len(self.chunks) * self.chunk_len, np.float32)
        for i, c in enumerate(self.chunks):
            self._chunk(c, out[i * self.chunk_len:(i + 1) * self.chunk_len])
        return out[:self.hi - self.lo]

    def sumsq(self) -> float:
        """The float64 sum of squares of its values, a chunk at a time (the norm
        guard's input: no float64 copy of the vector)."""
        scratch = np.empty(self.chunk_len, np.float32)
        return sum(sumsq(values) for _offset, values in self.pieces(scratch))


def hold_vector(
    store: ObjectStore,
    prefix: str,
    record: dict[str, dict[str, Any]],
    *,
    n: int,
    chunks: range | None = None,
    chunk_len: int | None = None,
    what: str = "",
) -> Coded:
    """Fetch and verify a coded vector of ``n`` float32 values written by
    `write_array` (only its zarr chunks ``chunks``, of ``chunk_len`` values, when
    given: a shard's part), kept encoded. Raises what `read_array` raises."""
    label = what or store.full_url(prefix)
    names = list(record) if chunks is None else ["zarr.json", *(f"c/{c}" for c in chunks)]
    objects = _verified_objects(store, prefix, record, names, label)
    try:
        meta = zarr.open_array(store=MemoryStore(
            {"zarr.json": default_buffer_prototype().buffer.from_bytes(objects["zarr.json"])},
            read_only=True), mode="r")
    except Exception as exc:
        raise CorruptObject(f"{label}: not a readable zarr array: {exc}") from exc
    if tuple(meta.shape) != (n,):
        raise ShapeMismatch(f"{label}: shape {tuple(meta.shape)}, expected ({n},)")
    if chunk_len not in (None, meta.chunks[0]):
        raise ShapeMismatch(f"{label}: chunks of {meta.chunks}, expected ({chunk_len},)")
    if np.dtype(meta.dtype) != np.float32:
        raise ShapeMismatch(f"{label}: dtype {meta.dtype}, expected float32")
    codecs = meta.metadata.codecs
    if (len(codecs) != 2 or not isinstance(codecs[0], BlockQuantCodec)
            or not isinstance(codecs[1], zarr.codecs.Crc32cCodec)):
        raise CorruptObject(f"{label}: its zarr.json names codecs {codecs}, not "
                            f"{ZARR_CODEC_NAME} with crc32c")
    chunk_len = meta.chunks[0]
    chunks = range(meta.cdata_shape[0]) if chunks is None else chunks
    payloads, crcs = {}, {}
    for c in chunks:
        name = meta.metadata.encode_chunk_key((c,))
        if name != f"c/{c}":
            raise CorruptObject(f"{label}: its chunks are not named c/<i>")
        if name not in objects:  # zarr would read it as zeros
            raise PartialObject(
                f"{label}: chunk {store.full_url(f'{prefix}/{name}')} is not in its record")
        blob = objects.pop(name)  # split, so no chunk is copied again when decoded
        payloads[c], crcs[c] = blob[:-4], blob[-4:]
    return Coded(codecs[0].spec, payloads, crcs, chunks, chunk_len, n, label)


def sumsq(value: np.ndarray, block: int = 1 << 16) -> float:
    """The float64 sum of squares of ``value``, a block at a time: no float64 copy of
    the whole vector, and no BLAS call (np.dot), whose threads spin on a busy
    machine and make it several times slower."""
    total = 0.0
    buf = np.empty(min(block, value.size), np.float64)
    for i in range(0, value.size, block):
        v = buf[: min(block, value.size - i)]
        v[...] = value[i:i + block]
        np.multiply(v, v, out=v)
        total += float(v.sum())
    return total


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
