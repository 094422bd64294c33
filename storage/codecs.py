"""Blockwise codecs for outer gradients (ALGORITHMS.md section 5).

Workers in different regions must agree on the *bytes* of every exchanged
tensor, so each codec here is a pure-numpy function pinned down to the bit:
the same float32 input gives the same payload on every machine.

Codecs (``CodecSpec.name``):

``none``      float32 little-endian, 4 bytes a value.
``fp16``      float16 little-endian (numpy's round-to-nearest-even cast).
``int8``      blockwise absmax, qmax 127, one signed byte a value.
``int4``      blockwise absmax, qmax 7, two's complement nibbles.
``fp4-e3m0``  blockwise absmax, sign bit and 3-bit index into
              ``{0, 2^-6, 2^-5, 2^-4, 2^-3, 2^-2, 2^-1, 2^0}``.

Block codecs cut the flattened input into blocks of ``B = block_size``
consecutive elements; the last block is padded with zeros that are never stored.
Per block ``s = max |x|`` as float32, then

* int8/int4: ``code = clamp(rint(x / s * qmax), -qmax, qmax)``, float32, divide
  first; decode ``code * (s / qmax)``. Because ``|x| <= s`` the IEEE quotient is
  at most 1, so the clamp never binds in the deterministic mode.
* fp4-e3m0: ``r = |x| / s`` in float32, ``e`` the index of the nearest magnitude,
  ties to the smaller one; the sign bit (bit 3) is set iff ``x < 0`` and
  ``e > 0``, so zero is always code 0. Decode ``sign * mag[e] * s``.
* A block with ``s == 0`` has all codes 0 and decodes to zeros.
* Stochastic rounding (int8/int4, ``seed`` given): ``u = Generator(PCG64(seed))
  .random(n, dtype=float32)`` over the n real elements in order, and
  ``code = clamp(floor(x / s * qmax + u), -qmax, qmax)``.

Payload layout (all little-endian, no header: the run manifest holds n and the
spec)::

    none      n float32
    fp16      n float16
    int8      ceil(n/B) float32 scales, then n int8 codes
    int4      ceil(n/B) float32 scales, then ceil(n/2) bytes; element 2i in the
    fp4-e3m0  low nibble of byte i, element 2i+1 in the high nibble; for odd n
              the last high nibble is 0

Two limits the formulas above imply, enforced rather than silently broken:
fp16 rounds ``|x| >= 65520`` to inf, and int8 with ``s`` equal to float32's
largest value decodes ``127 * fl(s / 127)`` to inf (the one scale for which
section 5's "this order cannot overflow" fails; int4 has none). Both raise
``NonFiniteValues`` in ``encode``; ``decode`` rejects such an int8 scale as
corrupt. Bit-exactness assumes IEEE default rounding without flush-to-zero
(``torch.set_flush_denormal(True)`` in the same process would change subnormals).

Speed: a plain numpy expression over a 256 MB tensor walks main memory once per
operation. Here the work is done in cache-sized chunks (64Ki elements) with
preallocated buffers and in-place ufuncs; the absmax is a ``reduceat`` over
block starts on the uint32 bit pattern (``bits & 0x7fffffff``, whose order equals float order for non-negative
floats and puts NaN and inf above every finite value, so one compare also
detects non-finite input), and ``rint`` plus the cast to int8 are done by adding
``1.5 * 2**23``, after which the low byte of the float's bit pattern is the two's
complement code (exact round-half-to-even for ``|v| < 2**22``). Results are
bit-identical to the straightforward formulas; tests/test_codecs.py holds that
reference and checks it.

``BlockQuantCodec`` wraps the same functions as the zarr v3 array-to-bytes codec
``diloco.blockquant``; ``zarr_array_codecs`` adds a crc32c checksum to every
chunk. A flipped byte in a stored chunk makes zarr's ``Crc32cCodec`` raise a
plain ``ValueError`` ("Stored and computed checksum do not match") on read.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr.codecs
import zarr.registry
from zarr.abc.codec import ArrayBytesCodec
from zarr.core.common import JSON, parse_named_configuration

from storage.errors import CorruptObject, NonFiniteValues

if TYPE_CHECKING:
    from typing import Self

    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer, NDBuffer

CODEC_NAMES: tuple[str, ...] = ("none", "fp16", "int8", "int4", "fp4-e3m0")
BLOCK_CODECS: tuple[str, ...] = ("int8", "int4", "fp4-e3m0")
QMAX: dict[str, int] = {"int8": 127, "int4": 7}
MAX_BLOCK_SIZE = 2**20
FP4_MAGNITUDES = np.array([0.0] + [2.0**k for k in range(-6, 1)], dtype=np.float32)

ZARR_CODEC_NAME = "diloco.blockquant"
_CHUNK = 1 << 16  # elements per pass; 256 KiB of float32 stays in L2
_MAGIC = np.float32(1.5 * 2**23)  # v + _MAGIC has round_half_even(v) in its low bits
_ABS_MASK = np.uint32(0x7FFFFFFF)
_FINITE_LIMIT = np.uint32(0x7F800000)  # bit pattern of +inf
_F32_MAX = np.finfo(np.float32).max
# |x| >= 65520 (midpoint of fp16 max 65504 and 2**16, a tie to even) rounds to inf
_F16_OVERFLOW = np.float32(65520.0).view(np.uint32)


@dataclass(frozen=True)
class CodecSpec:
    """Which codec and block size a fragment is sent with; stored in the manifest.

    ``block_size`` is B of ALGORITHMS.md section 5: smaller blocks track local
    magnitude better but spend 32 bits of scale per B values.
    """

    name: str = "none"
    block_size: int = 128

    def __post_init__(self) -> None:
        if self.name not in CODEC_NAMES:
            raise ValueError(
                f"codec: unknown codec {self.name!r}; allowed: {', '.join(CODEC_NAMES)}"
            )
        b = self.block_size
        if (
            isinstance(b, bool)
            or not isinstance(b, int | np.integer)
            or not (2 <= b <= MAX_BLOCK_SIZE)
            or b % 2
        ):
            raise ValueError(
                f"block_size: must be an even integer in [2, {MAX_BLOCK_SIZE}], got {b!r}"
            )
        object.__setattr__(self, "block_size", int(b))

    @property
    def is_block(self) -> bool:
        """True for the codecs that carry one scale per block."""
        return self.name in BLOCK_CODECS

    def to_dict(self) -> dict[str, Any]:
        """The manifest / zarr configuration form, ``{"codec": ..., "block_size": ...}``."""
        return {"codec": self.name, "block_size": self.block_size}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CodecSpec:
        """Inverse of ``to_dict``; unknown keys are an error so typos do not pass."""
        unknown = set(data) - {"codec", "block_size"}
        if unknown:
            raise ValueError(
                f"codec spec: unknown field(s) {sorted(unknown)}; allowed: codec, block_size"
            )
        return cls(name=data.get("codec", "none"), block_size=data.get("block_size", 128))


def encoded_nbytes(n: int, spec: CodecSpec) -> int:
    """Exact payload size for n values, so readers can check a length before decoding."""
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    if spec.name == "none":
        return 4 * n
    if spec.name == "fp16":
        return 2 * n
    nblocks = -(-n // spec.block_size)
    code_bytes = n if spec.name == "int8" else (n + 1) // 2
    return 4 * nblocks + code_bytes


def stable_seed(*parts: str | int) -> int:
    """A 64-bit seed from e.g. (run, fragment, round, worker), equal on every machine.

    Python's ``hash()`` is salted per process, so blake2b over a length-prefixed,
    type-tagged encoding is used instead ("1" and 1 give different seeds).
    """
    h = hashlib.blake2b(digest_size=8, person=b"diloco-seed")
    for p in parts:
        if isinstance(p, bool) or not isinstance(p, str | int):
            raise TypeError(f"stable_seed parts must be str or int, got {type(p).__name__}")
        tag, raw = (b"s", p.encode()) if isinstance(p, str) else (b"i", str(p).encode())
        h.update(tag + len(raw).to_bytes(8, "little") + raw)
    return int.from_bytes(h.digest(), "little")


# ----------------------------------------------------------------------------- kernels
#
# Each kernel handles one chunk of m elements, m a multiple of B, entirely in
# preallocated scratch (``_Work``). The bit tricks read multi-byte words as
# little-endian, which is why the module refuses big-endian hosts at import.

if not np.little_endian:  # pragma: no cover
    raise ImportError("storage.codecs assumes a little-endian host (x86-64, arm64)")


def _fp4_pair_table() -> np.ndarray:
    """uint64 per byte value: the two decoded fp4 unit values (low nibble first) as float32."""
    signed = np.concatenate([FP4_MAGNITUDES, -FP4_MAGNITUDES]).astype(np.float32)
    pairs = np.empty((256, 2), np.float32)
    byte = np.arange(256)
    pairs[:, 0] = signed[byte & 0xF]
    pairs[:, 1] = signed[byte >> 4]
    return pairs.view(np.uint64).reshape(256)


_FP4_PAIRS = _fp4_pair_table()


class _Work:
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


def _block_scales(x: np.ndarray, spec: CodecSpec, w: _Work) -> tuple[np.ndarray, np.ndarray]:
    """Absmax per block (w.s) and the divisor, 1 for an all-zero block (w.d).

    Leaves |x| in w.f for fp4. The max is taken over uint32 bit patterns: for
    non-negative floats their order is the float order, NaN/inf blocks come out
    >= 0x7f800000, and it is several times faster than numpy's NaN-aware float
    max. ``reduceat`` over block starts is about 3x faster again than
    ``max(axis=1)`` on a (nblocks, B) view, which pays iterator overhead per row.
    """
    m, b = x.size, spec.block_size
    nb = m // b
    absbits = w.f[:m].view(np.uint32)
    np.bitwise_and(x.view(np.uint32), _ABS_MASK, out=absbits)
    s = w.s[:nb]
    np.maximum.reduceat(absbits, w.starts[:nb], out=s.view(np.uint32))
    if (s.view(np.uint32) >= _FINITE_LIMIT).any():
        raise NonFiniteValues("encode: input contains NaN or Inf; refusing to send it")
    if spec.name == "int8" and (s == _F32_MAX).any():
        raise NonFiniteValues(
            "encode: an int8 block's absmax is float32 max, and 127 * (s / 127) would decode to inf"
        )
    div = w.d[:nb]
    np.copyto(div, s)
    div[s == 0] = 1.0
    return s, div


def _encode_chunk(
    x: np.ndarray,
    spec: CodecSpec,
    w: _Work,
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


def _fp4_codes(x: np.ndarray, r: np.ndarray, w: _Work, codes_out: np.ndarray) -> None:
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
    np.clip(t, 0, 121, out=t)  # clip: numpy's scalar integer min/max are 3x slower
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


def _decode_chunk(
    codes: np.ndarray, s: np.ndarray, spec: CodecSpec, w: _Work, out: np.ndarray
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


# ----------------------------------------------------------------------------- drivers


def _chunk_elems(spec: CodecSpec) -> int:
    b = spec.block_size
    return max(b, _CHUNK // b * b)


def _as_input(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.kind != "f" or x.dtype.itemsize != 4:
        raise TypeError(f"encode: expected float32 values, got {x.dtype}")
    if x.ndim != 1:
        raise ValueError(f"encode: expected a 1-D array, got shape {x.shape}")
    return np.ascontiguousarray(x, dtype=np.float32)


def _code_span(spec: CodecSpec, start: int, count: int) -> tuple[int, int]:
    """Byte range in the code stream of elements [start, start + count); start is even."""
    if spec.name == "int8":
        return start, start + count
    return start // 2, start // 2 + (count + 1) // 2


def _encode_blocks(
    x: np.ndarray, spec: CodecSpec, seed: int | None, decoded: np.ndarray | None
) -> bytes:
    """Chunk loop of the block codecs; fills ``decoded`` too when given (roundtrip).

    Codes are built in a cache-resident buffer and appended to a BytesIO sized
    up front: its ``getvalue()`` then hands over its buffer without the full
    copy that ``ndarray.tobytes()`` would make (a fifth of int8 encode time).
    """
    n, b = x.size, spec.block_size
    if n == 0:
        return b""
    nb_total = -(-n // b)
    scales = np.empty(nb_total, "<f4")
    chunk = _chunk_elems(spec)
    w = _Work(min(chunk, nb_total * b), b)
    rng = None if seed is None else np.random.Generator(np.random.PCG64(seed))
    out = io.BytesIO()
    out.seek(encoded_nbytes(n, spec) - 1)
    out.write(b"\0")
    out.seek(4 * nb_total)
    for start in range(0, n, chunk):
        n_real = min(chunk, n - start)
        m = -(-n_real // b) * b
        xc = x[start : start + n_real]
        if m != n_real:  # last, partial block: pad with zeros, store only the real part
            xc = np.concatenate([xc, np.zeros(m - n_real, np.float32)])
        codes = w.codes[: m if spec.name == "int8" else m // 2]
        blk = start // b
        s = _encode_chunk(xc, spec, w, scales[blk : blk + m // b], codes, rng, n_real)
        if decoded is not None:
            if m == n_real:
                _decode_chunk(codes, s, spec, w, decoded[start : start + m])
            else:
                tail = np.empty(m, np.float32)
                _decode_chunk(codes, s, spec, w, tail)
                decoded[start:] = tail[:n_real]
        lo, hi = _code_span(spec, start, n_real)
        out.write(codes[: hi - lo])
    out.seek(0)
    out.write(scales)
    return out.getvalue()


def encode(x: np.ndarray, spec: CodecSpec, seed: int | None = None) -> bytes:
    """Encode a 1-D float32 array into the payload pinned in the module docstring.

    ``seed`` switches int8/int4 to stochastic rounding (see ``stable_seed``); it
    is an error for the other codecs, which have nothing to round stochastically.
    Raises NonFiniteValues for NaN/Inf input, which must never be sent.
    """
    return _encode(_as_input(x), spec, seed, None)


def roundtrip(
    x: np.ndarray, spec: CodecSpec, seed: int | None = None, *, out: np.ndarray | None = None
) -> tuple[bytes, np.ndarray]:
    """``(encode(x), decode(encode(x)))`` in one pass, for error feedback.

    The residual kept by a worker is ``x - decoded``. Each chunk is decoded by
    the same kernel as ``decode`` while its codes are still in cache, so the
    result is bit-identical and the payload is not read back; the decoded array
    itself still has to be written, so pass a reused ``out`` (float32, n) when
    this runs every round.
    """
    x = _as_input(x)
    decoded = _output(out, x.size)
    payload = _encode(x, spec, seed, decoded)
    return payload, decoded


def _absmax_bits(x: np.ndarray) -> np.uint32:
    """Largest |x| as a uint32 bit pattern, chunk by chunk (NaN and inf sort above finite).

    One cache-resident pass instead of ``np.isfinite(x).all()``, which would
    write and reread a full-size boolean array.
    """
    top = np.uint32(0)
    buf = np.empty(min(_CHUNK, x.size), np.uint32)
    for start in range(0, x.size, _CHUNK):
        xc = x[start : start + _CHUNK].view(np.uint32)
        t = buf[: xc.size]
        np.bitwise_and(xc, _ABS_MASK, out=t)
        top = max(top, t.max())
    return top


def _encode(x: np.ndarray, spec: CodecSpec, seed: int | None, decoded: np.ndarray | None) -> bytes:
    """Encode x; also write decode(payload) into ``decoded`` when it is given."""
    if seed is not None and spec.name not in QMAX:
        raise ValueError(f"seed: stochastic rounding applies to int8/int4, not {spec.name}")
    if spec.name == "none":
        if _absmax_bits(x) >= _FINITE_LIMIT:
            raise NonFiniteValues("encode: input contains NaN or Inf; refusing to send it")
        if decoded is not None:
            np.copyto(decoded, x)
        return x.tobytes()
    if spec.name == "fp16":
        top = _absmax_bits(x)
        if top >= _F16_OVERFLOW:
            what = "NaN or Inf" if top >= _FINITE_LIMIT else "values that round to inf in fp16"
            raise NonFiniteValues(f"encode: input contains {what}; refusing to send it")
        h = x.astype("<f2")
        if decoded is not None:
            np.copyto(decoded, h)
        return h.tobytes()
    return _encode_blocks(x, spec, seed, decoded)


def _output(out: np.ndarray | None, n: int) -> np.ndarray:
    if out is None:
        return np.empty(n, np.float32)
    if out.dtype != np.float32 or out.shape != (n,) or not out.flags.c_contiguous:
        raise ValueError(f"out: expected a C-contiguous float32 array of shape ({n},)")
    return out


def decode(
    payload: bytes | memoryview, n: int, spec: CodecSpec, *, out: np.ndarray | None = None
) -> np.ndarray:
    """Decode a payload of n values to float32, into ``out`` if given, else a new array.

    Passing a reused ``out`` (float32, C-contiguous, n elements) saves the page
    faults of a fresh array, which for 256 MB cost about as much as the decode.
    If decoding fails, ``out`` holds unspecified values.

    Raises CorruptObject if the length differs from ``encoded_nbytes(n, spec)``,
    a scale is negative (including -0), NaN or Inf, a code is outside
    [-qmax, qmax], or the unused pad nibble is not 0; NonFiniteValues if a
    none/fp16 payload holds NaN or Inf. A corrupt payload never turns into zeros.
    """
    buf = np.frombuffer(payload, np.uint8)
    expected = encoded_nbytes(n, spec)
    if buf.size != expected:
        raise CorruptObject(
            f"decode: {spec.name} payload for {n} values must be {expected} bytes, got {buf.size}"
        )
    if spec.name in ("none", "fp16"):
        out = _output(out, n)
        np.copyto(out, buf.view("<f4" if spec.name == "none" else "<f2"))
        if _absmax_bits(out) >= _FINITE_LIMIT:
            raise NonFiniteValues(f"decode: {spec.name} payload holds NaN or Inf")
        return out
    b = spec.block_size
    nb_total = -(-n // b)
    scales = buf[: 4 * nb_total].view("<f4").astype(np.float32)
    if (scales.view(np.uint32) > np.uint32(0x7F7FFFFF)).any():
        raise CorruptObject("decode: a block scale is negative, NaN or Inf")
    if spec.name == "int8" and (scales == _F32_MAX).any():
        raise CorruptObject("decode: an int8 block scale of float32 max cannot be encoded")
    codes_all = buf[4 * nb_total :]
    if spec.name != "int8" and n % 2 and codes_all[-1] >> 4:
        raise CorruptObject("decode: the pad nibble after the last value is not 0")
    out = _output(out, n)
    chunk = _chunk_elems(spec)
    w = _Work(min(chunk, nb_total * b), b)
    for start in range(0, n, chunk):
        n_real = min(chunk, n - start)
        m = -(-n_real // b) * b
        lo, hi = _code_span(spec, start, n_real)
        blk = start // b
        s = scales[blk : blk + m // b]
        if m == n_real:
            _decode_chunk(codes_all[lo:hi], s, spec, w, out[start : start + m])
        else:
            codes = np.zeros(m if spec.name == "int8" else m // 2, np.uint8)
            codes[: hi - lo] = codes_all[lo:hi]
            tail = np.empty(m, np.float32)
            _decode_chunk(codes, s, spec, w, tail)
            out[start:] = tail[:n_real]
    return out


# ----------------------------------------------------------------------------- zarr


@dataclass(frozen=True)
class BlockQuantCodec(ArrayBytesCodec):
    """zarr v3 array-to-bytes codec ``diloco.blockquant``: a float32 chunk,
    flattened in C order, stored as ``encode(chunk, spec)``.

    The array dtype stays float32 for every codec, so readers never care how a
    fragment travelled; the configuration ``{"codec", "block_size"}`` in the
    array metadata says how to decode it.
    """

    is_fixed_size = True

    spec: CodecSpec

    def __init__(self, *, codec: str = "int8", block_size: int = 128) -> None:
        object.__setattr__(self, "spec", CodecSpec(name=codec, block_size=block_size))

    @classmethod
    def from_dict(cls, data: dict[str, JSON]) -> Self:
        _, config = parse_named_configuration(data, ZARR_CODEC_NAME, require_configuration=False)
        spec = CodecSpec.from_dict(dict(config or {}))
        return cls(codec=spec.name, block_size=spec.block_size)

    def to_dict(self) -> dict[str, JSON]:
        return {"name": ZARR_CODEC_NAME, "configuration": self.spec.to_dict()}

    def validate(self, *, shape: tuple[int, ...], dtype: Any, chunk_grid: Any) -> None:
        native = dtype.to_native_dtype()
        if native != np.dtype(np.float32):
            raise ValueError(f"{ZARR_CODEC_NAME}: array dtype must be float32, got {native}")

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        n = int(np.prod(chunk_spec.shape))
        values = decode(chunk_bytes.as_numpy_array(), n, self.spec).reshape(chunk_spec.shape)
        return chunk_spec.prototype.nd_buffer.from_numpy_array(values)

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        return self._decode_sync(chunk_bytes, chunk_spec)

    def _encode_sync(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        flat = np.ascontiguousarray(chunk_array.as_numpy_array(), dtype=np.float32).reshape(-1)
        return chunk_spec.prototype.buffer.from_bytes(encode(flat, self.spec))

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        return self._encode_sync(chunk_array, chunk_spec)

    def compute_encoded_size(self, input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        return encoded_nbytes(input_byte_length // 4, self.spec)


zarr.registry.register_codec(ZARR_CODEC_NAME, BlockQuantCodec)


def zarr_array_codecs(spec: CodecSpec) -> dict[str, Any]:
    """Keyword arguments for ``zarr.create_array``: our serializer plus crc32c.

    The checksum covers each stored chunk, so a flipped byte in object storage
    fails the read (zarr raises ValueError) instead of decoding to wrong numbers.
    """
    return {
        "serializer": BlockQuantCodec(codec=spec.name, block_size=spec.block_size),
        "compressors": [zarr.codecs.Crc32cCodec()],
    }
