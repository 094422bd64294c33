"""The sparse top-k codecs ``topk2`` and ``topk4`` (docs/algorithms.md, Sparse codecs).

Only a few values of every chunk travel, each with its index and a 2- or 4-bit
code; the sender keeps the rest in its error-feedback residual. Like the dense
codecs (storage/codecs.py) every byte is pinned: the same float32 input gives the
same payload on every machine, and this docstring is the authority.

Input: 1-D float32 ``x`` of n values; ``spec.name`` gives ``b`` value bits (2 for
topk2, 4 for topk4), ``spec.chunk`` is C, ``spec.k`` is k.

* Chunks: chunk c covers ``[c*C, min(n, (c+1)*C))``, of length ``L_c``; it keeps
  ``k_c = min(k, L_c)`` entries.
* Selection: the ``k_c`` entries with the largest ``|x|``, compared as float32
  magnitudes (the uint32 bit patterns of ``|x|``), ties broken by the *lower*
  index. Kept indices are stored relative to the chunk start, ascending.
* Values: the code's top bit (bit ``b-1``) is the sign, set iff ``x < 0`` (so
  -0.0 has it clear); the low ``b-1`` bits are a magnitude code ``j`` in
  ``[0, L-1]``, ``L = 2**(b-1)`` (2 levels for topk2, 8 for topk4). Per chunk
  ``lo = min kept |x|``, ``hi = max kept |x|``, ``w = hi - lo`` (float32).
  Encode ``j = min(L-1, floor(((|x| - lo) / w) * L))``, all in float32, and
  ``j = 0`` when ``w == 0``. Decode ``mag = lo + w * m_j`` in float32 with
  ``m_j = float32((2j+1) / (2L))`` (exact), value ``-mag`` if the sign bit is
  set, else ``mag``. Entries not kept decode to +0.0; an all-zero chunk has
  ``lo = hi = 0`` and decodes to zeros.
* NaN or Inf in ``x`` raises NonFiniteValues; nothing is sent.

Indices are Rice-coded gaps. Within a chunk the kept indices ``i_0 < i_1 < ...``
give gaps ``g_0 = i_0`` and ``g_j = i_j - i_(j-1) - 1``; each gap is ``q * 2**r + m``
with ``r = rice_bits(C, k) = floor(log2(C // k))`` (6 for 64 of 4096), stored as
``m`` in ``r`` bits and ``q`` in unary. Spread at random, 64 of 4096 take 7.6 bits an
index (8.4 for 34 of 4096) against 12 for a fixed width, and never more than ``k_c * (r + 1) + floor((L_c - k_c) / 2**r)`` bits a chunk
(the gaps of a chunk sum to at most ``L_c - k_c``), whatever the positions.

Payload, little-endian::

    header     16 bytes: uint32 n, C, k, b
    scales     per chunk float32 lo, float32 hi (8 bytes a chunk)
    codes      all K = sum(k_c) value codes, b bits each, one LSB-first bit stream:
               entry e occupies bits [e*b, (e+1)*b), bit 0 is the LSB of byte 0;
               zero-padded to a byte
    remainders the K gap remainders m, r bits each, packed the same way, zero-padded
    quotients  the K gap quotients q in unary, in entry order: q zero bits then a one
               bit, one LSB-first bit stream, zero-padded to a byte (the last byte
               holds the last one bit)

The first four parts have fixed sizes; the quotients take the rest, so a payload
is between ``fixed_nbytes(n)`` plus one byte (K > 0) and ``encoded_nbytes(n)``, the
bound above. ``expected_nbytes(n)`` is the mean size for kept positions spread at
random (gaps geometric), which `diloco estimate` uses. ``decode`` raises
CorruptObject with a one-line message for a length outside those bounds, a header
field that disagrees with the spec or n, a scale that is negative (including
-0.0), NaN or Inf or with lo > hi, a quotient stream that does not hold exactly K
one bits with fewer than 8 pad bits after the last, an index outside its chunk, or
non-zero pad bits in the codes or remainders.

Averaging: ``accumulate(payload, n, spec, acc, weight)`` is
``acc += decode(payload) * float32(weight)`` touching only the kept positions
(``acc[idx] += value * w`` in float32), bit-identical to the dense formula for
an ``acc`` that started as +0.0 zeros (a sum of floats that starts at +0.0 is
never -0.0, and adding +-0.0 leaves any other value unchanged).

Speed: rows of a ``(chunks, C)`` view are processed in cache-sized blocks: the
k-th largest magnitude bit pattern of each row comes from ``np.partition``
(SIMD on x86-64), one compare and ``np.nonzero`` give the kept positions in
ascending order, and only rows with ties at that threshold take a cumulative
count to drop the surplus at the highest indices. 1/2/4/8-bit fields pack by
shifts, other widths through ``np.packbits``; the unary stream is a zero array
with ones at ``cumsum(q + 1) - 1``, and decoding it is ``np.flatnonzero`` of the
unpacked bits. tests/test_sparse.py holds the plain reference and checks the bits.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np

from storage.errors import CorruptObject, NonFiniteValues

BITS: dict[str, int] = {"topk2": 2, "topk4": 4}
HEADER_BYTES = 16
_ABS = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)
_MAX_FINITE_BITS = np.uint32(0x7F7FFFFF)
_BLOCK = 1 << 18  # elements per pass: 1 MiB of float32 plus its keys stays in L2


class SparseSpec(Protocol):
    """What this module reads of a `storage.codecs.CodecSpec` (which imports it)."""

    name: str
    chunk: int
    k: int


def rice_bits(chunk: int, k: int) -> int:
    """r, the remainder bits of a Rice-coded gap: ``floor(log2(C // k))``, near the
    best Rice parameter for gaps of mean C / k (6 for 64 of 4096)."""
    return max(0, (chunk // max(1, k)).bit_length() - 1)


def _counts(n: int, spec: SparseSpec) -> tuple[int, int, int]:
    """(full chunks, length of the last partial chunk or 0, K kept entries)."""
    full, tail = divmod(n, spec.chunk)
    return full, tail, full * spec.k + min(spec.k, tail)


def fixed_nbytes(n: int, spec: SparseSpec) -> int:
    """Bytes of everything before the quotient stream: header, scales, codes, remainders."""
    full, tail, kept = _counts(n, spec)
    r, b = rice_bits(spec.chunk, spec.k), BITS[spec.name]
    return HEADER_BYTES + 8 * (full + (tail > 0)) + -(-kept * b // 8) + -(-kept * r // 8)


def _chunk_lengths(n: int, spec: SparseSpec) -> list[tuple[int, int, int]]:
    """(count, L_c, k_c) runs: the full chunks, then the partial one."""
    full, tail, _ = _counts(n, spec)
    runs = [(full, spec.chunk, spec.k)] if full else []
    return runs + ([(1, tail, min(spec.k, tail))] if tail else [])


def encoded_nbytes(n: int, spec: SparseSpec) -> int:
    """The largest payload for n values (module docstring): what a reader accepts."""
    r = rice_bits(spec.chunk, spec.k)
    unary = sum(count * (kc + ((length - kc) >> r)) for count, length, kc in
                _chunk_lengths(n, spec))
    return fixed_nbytes(n, spec) + -(-unary // 8)


def expected_nbytes(n: int, spec: SparseSpec) -> int:
    """Mean payload size when the kept positions of a chunk are spread at random:
    each gap geometric with ``p = k_c / (L_c + 1)``, so ``q`` is geometric with
    ``s = (1 - p)**(2**r)`` and ``E[q] = s / (1 - s)``. The arithmetic of
    `diloco estimate` uses it; clustered positions make payloads smaller."""
    r = rice_bits(spec.chunk, spec.k)
    unary = 0.0
    for count, length, kc in _chunk_lengths(n, spec):
        s = (1.0 - kc / (length + 1)) ** (1 << r)
        unary += count * kc * (1.0 + s / (1.0 - s))
    return fixed_nbytes(n, spec) + round(unary / 8)


def _magnitudes(b: int) -> np.ndarray:
    levels = 1 << (b - 1)
    return ((2 * np.arange(levels) + 1) / (2 * levels)).astype(np.float32)


#: per codec, the magnitude of each code's level (mid-points of [0, 1]); the host's
#: and the device's encoders and the decoder read the same table
MAGS = {name: _magnitudes(b) for name, b in BITS.items()}

# ----------------------------------------------------------------------------- bit streams


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """``values`` (< 2**bits each) as one LSB-first bit stream, zero-padded to a byte."""
    count = values.size
    v = values.astype(np.uint32)
    if bits == 0:
        return np.empty(0, np.uint8)
    if 8 % bits == 0:
        per = 8 // bits
        padded = np.zeros(-(-count // per) * per, np.uint8)
        padded[:count] = v
        rows = padded.reshape(-1, per)
        out = rows[:, 0].copy()
        for i in range(1, per):
            out |= rows[:, i] << np.uint8(i * bits)
        return out
    shifts = np.arange(bits, dtype=np.uint32)
    matrix = ((v[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(matrix.reshape(-1), bitorder="little")


def unpack_bits(stream: np.ndarray, count: int, bits: int) -> np.ndarray:
    """Inverse of `pack_bits` (uint32 values); the caller checks the pad bits."""
    if bits == 0:
        return np.zeros(count, np.uint32)
    if 8 % bits == 0:
        per = 8 // bits
        mask = np.uint8((1 << bits) - 1)
        out = np.empty((stream.size, per), np.uint8)
        for i in range(per):
            out[:, i] = (stream >> np.uint8(i * bits)) & mask
        return out.reshape(-1)[:count].astype(np.uint32)
    flat = np.unpackbits(stream, bitorder="little")[: count * bits].reshape(count, bits)
    return (flat.astype(np.uint32) << np.arange(bits, dtype=np.uint32)).sum(
        axis=1, dtype=np.uint32
    )


def pack_unary(q: np.ndarray) -> np.ndarray:
    """Each ``q`` as q zero bits then a one bit, one LSB-first stream, zero-padded."""
    if q.size == 0:
        return np.empty(0, np.uint8)
    ones = np.cumsum(q.astype(np.int64) + 1) - 1
    stream = np.zeros(int(ones[-1]) + 1, np.uint8)
    stream[ones] = 1
    return np.packbits(stream, bitorder="little")


def unpack_unary(stream: np.ndarray, count: int) -> np.ndarray:
    """Inverse of `pack_unary` (int64 quotients), or CorruptObject if ``stream`` does
    not hold exactly ``count`` codes with fewer than 8 pad bits after the last."""
    ones = np.flatnonzero(np.unpackbits(stream, bitorder="little"))
    if ones.size != count or (count and stream.size != int(ones[-1]) // 8 + 1):
        end = "none" if ones.size == 0 else f"the last in byte {int(ones[-1]) // 8}"
        raise CorruptObject(
            f"decode: the sparse quotient stream of {stream.size} bytes holds {ones.size} "
            f"codes ({end}); the header's chunks need {count}, ending in its last byte"
        )
    return np.diff(ones, prepend=-1) - 1


def _pad_is_clear(stream: np.ndarray, used_bits: int) -> bool:
    rem = used_bits % 8
    return rem == 0 or stream.size == 0 or int(stream[-1]) >> rem == 0

# ----------------------------------------------------------------------------- encode


def as_input(x: np.ndarray, max_values: int | None = None) -> np.ndarray:
    """``x`` as a C-contiguous 1-D float32 array, or the error naming what is wrong:
    every codec's input check (storage/codecs.py uses it too)."""
    x = np.asarray(x)
    if x.dtype.kind != "f" or x.dtype.itemsize != 4:
        raise TypeError(f"encode: expected float32 values, got {x.dtype}")
    if x.ndim != 1:
        raise ValueError(f"encode: expected a 1-D array, got shape {x.shape}")
    if max_values is not None and x.size >= max_values:
        raise ValueError(f"encode: a sparse payload holds fewer than 2**32 values, got {x.size}")
    return np.ascontiguousarray(x, dtype=np.float32)


def _as_input(x: np.ndarray) -> np.ndarray:
    return as_input(x, 1 << 32)  # the header counts values in uint32


def _select_rows(rows: np.ndarray, k: int, scratch: np.ndarray) -> tuple[np.ndarray, ...]:
    """(columns, magnitude bits, negative) of the k kept entries of each row, each (R, k).

    The threshold ``t`` is the k-th largest magnitude; ``a >= t`` keeps exactly k
    unless ``t`` is tied, and then only the first ``k - #(a > t)`` ties stay.
    """
    r, length = rows.shape
    a = np.bitwise_and(rows.view(np.uint32), _ABS, out=scratch[: r * length].reshape(r, length))
    t = np.partition(a, length - k, axis=1)[:, length - k : length - k + 1]
    mask = a >= t
    ri, ci = np.nonzero(mask)
    if ri.size != r * k:
        eq = a == t
        need = k - (a > t).sum(axis=1, keepdims=True)
        mask &= ~eq | (np.cumsum(eq, axis=1, dtype=np.int32) <= need)
        ri, ci = np.nonzero(mask)
    flat = ri * length + ci
    bits = a.reshape(-1)[flat]
    negative = rows.reshape(-1)[flat] < 0
    return ci.reshape(r, k), bits.reshape(r, k), negative.reshape(r, k)


def _quantize(mags: np.ndarray, negative: np.ndarray, b: int) -> tuple[np.ndarray, ...]:
    """(codes, lo, hi) of rows of kept magnitudes (float32, R x k)."""
    lo, hi = mags.min(axis=1), mags.max(axis=1)
    w = hi - lo
    safe = np.where(w == 0, np.float32(1), w)[:, None]
    levels = 1 << (b - 1)
    j = np.floor(((mags - lo[:, None]) / safe) * np.float32(levels))
    np.minimum(j, np.float32(levels - 1), out=j)
    codes = j.astype(np.uint8) | (negative.astype(np.uint8) << np.uint8(b - 1))
    return codes, lo, hi


def _dequantize(codes: np.ndarray, lo: np.ndarray, hi: np.ndarray, name: str) -> np.ndarray:
    """Values of rows of codes (R x k) given each row's lo and hi."""
    b = BITS[name]
    top = np.uint8(1 << (b - 1))
    w = (hi - lo)[:, None]
    mag = lo[:, None] + w * MAGS[name][codes & (top - 1)]
    return np.where(codes & top, -mag, mag)


def _encode_parts(x: np.ndarray, spec: SparseSpec) -> list[tuple[np.ndarray, ...]]:
    """(columns, codes, lo, hi) per block of rows: full chunks, then the partial one."""
    n, c, k, b = x.size, spec.chunk, spec.k, BITS[spec.name]
    full, tail, _ = _counts(n, spec)
    step = max(1, _BLOCK // c)
    scratch = np.empty(min(n, step * c), np.uint32)
    parts = []
    spans = [(r * c, min(step, full - r) * c, c) for r in range(0, full, step)]
    if tail:
        spans.append((full * c, tail, tail))
    for start, size, length in spans:
        rows = x[start : start + size].reshape(-1, length)
        cols, bits, negative = _select_rows(rows, min(k, length), scratch)
        if bits.max() >= _INF_BITS:  # NaN and inf sort above every finite magnitude
            raise NonFiniteValues("encode: input contains NaN or Inf; refusing to send it")
        codes, lo, hi = _quantize(bits.view(np.float32), negative, b)
        parts.append((cols, codes, lo, hi))
    return parts


def assemble(n: int, spec: SparseSpec, parts: list[tuple[np.ndarray, ...]]) -> bytes:
    """The payload of ``n`` values from their encoded chunks' parts (columns, codes,
    low and high scales): the one writer of the layout, for the host's encoder and the
    device's (`diloco.device_codecs`)."""
    header = np.array([n, spec.chunk, spec.k, BITS[spec.name]], "<u4")
    if not parts:
        return header.tobytes()
    scales = np.empty((sum(p[2].size for p in parts), 2), "<f4")
    scales[:, 0] = np.concatenate([p[2] for p in parts])
    scales[:, 1] = np.concatenate([p[3] for p in parts])
    codes = np.concatenate([p[1].reshape(-1) for p in parts])
    gaps = np.concatenate([np.diff(p[0].astype(np.int64), axis=1, prepend=-1).reshape(-1) - 1
                           for p in parts])
    r = rice_bits(spec.chunk, spec.k)
    return b"".join((
        header.tobytes(),
        scales.tobytes(),
        pack_bits(codes, BITS[spec.name]).tobytes(),
        pack_bits(gaps & ((1 << r) - 1), r).tobytes(),
        pack_unary(gaps >> r).tobytes(),
    ))


def _scatter(parts: list[tuple[np.ndarray, ...]], spec: SparseSpec, out: np.ndarray) -> None:
    """Write the decoded kept values of ``parts`` into a zeroed dense ``out``."""
    for idx, values in _kept_parts(parts, spec):
        out[idx] = values


def _kept_parts(
    parts: list[tuple[np.ndarray, ...]], spec: SparseSpec
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(absolute indices, values) per part; parts tile the input in order, the
    partial chunk (if any) last, so each starts ``rows * C`` after the previous."""
    start = 0
    for cols, codes, lo, hi in parts:
        r = cols.shape[0]
        base = start + np.arange(r, dtype=np.int64)[:, None] * spec.chunk
        yield (base + cols).reshape(-1), _dequantize(codes, lo, hi, spec.name).reshape(-1)
        start += r * spec.chunk


def encode(x: np.ndarray, spec: SparseSpec) -> bytes:
    """The payload of the module docstring for a 1-D float32 ``x``."""
    x = _as_input(x)
    return assemble(x.size, spec, _encode_parts(x, spec))


def roundtrip(
    x: np.ndarray, spec: SparseSpec, *, out: np.ndarray | None = None
) -> tuple[bytes, np.ndarray]:
    """``(encode(x), decode(encode(x)))`` in one pass, for error feedback.

    The decoded values come from the same codes and scales as the payload, so the
    residual ``x - decoded`` a worker keeps is exactly what the readers miss.
    """
    x = _as_input(x)
    dense = _dense_out(out, x.size)
    parts = _encode_parts(x, spec)
    dense.fill(0)
    _scatter(parts, spec, dense)
    return assemble(x.size, spec, parts), dense

# ----------------------------------------------------------------------------- decode


def _dense_out(out: np.ndarray | None, n: int) -> np.ndarray:
    if out is None:
        return np.empty(n, np.float32)
    if out.dtype != np.float32 or out.shape != (n,) or not out.flags.c_contiguous:
        raise ValueError(f"out: expected a C-contiguous float32 array of shape ({n},)")
    return out


def _check_header(buf: np.ndarray, n: int, spec: SparseSpec) -> None:
    least = fixed_nbytes(n, spec) + (_counts(n, spec)[2] > 0)
    most = encoded_nbytes(n, spec)
    if not least <= buf.size <= most:
        raise CorruptObject(
            f"decode: {spec.name} payload for {n} values must be {least} to {most} bytes, "
            f"got {buf.size}"
        )
    said = buf[:HEADER_BYTES].view("<u4")
    want = {"n": n, "C": spec.chunk, "k": spec.k, "b": BITS[spec.name]}
    owner = {"n": "the array has", "C": "the codec has", "k": "the codec has",
             "b": f"{spec.name} has"}
    for got, (field, value) in zip(said.tolist(), want.items(), strict=True):
        if got != value:
            raise CorruptObject(
                f"decode: sparse payload header says {field} = {got}, "
                f"{owner[field]} {field} = {value}"
            )


def _check_scales(scales: np.ndarray) -> None:
    bits = scales.view(np.uint32)
    bad = np.flatnonzero((bits > _MAX_FINITE_BITS).any(axis=1) | (scales[:, 0] > scales[:, 1]))
    if bad.size:
        c = int(bad[0])
        lo, hi = scales[c].tolist()
        raise CorruptObject(
            f"decode: sparse chunk {c} has lo = {lo!r}, hi = {hi!r}; "
            "they must be finite, non-negative and lo <= hi"
        )


def _check_indices(cols: np.ndarray, first_chunk: int, length: int) -> None:
    """Indices of rows of chunks of ``length`` values (increasing by construction)
    must lie inside their chunk."""
    if cols.size == 0:
        return
    out_of_range = cols >= length
    if out_of_range.any():
        r, i = np.argwhere(out_of_range)[0]
        raise CorruptObject(
            f"decode: sparse index {int(cols[r, i])} out of range for chunk "
            f"{first_chunk + int(r)} of {length} values"
        )


def _parse(payload: bytes | memoryview, n: int, spec: SparseSpec) -> list[tuple[np.ndarray, ...]]:
    """The (columns, codes, lo, hi) parts of a payload, every check of decode done."""
    buf = np.frombuffer(payload, np.uint8)
    _check_header(buf, n, spec)
    full, tail, kept = _counts(n, spec)
    nchunks = full + (tail > 0)
    r, b = rice_bits(spec.chunk, spec.k), BITS[spec.name]
    at = HEADER_BYTES + 8 * nchunks
    scales = buf[HEADER_BYTES:at].view("<f4").astype(np.float32).reshape(nchunks, 2)
    _check_scales(scales)
    streams = []
    for bits, what in ((b, "code"), (r, "gap remainder")):
        stream = buf[at : at + -(-kept * bits // 8)]
        if not _pad_is_clear(stream, kept * bits):
            raise CorruptObject(f"decode: the pad bits after the last sparse {what} are not 0")
        streams.append(unpack_bits(stream, kept, bits))
        at += stream.size
    gaps = (unpack_unary(buf[at:], kept) << r) | streams[1].astype(np.int64)
    codes = streams[0].astype(np.uint8)
    k, head = spec.k, full * spec.k
    parts = []
    if full:
        cols = np.cumsum(gaps[:head].reshape(full, k) + 1, axis=1) - 1
        parts.append((cols, codes[:head].reshape(full, k), scales[:full, 0], scales[:full, 1]))
    if tail:
        cols = np.cumsum(gaps[head:].reshape(1, -1) + 1, axis=1) - 1
        parts.append((cols, codes[head:].reshape(1, -1), scales[full:, 0], scales[full:, 1]))
    for i, part in enumerate(parts):
        _check_indices(part[0], i * full, spec.chunk if i == 0 and full else tail)
    return parts


def decode(
    payload: bytes | memoryview, n: int, spec: SparseSpec, *, out: np.ndarray | None = None
) -> np.ndarray:
    """Dense float32 values of a payload (zeros where nothing was kept), into ``out``
    if given. Raises CorruptObject (module docstring) before writing ``out``."""
    parts = _parse(payload, n, spec)
    dense = _dense_out(out, n)
    dense.fill(0)
    _scatter(parts, spec, dense)
    return dense


def kept(payload: bytes | memoryview, n: int, spec: SparseSpec) -> tuple[np.ndarray, np.ndarray]:
    """(absolute indices as int64, ascending; float32 values) of the kept entries:
    what a reader that never needs the dense vector works with."""
    pieces = list(_kept_parts(_parse(payload, n, spec), spec))
    if not pieces:
        return np.empty(0, np.int64), np.empty(0, np.float32)
    return (np.concatenate([p[0] for p in pieces]),
            np.concatenate([p[1] for p in pieces]).astype(np.float32, copy=False))


def accumulate(
    payload: bytes | memoryview, n: int, spec: SparseSpec, acc: np.ndarray, weight: float
) -> None:
    """``acc += decode(payload) * float32(weight)``, touching only the kept positions.

    The aggregator and workers average M sparse contributions this way without M
    dense decodes; the bits equal the dense formula (module docstring). The payload
    is checked in full before ``acc`` changes.
    """
    acc = _dense_out(acc, n)
    w = np.float32(weight)
    if not np.isfinite(w):
        raise ValueError(f"weight: must be a finite number, got {weight!r}")
    for idx, values in _kept_parts(_parse(payload, n, spec), spec):
        acc[idx] += values * w
