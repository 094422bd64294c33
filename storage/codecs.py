"""Blockwise codecs for outer gradients (docs/algorithms.md section 7).

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
``topk2``     sparse: per chunk of C values the k largest |x|, each a Rice-coded
``topk4``     index gap (about 7.6 bits at 64 of 4096) and a 2- or 4-bit code on
              that chunk's [lo, hi].
              Pinned in storage/sparse.py's docstring, which ``encode``,
              ``decode``, ``roundtrip`` and ``encoded_nbytes`` dispatch to; its
              ``accumulate`` and ``kept`` (re-exported here) read a payload
              without a dense decode. Everything below is about the dense codecs.

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
largest value decodes ``127 * fl(s / 127)`` to inf (the one scale for which the
decode order overflows; int4 and fp4 have none). Both raise
``NonFiniteValues`` in ``encode``; ``decode`` rejects such an int8 scale as
corrupt. Bit-exactness assumes IEEE default rounding without flush-to-zero
(``torch.set_flush_denormal(True)`` in the same process would change subnormals).

Speed: the block codecs work in cache-sized chunks (64Ki elements) with
preallocated buffers, in-place ufuncs and bit tricks (storage/quantizers.py says
which); results are bit-identical to the straightforward formulas above, which
tests/test_codecs.py holds as a reference and checks.

The chunk kernels are in storage/quantizers.py; the zarr v3 codec that stores
these payloads as zarr chunks is in storage/zarr_codec.py.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from storage import sparse
from storage.errors import CorruptObject, NonFiniteValues
from storage.quantizers import (
    ABS_MASK,
    F32_MAX,
    FINITE_LIMIT,
    QMAX,
    Work,
    decode_chunk,
    encode_chunk,
)
from storage.sparse import accumulate, kept
from storage.sparse import as_input as _as_input

__all__ = [
    "CODEC_NAMES", "DENSE_CODECS", "SPARSE_CODECS", "CodecSpec", "accumulate", "decode",
    "encode", "encoded_nbytes", "expected_nbytes", "kept", "roundtrip", "stable_seed",
]

CODEC_NAMES: tuple[str, ...] = ("none", "fp16", "int8", "int4", "fp4-e3m0", "topk2", "topk4")
BLOCK_CODECS: tuple[str, ...] = ("int8", "int4", "fp4-e3m0")
DENSE_CODECS: tuple[str, ...] = ("none", "fp16", "int8", "int4", "fp4-e3m0")
#: top-k per chunk with 2- or 4-bit values (storage/sparse.py)
SPARSE_CODECS: tuple[str, ...] = ("topk2", "topk4")
MAX_BLOCK_SIZE = 2**20
MAX_CHUNK = 2**16  # indices are at most 16 bits

_CHUNK = 1 << 16  # elements per pass; 256 KiB of float32 stays in L2
# |x| >= 65520 (midpoint of fp16 max 65504 and 2**16, a tie to even) rounds to inf
_F16_OVERFLOW = np.float32(65520.0).view(np.uint32)


@dataclass(frozen=True)
class CodecSpec:
    """Which codec and block size a fragment is sent with; stored in the manifest.

    ``block_size`` is B of docs/algorithms.md section 7: smaller blocks track local
    magnitude better but spend 32 bits of scale per B values. ``chunk`` and ``k``
    belong to the sparse codecs only: each chunk of ``chunk`` consecutive values
    sends its ``k`` largest magnitudes (the last, shorter chunk ``min(k, len)``).
    """

    name: str = "none"
    block_size: int = 128
    chunk: int = 4096
    k: int = 64

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
        c, k = self.chunk, self.k
        for field, value in (("chunk", c), ("k", k)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise ValueError(f"{field}: must be an integer, got {value!r}")
        if not 2 <= c <= MAX_CHUNK:
            raise ValueError(f"chunk: must be in [2, {MAX_CHUNK}], got {c}")
        if not 1 <= k <= c:
            raise ValueError(f"k: must be in [1, chunk = {c}], got {k}")
        object.__setattr__(self, "chunk", int(c))
        object.__setattr__(self, "k", int(k))

    @property
    def is_block(self) -> bool:
        """True for the codecs that carry one scale per block."""
        return self.name in BLOCK_CODECS

    @property
    def is_sparse(self) -> bool:
        """True for the top-k codecs (only ``k`` of every ``chunk`` values travel)."""
        return self.name in SPARSE_CODECS

    def to_dict(self) -> dict[str, Any]:
        """The manifest / zarr configuration form: ``{"codec", "block_size"}`` for the
        dense codecs (unchanged since the first runs, so their metadata bytes are too),
        ``{"codec", "chunk", "k"}`` for the sparse ones."""
        if self.is_sparse:
            return {"codec": self.name, "chunk": self.chunk, "k": self.k}
        return {"codec": self.name, "block_size": self.block_size}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CodecSpec:
        """Inverse of ``to_dict``; unknown keys are an error so typos do not pass."""
        unknown = set(data) - {"codec", "block_size", "chunk", "k"}
        if unknown:
            raise ValueError(
                f"codec spec: unknown field(s) {sorted(unknown)}; allowed: codec, "
                "block_size, chunk, k"
            )
        return cls(name=data.get("codec", "none"), block_size=data.get("block_size", 128),
                   chunk=data.get("chunk", 4096), k=data.get("k", 64))


def encoded_nbytes(n: int, spec: CodecSpec) -> int:
    """Payload size for n values, so readers can check a length before decoding:
    exact for the dense codecs, the largest a sparse payload may be."""
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    if spec.is_sparse:
        return sparse.encoded_nbytes(n, spec)
    if spec.name == "none":
        return 4 * n
    if spec.name == "fp16":
        return 2 * n
    nblocks = -(-n // spec.block_size)
    code_bytes = n if spec.name == "int8" else (n + 1) // 2
    return 4 * nblocks + code_bytes


def expected_nbytes(n: int, spec: CodecSpec) -> int:
    """Payload size to plan with: exact for the dense codecs, the mean for the sparse
    ones (their Rice-coded indices vary a little with the kept positions)."""
    if spec.is_sparse:
        return sparse.expected_nbytes(n, spec)
    return encoded_nbytes(n, spec)


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

# ----------------------------------------------------------------------------- drivers


def _chunk_elems(spec: CodecSpec) -> int:
    b = spec.block_size
    return max(b, _CHUNK // b * b)


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
    w = Work(min(chunk, nb_total * b), b)
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
        s = encode_chunk(xc, spec, w, scales[blk : blk + m // b], codes, rng, n_real)
        if decoded is not None:
            if m == n_real:
                decode_chunk(codes, s, spec, w, decoded[start : start + m])
            else:
                tail = np.empty(m, np.float32)
                decode_chunk(codes, s, spec, w, tail)
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
        np.bitwise_and(xc, ABS_MASK, out=t)
        top = max(top, t.max())
    return top


def _encode(x: np.ndarray, spec: CodecSpec, seed: int | None, decoded: np.ndarray | None) -> bytes:
    """Encode x; also write decode(payload) into ``decoded`` when it is given."""
    if seed is not None and spec.name not in QMAX:
        raise ValueError(f"seed: stochastic rounding applies to int8/int4, not {spec.name}")
    if spec.is_sparse:
        if decoded is None:
            return sparse.encode(x, spec)
        return sparse.roundtrip(x, spec, out=decoded)[0]
    if spec.name == "none":
        if _absmax_bits(x) >= FINITE_LIMIT:
            raise NonFiniteValues("encode: input contains NaN or Inf; refusing to send it")
        if decoded is not None:
            np.copyto(decoded, x)
        return x.tobytes()
    if spec.name == "fp16":
        top = _absmax_bits(x)
        if top >= _F16_OVERFLOW:
            what = "NaN or Inf" if top >= FINITE_LIMIT else "values that round to inf in fp16"
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
    if spec.is_sparse:
        return sparse.decode(payload, n, spec, out=out)
    buf = np.frombuffer(payload, np.uint8)
    expected = encoded_nbytes(n, spec)
    if buf.size != expected:
        raise CorruptObject(
            f"decode: {spec.name} payload for {n} values must be {expected} bytes, got {buf.size}"
        )
    if spec.name in ("none", "fp16"):
        out = _output(out, n)
        np.copyto(out, buf.view("<f4" if spec.name == "none" else "<f2"))
        if _absmax_bits(out) >= FINITE_LIMIT:
            raise NonFiniteValues(f"decode: {spec.name} payload holds NaN or Inf")
        return out
    b = spec.block_size
    nb_total = -(-n // b)
    scales = buf[: 4 * nb_total].view("<f4").astype(np.float32)
    if (scales.view(np.uint32) > np.uint32(0x7F7FFFFF)).any():
        raise CorruptObject("decode: a block scale is negative, NaN or Inf")
    if spec.name == "int8" and (scales == F32_MAX).any():
        raise CorruptObject("decode: an int8 block scale of float32 max cannot be encoded")
    codes_all = buf[4 * nb_total :]
    if spec.name != "int8" and n % 2 and codes_all[-1] >> 4:
        raise CorruptObject("decode: the pad nibble after the last value is not 0")
    out = _output(out, n)
    chunk = _chunk_elems(spec)
    w = Work(min(chunk, nb_total * b), b)
    for start in range(0, n, chunk):
        n_real = min(chunk, n - start)
        m = -(-n_real // b) * b
        lo, hi = _code_span(spec, start, n_real)
        blk = start // b
        s = scales[blk : blk + m // b]
        if m == n_real:
            decode_chunk(codes_all[lo:hi], s, spec, w, out[start : start + m])
        else:
            codes = np.zeros(m if spec.name == "int8" else m // 2, np.uint8)
            codes[: hi - lo] = codes_all[lo:hi]
            tail = np.empty(m, np.float32)
            decode_chunk(codes, s, spec, w, tail)
            out[start:] = tail[:n_real]
    return out
