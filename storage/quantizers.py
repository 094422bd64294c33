"""The block quantizers of storage/codecs.py, one cache-sized chunk at a time.

`storage.codecs` owns the formulas and the payload layout (its module docstring)
and cuts the input into chunks; the kernels here turn one chunk of ``m`` float32
values (``m`` a multiple of the block size B) into scales and packed codes and
back, entirely in preallocated scratch (`Work`), bit-identical to the formulas.

Speed: a plain numpy expression over a 256 MB tensor walks main memory once per
operation. Here the work is done in cache-sized chunks with preallocated buffers
and in-place ufuncs; the absmax is a ``reduceat`` over block starts on the uint32
bit pattern (``bits & 0x7fffffff``, whose order equals float order for
non-negative floats and puts NaN and inf above every finite value, so one compare
also detects non-finite input), and ``rint`` plus the cast to int8 are done by
adding ``1.5 * 2**23``, after which the low byte of the float's bit pattern is the
two's complement code (exact round-half-to-even for ``|v| < 2**22``). The bit
tricks read multi-byte words as little-endian, which is why the module refuses
big-endian hosts at import. tests/test_codecs.py holds the straightforward
reference and checks the bits against it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from storage.errors import CorruptObject, NonFiniteValues


class BlockSpec(Protocol):
    """What the kernels read of a `storage.codecs.CodecSpec` (which imports this
    module, so it is named by its shape here)."""

    name: str
    block_size: int

if not np.little_endian:  # pragma: no cover
    raise ImportError("storage.quantizers assumes a little-endian host (x86-64, arm64)")

QMAX: dict[str, int] = {"int8": 127, "int4": 7}
FP4_MAGNITUDES = np.array([0.0] + [2.0**k for k in range(-6, 1)], dtype=np.float32)
ABS_MASK = np.uint32(0x7FFFFFFF)
FINITE_LIMIT = np.uint32(0x7F800000)  # bit pattern of +inf
F32_MAX = np.finfo(np.float32).max
_MAGIC = np.float32(1.5 * 2**23)  # v + _MAGIC has round_half_even(v) in its low bits


def _fp4_pair_table() -> np.ndarray:
    """uint64 per byte value: the two decoded fp4 unit values (low nibble first) as float32."""
    signed = np.concatenate([FP4_MAGNITUDES, -FP4_MAGNITUDES]).astype(np.float32)
    pairs = np.empty((256, 2), np.float32)
    byte = np.arange(256)
    pairs[:, 0] = signed[byte & 0xF]
    pairs[:, 1] = signed[byte >> 4]
    return pairs.view(np.uint64).reshape(256)


_FP4_PAIRS = _fp4_pair_table()


class Work:
    """Scratch buffers of one encode/decode call, reused by every chunk."""

    def __init__(self, chunk: int, block: int) -> None:
        nb = chunk // block
        self.f = np.empty(chunk, np.float32)  # |x| bits, quotients, float codes
        self.r = np.empty(chunk, np.float32)  # random draws
        self.i = np.empty(chunk, np.int32)  # fp4 exponent arithmetic
        self.j = np.empty(chunk, np.int32)
        self.u16 = np.empty(chunk // 2, np.uint16)  # byte pairs for nibble (un)packing
        self.u16b = np.empty(chunk // 2, np.uint16)
        self.codes = np.empty(chunk, np.uint8)  # packed codes of one chunk
        self.s = np.empty(nb, np.float32)  # scales
        self.d = np.empty(nb, np.float32)  # divisor on encode, step on decode
        self.starts = np.arange(0, chunk, block)  # block starts, for reduceat


def _block_scales(x: np.ndarray, spec: BlockSpec, w: Work) -> tuple[np.ndarray, np.ndarray]:
    """Absmax per block (w.s) and the divisor, 1 for an all-zero block (w.d).

    Leaves |x| in w.f for fp4. The max is taken over uint32 bit patterns: for
    non-negative floats their order is the float order, NaN/inf blocks come out
    >= 0x7f800000, and it is faster than numpy's NaN-aware float max.
    ``reduceat`` over block starts is faster again than ``max(axis=1)`` on a
    (nblocks, B) view, which pays iterator overhead per row (the timings:
    docs/algorithms.md, "Block codecs, exactly").
    """
    m, b = x.size, spec.block_size
    nb = m // b
    absbits = w.f[:m].view(np.uint32)
    np.bitwise_and(x.view(np.uint32), ABS_MASK, out=absbits)
    s = w.s[:nb]
    np.maximum.reduceat(absbits, w.starts[:nb], out=s.view(np.uint32))
    if (s.view(np.uint32) >= FINITE_LIMIT).any():
        raise NonFiniteValues("encode: input contains NaN or Inf; refusing to send it")
    if spec.name == "int8" and (s == F32_MAX).any():
        raise NonFiniteValues(
            "encode: an int8 block's absmax is float32 max, and 127 * (s / 127) would decode to inf"
        )
    div = w.d[:nb]
    np.copyto(div, s)
    div[s == 0] = 1.0
    return s, div


def encode_chunk(
    x: np.ndarray,
    spec: BlockSpec,
    w: Work,
    scales_out: np.ndarray,
    codes_out: np.ndarray,
    rng: np.random.Generator | None,
    n_real: int,
) -> np.ndarray:
    """Encode x (m elements, a multiple of B) into scales_out and codes_out.

    Returns the native-order scales (a view of w.s) for a following decode.
    n_real is how many leading elements are real data (the rest is padding), so
    stochastic rounding draws exactly one number per real element.
    """
    m, b = x.size, spec.block_size
    nb = m // b
    s, div = _block_scales(x, spec, w)
    np.copyto(scales_out, s)
    v = w.f[:m]
    if spec.name == "fp4-e3m0":
        np.divide(v.reshape(nb, b), div[:, None], out=v.reshape(nb, b))  # w.f held |x|
        _fp4_codes(x, v, w, codes_out)
        return s
    np.divide(x.reshape(nb, b), div[:, None], out=v.reshape(nb, b))
    q = np.float32(QMAX[spec.name])
    np.multiply(v, q, out=v)
    dest = codes_out if spec.name == "int8" else w.u16[: m // 2].view(np.uint8)
    if rng is None:
        # |v| <= 127 < 2**22: v + 1.5 * 2**23 rounds half to even at the units
        # place, and the low byte of its bits is the two's complement code.
        np.add(v, _MAGIC, out=v)
        np.copyto(dest, v.view(np.int32), casting="unsafe")
    else:
        u = w.r[:m]
        rng.random(n_real, dtype=np.float32, out=u[:n_real])
        u[n_real:] = 0.0
        np.add(v, u, out=v)
        np.floor(v, out=v)
        np.clip(v, -q, q, out=v)
        np.copyto(dest.view(np.int8), v, casting="unsafe")
    if spec.name == "int4":
        _pack_nibbles(w.u16[: m // 2], w.u16b[: m // 2], codes_out)
    return s


def _pack_nibbles(pairs: np.ndarray, tmp: np.ndarray, out: np.ndarray) -> None:
    """Byte pairs (b0, b1), read as the uint16 b0 | b1 << 8, to (b0 & 15) | (b1 & 15) << 4.

    Working on uint16 pairs instead of strided even/odd views keeps every pass
    contiguous. ``pairs`` is overwritten.
    """
    np.bitwise_and(pairs, 0x000F, out=tmp)
    np.right_shift(pairs, 4, out=pairs)
    np.bitwise_and(pairs, 0x00F0, out=pairs)
    np.bitwise_or(tmp, pairs, out=tmp)
    np.copyto(out, tmp, casting="unsafe")


def _fp4_codes(x: np.ndarray, r: np.ndarray, w: Work, codes_out: np.ndarray) -> None:
    """Packed fp4 codes for r = |x| / s in [0, 1], in int32 arithmetic on the bits of r.

    For r >= 2^-6 the nearest power of two, ties down, has the biased exponent
    (bits(r) + 0x3fffff) >> 23: a mantissa above 0x400000 (r above 1.5 * 2^E)
    carries into the exponent, exactly 0x400000 does not. Index e = exponent - 120.
    Below 2^-6 the choice is 0 or 2^-6 with the midpoint 2^-7, i.e. e = 1 iff the
    exponent rounded *up*, (bits(r) + 0x7fffff) >> 23, exceeds 120. Both cases
    are max(round_exp, min(ceil_exp, 121)) - 120, floored at 0.
    """
    m = x.size
    e, t = w.i[:m], w.j[:m]
    bits = r.view(np.int32)
    np.add(bits, 0x7FFFFF, out=t)
    np.right_shift(t, 23, out=t)
    np.clip(t, 0, 121, out=t)  # clip: numpy's scalar integer min/max are slower
    np.add(bits, 0x3FFFFF, out=e)
    np.right_shift(e, 23, out=e)
    np.maximum(e, t, out=e)
    np.subtract(e, 120, out=e)
    np.clip(e, 0, 7, out=e)
    # sign bit 8 only where x < 0 and e > 0, so zero is always code 0
    np.clip(e, 0, 1, out=t)
    sign = w.r[:m].view(np.int32)
    np.right_shift(x.view(np.int32), 31, out=sign)  # -1 where the sign bit is set
    np.bitwise_and(sign, 8, out=sign)
    np.multiply(t, sign, out=t)
    np.bitwise_or(e, t, out=e)
    pairs = w.u16[: m // 2]
    np.copyto(pairs.view(np.uint8), e, casting="unsafe")
    _pack_nibbles(pairs, w.u16b[: m // 2], codes_out)


def decode_chunk(
    codes: np.ndarray, s: np.ndarray, spec: BlockSpec, w: Work, out: np.ndarray
) -> None:
    """Decode one chunk: codes (uint8; m or m/2 bytes) and native scales s into out (m)."""
    m, b = out.size, spec.block_size
    nb = m // b
    out2 = out.reshape(nb, b)
    if spec.name == "fp4-e3m0":
        # one gather yields both float32 unit values of a byte
        np.take(_FP4_PAIRS, codes, out=out.view(np.uint64), mode="wrap")
        np.multiply(out2, s[:, None], out=out2)
        return
    step = w.d[:nb]
    np.divide(s, np.float32(QMAX[spec.name]), out=step)
    if spec.name == "int8":
        if (codes == 0x80).any():
            raise CorruptObject("decode: int8 code -128 is outside [-127, 127]")
        np.copyto(out, codes.view(np.int8))
    else:
        # byte hhhhllll -> uint16 0000hhhh0000llll -> << 4 -> int8 pair (l<<4, h<<4)
        # -> arithmetic >> 4 sign-extends both nibbles
        pairs, tmp = w.u16[: m // 2], w.u16b[: m // 2]
        np.copyto(pairs, codes)
        np.left_shift(pairs, 4, out=tmp)
        np.bitwise_or(pairs, tmp, out=pairs)
        np.bitwise_and(pairs, 0x0F0F, out=pairs)
        np.left_shift(pairs, 4, out=pairs)
        nib = pairs.view(np.int8)
        if (nib == -128).any():
            raise CorruptObject("decode: int4 code -8 is outside [-7, 7]")
        np.right_shift(nib, 4, out=nib)
        np.copyto(out, nib)
    np.multiply(out2, step[:, None], out=out2)
