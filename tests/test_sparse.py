"""The sparse top-k codecs topk2/topk4 (storage/sparse.py; docs/algorithms.md, Sparse codecs).

``ref_encode``/``ref_decode`` are the rules of storage/sparse.py's docstring
written out plainly (a stable lexsort per chunk, float32 scalars, one Python
integer as the bit stream); the fast path must match them bit for bit.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from storage import arrays
from storage.arrays import encode_array, read_array, write_array
from storage.codecs import (
    SPARSE_CODECS,
    CodecSpec,
    accumulate,
    decode,
    encode,
    encoded_nbytes,
    expected_nbytes,
    kept,
    roundtrip,
)
from storage.errors import CorruptObject, NonFiniteValues
from storage.objectstore import ObjectStore
from storage.sparse import fixed_nbytes
from storage.zarr_codec import BlockQuantCodec

F32 = np.float32
BITS = {"topk2": 2, "topk4": 4}


# ----------------------------------------------------------------------------- reference


def ref_encode(x: np.ndarray, spec: CodecSpec) -> bytes:
    n, c, k, b = x.size, spec.chunk, spec.k, BITS[spec.name]
    levels = 2 ** (b - 1)
    r = ref_rice(c, k)
    scales, gaps, codes = [], [], []
    for start in range(0, n, c):
        seg = x[start : start + c]
        kc = min(k, seg.size)
        mag_bits = (seg.view(np.uint32) & 0x7FFFFFFF).astype(np.int64)
        order = np.lexsort((np.arange(seg.size), -mag_bits))  # largest first, lower index
        keep = sorted(order[:kc].tolist())
        mags = [np.uint32(mag_bits[i]).view(F32) for i in keep]
        lo, hi = min(mags), max(mags)
        w = F32(hi - lo)
        scales += [lo, hi]
        previous = -1
        for i, m in zip(keep, mags, strict=True):
            j = 0 if w == 0 else int(min(levels - 1, np.floor(F32(F32((m - lo) / w) * F32(levels)))))
            codes.append(j | (int(seg[i] < 0) << (b - 1)))
            gaps.append(i - previous - 1)
            previous = i
    unary, used = 0, 0
    for g in gaps:  # g >> r zero bits, then a one
        used += g >> r
        unary |= 1 << used
        used += 1
    return (
        np.array([n, c, k, b], "<u4").tobytes()
        + np.array(scales, "<f4").tobytes()
        + ref_pack(codes, b)
        + ref_pack([g % (1 << r) for g in gaps], r)
        + unary.to_bytes(-(-used // 8), "little")
    )


def ref_rice(c: int, k: int) -> int:
    """floor(log2(C // k)) by counting halvings."""
    r, q = 0, c // k
    while q >= 2:
        q //= 2
        r += 1
    return r


def ref_pack(values: list[int], bits: int) -> bytes:
    stream = 0
    for i, v in enumerate(values):
        stream |= v << (i * bits)
    return stream.to_bytes(-(-len(values) * bits // 8), "little")


def ref_decode(payload: bytes, n: int, spec: CodecSpec) -> np.ndarray:
    c, k, b = spec.chunk, spec.k, BITS[spec.name]
    levels = 2 ** (b - 1)
    r = ref_rice(c, k)
    nchunks = -(-n // c)
    kcs = [min(k, min(n, (ci + 1) * c) - ci * c) for ci in range(nchunks)]
    total = sum(kcs)
    scales = np.frombuffer(payload, "<f4", count=2 * nchunks, offset=16).astype(F32)
    at = 16 + 8 * nchunks
    code_bytes, rem_bytes = -(-total * b // 8), -(-total * r // 8)
    cstream = int.from_bytes(payload[at : at + code_bytes], "little")
    rstream = int.from_bytes(payload[at + code_bytes : at + code_bytes + rem_bytes], "little")
    ustream = int.from_bytes(payload[at + code_bytes + rem_bytes :], "little")
    out = np.zeros(n, F32)
    e, bit = 0, 0
    for ci, kc in enumerate(kcs):
        lo, hi = scales[2 * ci], scales[2 * ci + 1]
        w = F32(hi - lo)
        i = -1
        for _ in range(kc):
            q = 0
            while not (ustream >> bit) & 1:
                q, bit = q + 1, bit + 1
            bit += 1
            i += 1 + (q << r) + ((rstream >> (e * r)) & ((1 << r) - 1))
            code = (cstream >> (e * b)) & ((1 << b) - 1)
            m = F32((2 * (code & (levels - 1)) + 1) / (2 * levels))
            mag = F32(lo + F32(w * m))
            out[ci * c + i] = -mag if code >> (b - 1) else mag
            e += 1
    return out


def bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, F32).view(np.uint32)


def data(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "normal":
        return rng.standard_normal(n, dtype=F32)
    if kind == "integers":  # heavy ties, -0.0 among them
        x = rng.integers(-3, 4, n).astype(F32)
        x[rng.random(n) < 0.1] = F32(-0.0)
        return x
    if kind == "equal":  # all-equal chunks, one all-zero and one of -0.0
        x = np.repeat(rng.standard_normal(-(-n // 7), dtype=F32), 7)[:n]
        x[: n // 3] = 0
        x[n // 3 : n // 2] = F32(-0.0)
        return x
    scale = F32(10.0) ** rng.integers(-30, 30, n).astype(F32)  # wide range, subnormals
    x = rng.standard_normal(n, dtype=F32) * scale
    x[:: max(1, n // 5)] = F32(np.finfo(F32).max)
    x[1 :: max(2, n // 7)] = F32(1e-45)
    return x


CASES = [  # codec, C, k, n: partial last chunk, n < C, k = C, k = 1, C not a power of 2
    ("topk2", 4096, 64, 10000),
    ("topk4", 4096, 64, 10000),
    ("topk4", 4096, 64, 100),
    ("topk2", 4096, 4096, 5000),
    ("topk4", 1000, 37, 2999),
    ("topk2", 1000, 1, 2500),
    ("topk4", 16, 3, 1001),
    ("topk2", 256, 255, 1100),
    ("topk4", 4, 2, 30),
    ("topk2", 2, 1, 7),
    ("topk4", 65536, 64, 70000),
]


@pytest.mark.parametrize("kind", ["normal", "integers", "equal", "wide"])
@pytest.mark.parametrize(("codec", "chunk", "k", "n"), CASES)
def test_fast_path_matches_reference_bit_for_bit(codec, chunk, k, n, kind):
    spec = CodecSpec(codec, chunk=chunk, k=k)
    x = data(kind, n, np.random.default_rng(n + chunk + k))
    payload = encode(x, spec)
    assert payload == ref_encode(x, spec)
    assert fixed_nbytes(n, spec) + 1 <= len(payload) <= encoded_nbytes(n, spec)
    want = ref_decode(payload, n, spec)
    np.testing.assert_array_equal(bits(decode(payload, n, spec)), bits(want))
    again, decoded = roundtrip(x, spec)
    assert again == payload
    np.testing.assert_array_equal(bits(decoded), bits(want))
    idx, values = kept(payload, n, spec)
    assert idx.dtype == np.int64 and values.dtype == F32
    assert np.all(np.diff(idx) > 0)
    np.testing.assert_array_equal(bits(values), bits(want[idx]))


def test_hand_example():
    """C = 4, k = 2, topk2: |x| = .5, 2, 1, 1 keeps index 1 and, of the tied 1s, index 2.
    lo = 1, hi = 2, w = 1, L = 2: j(2.0) = min(1, floor(1 * 2)) = 1, j(1.0) = 0;
    decode lo + w * (0.75 | 0.25) = -1.75 (sign of -2) and 1.25. Indices 1, 2 in
    r = floor(log2(4 // 2)) = 1: gaps 1, 0 give remainders 1, 0 (0b01) and quotients
    0, 0 (unary "1", "1": 0b11); codes 3 (sign|1), 0: 0b0011."""
    spec = CodecSpec("topk2", chunk=4, k=2)
    x = np.array([0.5, -2.0, 1.0, -1.0], F32)
    payload = encode(x, spec)
    assert payload == (
        np.array([4, 4, 2, 2], "<u4").tobytes() + np.array([1, 2], "<f4").tobytes() + b"\x03\x01\x03"
    )
    assert encoded_nbytes(4, spec) == 27
    np.testing.assert_array_equal(decode(payload, 4, spec), [0, -1.75, 1.25, 0])


def test_payload_sizes():
    # 10000 values, C 4096: chunks of 4096, 4096, 1808 keep 64 each; r = 6
    spec = CodecSpec("topk4")
    fixed = 16 + 3 * 8 + 192 * 4 // 8 + 192 * 6 // 8
    assert fixed_nbytes(10000, spec) == fixed
    # each chunk's gaps sum to at most L - k: quotient bits <= k + (L - k) >> 6
    assert encoded_nbytes(10000, spec) == fixed + -(-(2 * (64 + 63) + 64 + 27) // 8)
    assert encoded_nbytes(0, spec) == 16
    assert encode(np.zeros(0, F32), spec) == np.array([0, 4096, 64, 4], "<u4").tobytes()
    # n < k keeps n; r comes from C and k (6), 2-bit codes round up to a byte
    assert fixed_nbytes(5, CodecSpec("topk2")) == 16 + 8 + 2 + 4


def test_index_bits_against_a_fixed_width():
    """Rice-coded gaps take about 7.6 bits an index at 64 of 4096 (12 at a fixed
    width); the mean size `diloco estimate` uses is within 1% of real payloads of
    spread positions, and no payload passes the bound whatever the positions."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal(1 << 20, dtype=F32)
    for k in (16, 34, 64, 256):
        spec = CodecSpec("topk2", chunk=4096, k=k)
        size = len(encode(x, spec))
        assert abs(size - expected_nbytes(x.size, spec)) <= 0.01 * size
        fixed_width = 16 + 256 * 8 + 256 * k * (12 + 2) // 8
        assert size < (0.87 if k == 16 else 0.8) * fixed_width
    spec = CodecSpec("topk2", chunk=4096, k=64)
    index_bits = (len(encode(x, spec)) - fixed_nbytes(x.size, spec)) * 8 / (256 * 64) + 6
    assert 7.4 < index_bits < 7.8
    # the kept values at the end of every chunk: one gap of L - k, the worst case
    clustered = np.tile(np.r_[np.zeros(4096 - 64, F32), np.ones(64, F32)], 16)
    payload = encode(clustered, spec)
    assert len(payload) == encoded_nbytes(clustered.size, spec)
    np.testing.assert_array_equal(decode(payload, clustered.size, spec), clustered * F32(1.0))


@pytest.mark.parametrize("codec", SPARSE_CODECS)
def test_non_finite_and_seed_are_refused(codec):
    spec = CodecSpec(codec, chunk=16, k=2)
    for bad in (np.nan, np.inf, -np.inf):
        x = np.zeros(40, F32)
        x[37] = bad
        with pytest.raises(NonFiniteValues):
            encode(x, spec)
        with pytest.raises(NonFiniteValues):
            roundtrip(x, spec)
    with pytest.raises(ValueError, match="seed"):
        encode(np.ones(4, F32), spec, seed=1)


def _corrupt(payload: bytes, at: int, raw: bytes) -> bytes:
    return payload[:at] + raw + payload[at + len(raw) :]


def test_corrupt_payloads_are_named():
    spec = CodecSpec("topk4", chunk=1000, k=4)  # r = floor(log2(250)) = 7
    n = 2500  # chunks of 1000, 1000, 500
    x = np.random.default_rng(3).standard_normal(n, dtype=F32)
    good = encode(x, spec)
    u32, f32 = (lambda v: np.array([v], "<u4").tobytes()), (lambda v: np.array([v], "<f4").tobytes())
    rem_at = 16 + 3 * 8 + 12 * 4 // 8  # header, scales, codes
    unary_at = rem_at + -(-12 * 7 // 8)
    cols = [int(i) % 1000 for i in kept(good, n, spec)[0]]

    def with_indices(new: list[int]) -> bytes:
        """``good`` with its index streams rewritten for ``new`` (4 a chunk)."""
        gaps = [c - (new[e - 1] if e % 4 else -1) - 1 for e, c in enumerate(new)]
        unary, used = 0, 0
        for g in gaps:
            used += g >> 7
            unary |= 1 << used
            used += 1
        return (good[:rem_at] + ref_pack([g % 128 for g in gaps], 7)
                + unary.to_bytes(-(-used // 8), "little"))

    def with_index(e: int, value: int) -> bytes:
        return with_indices(cols[:e] + [value] + cols[e + 1 :])

    assert with_indices(cols) == good
    unary = int.from_bytes(good[unary_at:], "little")
    low_zero = (~unary & (unary + 1)).bit_length() - 1  # the lowest zero bit
    cases = {
        "must be 58 to 61 bytes, got 57": good[:unary_at],  # no quotient bytes at all
        "must be 58 to 61 bytes, got 120": good + bytes(120 - len(good)),
        "header says k = 65, the codec has k = 4": _corrupt(good, 8, u32(65)),
        "header says n = 7, the array has n = 2500": _corrupt(good, 0, u32(7)),
        "header says b = 2, topk4 has b = 4": _corrupt(good, 12, u32(2)),
        "chunk 1 has lo = -1.0": _corrupt(good, 16 + 8, f32(-1.0)),
        "chunk 0 has lo = 0.0, hi = nan": _corrupt(_corrupt(good, 16, f32(0.0)), 20, f32(np.nan)),
        "chunk 2 has lo = 5.0, hi": _corrupt(good, 16 + 16, f32(5.0)),
        "chunk 0 has lo = -0.0": _corrupt(good, 16, f32(-0.0)),
        "index 700 out of range for chunk 2 of 500 values": with_index(11, 700),
        "index 1010 out of range for chunk 0 of 1000 values": with_index(3, 1010),
        "quotient stream of 4 bytes holds 13 codes": good[:unary_at] + (
            unary | 1 << low_zero).to_bytes(len(good) - unary_at, "little"),
    }
    for message, payload in cases.items():
        with pytest.raises(CorruptObject, match=message.replace("(", r"\(")) as info:
            decode(payload, n, spec)
        assert "\n" not in str(info.value)
        with pytest.raises(CorruptObject):
            accumulate(payload, n, spec, np.zeros(n, F32), 1.0)
    # a zero byte after the quotients' last one bit, though the length is allowed
    wide = CodecSpec("topk2")
    payload = encode(np.random.default_rng(5).standard_normal(10000, dtype=F32), wide)
    assert len(payload) + 1 <= encoded_nbytes(10000, wide)
    with pytest.raises(CorruptObject, match="ending in its last byte"):
        decode(payload + b"\0", 10000, wide)
    # pad bits: 3 entries of C = 1000, k = 1 (r = 9): 12 code bits, 27 remainder bits
    short = CodecSpec("topk4", chunk=1000, k=1)
    y = np.random.default_rng(4).standard_normal(3000, dtype=F32)
    payload = encode(y, short)
    codes_end, rem_end = 16 + 3 * 8 + 2, 16 + 3 * 8 + 2 + 4
    for at, what in ((codes_end - 1, "code"), (rem_end - 1, "gap remainder")):
        flipped = _corrupt(payload, at, bytes([payload[at] | 0x80]))
        with pytest.raises(CorruptObject, match=f"pad bits after the last sparse {what}"):
            decode(flipped, 3000, short)


def test_decode_leaves_out_alone_when_corrupt_and_fills_it_when_not():
    spec = CodecSpec("topk2", chunk=64, k=4)
    x = np.random.default_rng(5).standard_normal(300, dtype=F32)
    payload = encode(x, spec)
    out = np.full(300, F32(7))
    with pytest.raises(CorruptObject):
        decode(payload[:-1], 300, spec, out=out)
    assert decode(payload, 300, spec, out=out) is out
    np.testing.assert_array_equal(bits(out), bits(decode(payload, 300, spec)))
    with pytest.raises(ValueError, match="out"):
        decode(payload, 300, spec, out=np.zeros(301, F32))


@pytest.mark.parametrize(("codec", "bound"), [("topk2", 0.2), ("topk4", 0.05)])
def test_error_of_the_kept_values_is_small(codec, bound):
    """On N(0,1) the kept values are the tail |x| > ~2.4, a narrow band [lo, hi] that
    2 or 8 levels cover well: measured 0.081 (topk2) and 0.019 (topk4)."""
    spec = CodecSpec(codec)
    x = np.random.default_rng(6).standard_normal(1 << 20, dtype=F32)
    idx, values = kept(encode(x, spec), x.size, spec)
    assert idx.size == 256 * 64
    true = x[idx].astype(np.float64)
    rel = np.sqrt(np.mean((values - true) ** 2) / np.mean(true**2))
    assert rel < bound
    assert np.all(np.sign(values) == np.sign(true))
    # the kept set is the 64 largest of each chunk
    chunks = np.abs(x).reshape(256, 4096)
    kth = np.sort(chunks, axis=1)[:, -64]
    assert np.all(np.abs(x[idx]).reshape(256, 64) >= kth[:, None])


def test_error_feedback_sum_of_sent_tracks_sum_of_inputs():
    """With the residual carried over, what was sent after R rounds differs from the
    sum of the inputs by exactly the current residual, which stays bounded (about one
    round's worth) instead of growing like R."""
    spec = CodecSpec("topk2", chunk=256, k=8)
    rng = np.random.default_rng(7)
    n, rounds = 4096, 200
    residual = np.zeros(n, F32)
    sent = np.zeros(n, np.float64)
    total = np.zeros(n, np.float64)
    for _ in range(rounds):
        g = rng.standard_normal(n, dtype=F32) + F32(0.1)  # a small common drift
        total += g
        v = residual + g
        _, decoded = roundtrip(v, spec)
        residual = v - decoded
        sent += decoded
    gap = np.linalg.norm(total - sent) / np.linalg.norm(total)
    assert gap < 0.3  # measured 0.10; without error feedback 0.83 (1/32 of entries travel)
    assert np.abs(total - sent - residual).max() < 1e-2


def test_accumulate_equals_the_dense_formula():
    """acc += decode(p) * float32(w) over several contributions in a fixed order,
    scatter-add vs dense, bit for bit (acc starts at +0.0)."""
    rng = np.random.default_rng(8)
    n = 9000
    for codec in SPARSE_CODECS:
        spec = CodecSpec(codec, chunk=1024, k=32)
        dense = np.zeros(n, F32)
        sparse = np.zeros(n, F32)
        for i, w in enumerate([0.25, 1 / 3, -0.5, 1e-3, 0.25]):
            x = data("integers" if i == 2 else "normal", n, rng)
            p = encode(x, spec)
            dense += decode(p, n, spec) * F32(w)
            accumulate(p, n, spec, sparse, w)
        np.testing.assert_array_equal(bits(sparse), bits(dense))
        assert np.count_nonzero(sparse) > 32 * 9
    with pytest.raises(ValueError, match="weight"):
        accumulate(p, n, spec, sparse, float("nan"))


@pytest.mark.parametrize("codec", SPARSE_CODECS)
def test_zarr_codec_carries_the_sparse_spec(codec):
    spec = CodecSpec(codec, chunk=512, k=16)
    zc = BlockQuantCodec.of(spec)
    assert zc.to_dict() == {
        "name": "diloco.blockquant", "configuration": {"codec": codec, "chunk": 512, "k": 16},
    }
    assert BlockQuantCodec.from_dict(zc.to_dict()).spec == spec


@pytest.mark.parametrize("codec", SPARSE_CODECS)
def test_encode_array_and_read_array_with_a_sparse_spec(codec, monkeypatch):
    """One chunk (the fast path) and, with MAX_CHUNK made small, several zarr chunks
    that are whole sparse chunks: what read_array returns is what encode_array said
    every reader gets back, and the one-chunk objects are exactly zarr's."""
    store = ObjectStore(f"memory://sparse-{uuid.uuid4().hex}")
    spec = CodecSpec(codec, chunk=1000, k=10)
    x = np.random.default_rng(9).standard_normal(4500, dtype=F32)
    blobs, _record, decoded = encode_array("p", x, spec)
    assert blobs == arrays.encode_array_with_zarr("p", x, spec)
    np.testing.assert_array_equal(bits(decoded), bits(roundtrip(x, spec)[1]))
    record, _ = write_array(store, "one", x, spec)
    np.testing.assert_array_equal(bits(read_array(store, "one", record, shape=(4500,))),
                                  bits(decoded))
    monkeypatch.setattr(arrays, "MAX_CHUNK", 2048)
    assert arrays._chunks((4500,), spec) == (2000,)  # 3 parts of whole sparse chunks
    record, decoded = write_array(store, "many", x, spec)
    assert {"c/0", "c/1", "c/2"} <= set(record)
    got = read_array(store, "many", record, shape=(4500,))
    np.testing.assert_array_equal(bits(got), bits(decoded))
    # the first zarr chunk holds sparse chunks 0-1, exactly as a one-chunk encode
    np.testing.assert_array_equal(bits(got[:2000]), bits(roundtrip(x[:2000], spec)[1]))
