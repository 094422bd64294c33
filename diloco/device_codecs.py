"""The exchange codecs in torch, on the tensor's own device: the same bytes as
`storage.codecs`, without taking a GPU's fragment through the host first.

`storage.codecs` pins every payload to the bit in numpy, on the CPU. A worker
training on a GPU with ``sync.outer.device: device`` holds its outer gradient and
error-feedback residual on the GPU; encoding there moves only the payload to the
host (an eighth of the float32 bytes for int4, a fortieth for topk2) and keeps the
encode off the host's cores. Every function here gives, for the same float32
input, exactly the payload and decoded values of its `storage.codecs` counterpart
(tests/test_device_codecs.py holds them to it on the CPU; `scripts/gpu_check.py
--all` on a GPU). That works because each step is one IEEE float32 operation
(torch's CUDA division of two tensors and its multiplication are correctly rounded,
nothing is fused into an FMA in eager mode, no flush-to-zero) or integer arithmetic on
bit patterns. Never divide by a Python number here: on CUDA torch multiplies by its
reciprocal instead, which is one rounding off the quotient numpy computes.

Covered: ``none``, ``int8``, ``int4`` and ``fp4-e3m0`` (round to nearest) and
``topk2``/``topk4`` (selection and quantisation on the device; the Rice-coded index
stream, a few bytes per kept value, is packed on the host by storage/sparse.py).
Not covered, so `supported` says False and the caller encodes on the host: ``fp16``
(rare for outer gradients) and stochastic rounding (``seed``), whose random draws
are numpy's PCG64 stream.
"""

from __future__ import annotations

import numpy as np
import torch

from storage import sparse
from storage.codecs import CodecSpec, encoded_nbytes
from storage.errors import CorruptObject, NonFiniteValues
from storage.quantizers import FP4_MAGNITUDES, QMAX

__all__ = ["decode", "encode", "roundtrip", "supported"]

_ABS = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_F32_MAX_BITS = 0x7F7FFFFF
_DEVICE_CODECS = ("none", "int8", "int4", "fp4-e3m0", "topk2", "topk4")


def supported(spec: CodecSpec, seed: int | None = None) -> bool:
    """Whether this module encodes ``spec`` (else `storage.codecs` must, on the host)."""
    return spec.name in _DEVICE_CODECS and seed is None


def encode(x: torch.Tensor, spec: CodecSpec) -> bytes:
    """``storage.codecs.encode(x, spec)`` computed on ``x``'s device."""
    return roundtrip(x, spec, decoded=False)[0]


def roundtrip(x: torch.Tensor, spec: CodecSpec, *, decoded: bool = True
              ) -> tuple[bytes, torch.Tensor | None]:
    """(payload, decode(payload) on ``x``'s device), as ``storage.codecs.roundtrip``;
    ``decoded=False`` skips the decoded values (None). One copy to the host: the
    payload. Raises NonFiniteValues for NaN or Inf, as the host codecs do."""
    if not supported(spec):
        raise ValueError(f"codec {spec.name!r} is not encoded on a device; use storage.codecs")
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError(f"encode: expected a 1-D float32 tensor, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    if spec.is_sparse:
        return _sparse_roundtrip(x, spec, decoded)
    if spec.name == "none":
        if x.numel() and int(_absbits(x).max()) >= _INF_BITS:
            raise NonFiniteValues("encode: input contains NaN or Inf; refusing to send it")
        return _host_bytes(x.view(torch.uint8)), (x.clone() if decoded else None)
    return _block_roundtrip(x, spec, decoded)


def decode(payload: bytes | memoryview, n: int, spec: CodecSpec,
           device: torch.device | str) -> torch.Tensor:
    """``storage.codecs.decode(payload, n, spec)`` as a float32 tensor on ``device``,
    the payload copied there first (a mean's int8 payload is a quarter of its
    float32 values; a sparse one's kept entries are parsed on the host and only they
    cross). Raises CorruptObject for what the host decoder refuses."""
    if spec.is_sparse:  # the kept entries, a few bytes each, parsed on the host
        idx, vals = sparse.kept(payload, n, spec)
        out = torch.zeros(n, dtype=torch.float32, device=device)
        out[torch.from_numpy(idx).to(device)] = torch.from_numpy(vals).to(device)
        return out
    if not supported(spec):
        from storage.codecs import decode as host_decode  # noqa: PLC0415

        return torch.from_numpy(host_decode(payload, n, spec)).to(device)
    buf = np.frombuffer(payload, np.uint8)
    if buf.size != encoded_nbytes(n, spec):
        raise CorruptObject(f"decode: {spec.name} payload for {n} values must be "
                            f"{encoded_nbytes(n, spec)} bytes, got {buf.size}")
    raw = torch.from_numpy(buf.copy()).to(device)
    if spec.name == "none":
        out = raw.view(torch.float32).clone()
        if n and int(_absbits(out).max()) >= _INF_BITS:
            raise NonFiniteValues("decode: none payload holds NaN or Inf")
        return out
    b = spec.block_size
    nb = -(-n // b)
    scales = raw[: 4 * nb].view(torch.float32)
    codes = raw[4 * nb:]
    bad = (scales.view(torch.int32) < 0) | (scales.view(torch.int32) > _F32_MAX_BITS)
    if spec.name == "int8":
        bad_codes = codes == 0x80
        bad_max = scales.view(torch.int32) == _F32_MAX_BITS
    else:
        nib = torch.stack([codes & 0xF, codes >> 4], dim=1)
        bad_codes = nib == 8 if spec.name == "int4" else torch.zeros((), dtype=torch.bool,
                                                                      device=raw.device)
        bad_max = torch.zeros((), dtype=torch.bool, device=raw.device)
        if n % 2:
            bad_codes = bad_codes.any() | (codes[-1] >> 4 != 0)
    flags = torch.stack([bad.any(), bad_codes.any(), bad_max.any()]).tolist()
    if flags[0]:
        raise CorruptObject("decode: a block scale is negative, NaN or Inf")
    if flags[1]:
        if spec.name == "int8":
            raise CorruptObject("decode: int8 code -128 is outside [-127, 127]")
        if n % 2 and int(codes[-1]) >> 4:
            raise CorruptObject("decode: the pad nibble after the last value is not 0")
        raise CorruptObject("decode: int4 code -8 is outside [-7, 7]")
    if flags[2]:
        raise CorruptObject("decode: an int8 block scale of float32 max cannot be encoded")
    return _decode_blocks(codes, scales, n, spec)


# ----------------------------------------------------------------------------- block codecs


def _absbits(x: torch.Tensor) -> torch.Tensor:
    """|x| as int32 bit patterns: non-negative, ordered as the floats, NaN/inf on top."""
    return x.view(torch.int32) & _ABS


def _host_bytes(t: torch.Tensor) -> bytes:
    """A uint8 tensor's bytes on the host (through pinned memory from a GPU)."""
    if t.device.type == "cpu":
        return t.numpy().tobytes()
    host = torch.empty(t.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host.numpy().tobytes()


def _block_roundtrip(x: torch.Tensor, spec: CodecSpec, decoded: bool
                     ) -> tuple[bytes, torch.Tensor | None]:
    n, b = x.numel(), spec.block_size
    if n == 0:
        return b"", (x.clone() if decoded else None)
    nb = -(-n // b)
    padded = torch.nn.functional.pad(x, (0, nb * b - n)).view(nb, b)
    sbits = _absbits(padded).amax(dim=1)
    top = sbits.max()
    flags = torch.stack([top >= _INF_BITS, (sbits == _F32_MAX_BITS).any()]).tolist()
    if flags[0]:
        raise NonFiniteValues("encode: input contains NaN or Inf; refusing to send it")
    if spec.name == "int8" and flags[1]:
        raise NonFiniteValues(
            "encode: an int8 block's absmax is float32 max, and 127 * (s / 127) would decode to inf"
        )
    s = sbits.view(torch.float32)
    div = torch.where(s == 0, torch.ones_like(s), s)
    if spec.name == "fp4-e3m0":
        r = _absbits(padded).view(torch.float32) / div[:, None]
        codes = _fp4_codes(padded, r)
    else:  # round half to even, as numpy's 1.5 * 2**23 trick
        codes = torch.round(padded / div[:, None] * float(QMAX[spec.name])).to(torch.int8)
    codes = codes.view(-1)
    if spec.name == "int8":
        stream = codes.view(torch.uint8)
    else:  # two's complement (or sign-magnitude fp4) nibbles, element 2i low
        nib = codes.view(torch.uint8) & 0xF
        stream = nib[0::2] | (nib[1::2] << 4)
        stream = stream[: (n + 1) // 2]
    payload = _host_bytes(torch.cat([s.contiguous().view(torch.uint8), stream[: n if
                                     spec.name == "int8" else None]]))
    if not decoded:
        return payload, None
    return payload, _values(codes, s, spec)[:n]


def _fp4_codes(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """fp4-e3m0 codes (int8, 0..15) for r = |x| / s: storage/quantizers.py's
    ``_fp4_codes`` (nearest power of two, ties down, below 2^-6 to 0 or 2^-6)."""
    bits = r.view(torch.int32)
    t = ((bits + 0x7FFFFF) >> 23).clamp(0, 121)
    e = torch.maximum((bits + 0x3FFFFF) >> 23, t).sub_(120).clamp_(0, 7)
    sign = (x.view(torch.int32) >> 31) & 8  # 8 where the sign bit is set
    return (e | (e.clamp(0, 1) * sign)).to(torch.int8)


def _values(codes: torch.Tensor, s: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    """Decoded float32 values of whole blocks of codes (int8, one a value)."""
    nb = s.numel()
    if spec.name == "fp4-e3m0":
        table = torch.from_numpy(np.concatenate([FP4_MAGNITUDES, -FP4_MAGNITUDES])
                                 .astype(np.float32)).to(codes.device)
        unit = table[codes.long()].view(nb, -1)
        return (unit * s[:, None]).view(-1)
    # a tensor divisor: CUDA divides by a Python number as a multiplication by its
    # reciprocal, which is not the correctly rounded quotient numpy computes
    step = s / torch.full_like(s, float(QMAX[spec.name]))
    return (codes.to(torch.float32).view(nb, -1) * step[:, None]).view(-1)


def _decode_blocks(stream: torch.Tensor, s: torch.Tensor, n: int, spec: CodecSpec
                   ) -> torch.Tensor:
    nb, b = s.numel(), spec.block_size
    if spec.name == "int8":
        codes = torch.zeros(nb * b, dtype=torch.int8, device=stream.device)
        codes[:n] = stream.view(torch.int8)
    else:
        pairs = torch.zeros((nb * b) // 2, 2, dtype=torch.uint8, device=stream.device)
        pairs[: stream.numel(), 0] = stream & 0xF
        pairs[: stream.numel(), 1] = stream >> 4
        codes = pairs.view(-1)
        if spec.name == "int4":  # sign-extend the nibble
            codes = ((codes.to(torch.int16) ^ 8) - 8).to(torch.int8)
        else:
            codes = codes.view(torch.int8)
    return _values(codes, s, spec)[:n].contiguous()


# ----------------------------------------------------------------------------- sparse


def _sparse_roundtrip(x: torch.Tensor, spec: CodecSpec, decoded: bool
                      ) -> tuple[bytes, torch.Tensor | None]:
    """Selection and quantisation on the device, storage/sparse.py's layout on the
    host from the kept entries (columns, codes, lo, hi: about 3 bytes a kept value)."""
    n, c, k, b = x.numel(), spec.chunk, spec.k, sparse.BITS[spec.name]
    if n >= 1 << 32:
        raise ValueError(f"encode: a sparse payload holds fewer than 2**32 values, got {n}")
    full, tail = divmod(n, c)
    spans = [(0, full, c)] if full else []
    if tail:
        spans.append((full * c, 1, tail))
    parts, device_parts = [], []
    for start, rows, length in spans:
        block = x[start : start + rows * length].view(rows, length)
        cols, codes, lo, hi, mags, negative = _select(block, min(k, length), b)
        device_parts.append((start, cols, mags, negative, lo, hi, codes))
    host = [[t.cpu().numpy() for t in (cols, codes, lo, hi)]
            for _, cols, _, _, lo, hi, codes in device_parts]
    if any(np.asarray(p[3]).size and p[3].view(np.uint32).max() >= _INF_BITS for p in host):
        raise NonFiniteValues("encode: input contains NaN or Inf; refusing to send it")
    for cols, codes, lo, hi in host:
        parts.append((cols.astype(np.int64), codes.astype(np.uint8), lo, hi))
    payload = sparse.assemble(n, spec, parts)  # one layout, one writer
    if not decoded:
        return payload, None
    out = torch.zeros(n, dtype=torch.float32, device=x.device)
    levels = 1 << (b - 1)
    mags_table = torch.from_numpy(sparse.MAGS[spec.name]).to(x.device)
    for start, cols, _, _, lo, hi, codes in device_parts:
        rows, length = cols.shape[0], (c if start < full * c else tail)
        w = (hi - lo)[:, None]
        mag = lo[:, None] + w * mags_table[(codes & (levels - 1)).long()]
        values = torch.where((codes & levels) != 0, -mag, mag)
        base = start + torch.arange(rows, device=x.device)[:, None] * length
        out[(base + cols).view(-1)] = values.view(-1)
    return payload, out


def _select(rows: torch.Tensor, k: int, b: int) -> tuple[torch.Tensor, ...]:
    """The ``k`` largest |x| of each row, ties to the lower index (one int64 key:
    magnitude bits above the reversed column), columns ascending; with their codes,
    each row's lo and hi (storage/sparse.py's ``_select_rows`` and ``_quantize``)."""
    r, length = rows.shape
    a = _absbits(rows).to(torch.int64)
    cols = torch.arange(length, device=rows.device, dtype=torch.int64)
    key = (a << 32) | (length - 1 - cols)
    top = torch.topk(key, k, dim=1, sorted=False).values
    kept = torch.sort((length - 1) - (top & 0xFFFFFFFF), dim=1).values
    bits = torch.gather(a, 1, kept).to(torch.int32)
    negative = torch.gather(rows, 1, kept) < 0
    mags = bits.view(torch.float32)
    lo, hi = mags.amin(dim=1), mags.amax(dim=1)
    w = hi - lo
    safe = torch.where(w == 0, torch.ones_like(w), w)[:, None]
    levels = 1 << (b - 1)
    j = torch.floor(((mags - lo[:, None]) / safe) * float(levels)).clamp_(max=levels - 1)
    codes = j.to(torch.uint8) | (negative.to(torch.uint8) << (b - 1))
    return kept.to(torch.int32), codes, lo, hi, mags, negative
