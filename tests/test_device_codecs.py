"""The torch codecs (diloco/device_codecs.py) give the host codecs' bytes and values.

A worker that encodes on its GPU must send exactly what one encoding on the host
would: the aggregator and the other workers decode with storage/codecs.py, and the
error-feedback residual is built from the decoded values. Here torch runs on the
CPU (on CUDA too where there is one); the arithmetic is the same IEEE float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco import device_codecs
from storage import codecs
from storage.codecs import CodecSpec
from storage.errors import CorruptObject, NonFiniteValues

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SPECS = [CodecSpec("none"), CodecSpec("int8", 128), CodecSpec("int4", 128),
         CodecSpec("int4", 64), CodecSpec("fp4-e3m0", 128), CodecSpec("topk2", chunk=512, k=8),
         CodecSpec("topk4", chunk=256, k=16), CodecSpec("topk2", chunk=4096, k=64)]


def values(n: int, seed: int) -> np.ndarray:
    """Awkward float32 values: mixed scales, exact zeros and -0.0, a zero block,
    subnormals, ties of magnitude, powers of two and midpoints between fp4 levels."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-20, 5, n))).astype(np.float32)
    if n > 400:
        x[100:300] = 0.0  # an all-zero block (int*) and chunk part (topk)
        x[310:330] = np.float32(-0.0)
        x[340:350] = np.float32(1e-41)  # subnormal
        x[360:380] = np.float32(0.75) * np.sign(rng.standard_normal(20)).astype(np.float32)
        x[390:400] = np.float32(2.0**-7)  # an fp4 midpoint
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}-{s.block_size}-{s.chunk}")
@pytest.mark.parametrize("n", [1, 7, 129, 1000, 4097, 20_001])
def test_payload_and_decoded_values_equal_the_host_codec(spec, n, device):
    x = values(n, seed=n)
    host_payload, host_decoded = codecs.roundtrip(x, spec)
    payload, decoded = device_codecs.roundtrip(torch.from_numpy(x).to(device), spec)
    assert payload == host_payload
    assert decoded.device.type == device
    got = decoded.cpu().numpy()
    assert got.view(np.uint32).tolist() == host_decoded.view(np.uint32).tolist()
    assert device_codecs.encode(torch.from_numpy(x).to(device), spec) == host_payload


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_decode_on_the_device_equals_the_host_decode(spec, device):
    x = values(3001, seed=5)
    payload = codecs.encode(x, spec)
    got = device_codecs.decode(payload, x.size, spec, device)
    want = codecs.decode(payload, x.size, spec)
    assert got.device.type == device
    assert got.cpu().numpy().view(np.uint32).tolist() == want.view(np.uint32).tolist()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_nan_or_inf_is_refused_as_on_the_host(spec):
    for bad in (np.nan, np.inf, -np.inf):
        x = values(1000, seed=1)
        x[777] = bad
        with pytest.raises(NonFiniteValues):
            codecs.encode(x, spec)
        with pytest.raises(NonFiniteValues):
            device_codecs.encode(torch.from_numpy(x), spec)


def test_int8_scale_of_float32_max_is_refused_as_on_the_host():
    x = np.zeros(256, np.float32)
    x[3] = np.finfo(np.float32).max
    with pytest.raises(NonFiniteValues, match="float32 max"):
        device_codecs.encode(torch.from_numpy(x), CodecSpec("int8"))
    payload = device_codecs.encode(torch.from_numpy(x), CodecSpec("int4"))
    assert payload == codecs.encode(x, CodecSpec("int4"))


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_corrupt_payload_is_refused_on_the_device(name):
    spec = CodecSpec(name)
    x = values(301, seed=2)
    good = bytearray(codecs.encode(x, spec))
    nb = -(-301 // 128)
    negative_scale = bytearray(good)
    negative_scale[3] |= 0x80
    bad_code = bytearray(good)
    bad_code[4 * nb] = 0x80 if name == "int8" else 0x08
    for payload, match in ((negative_scale, "scale"), (bad_code, "outside"),
                           (good[:-1], "bytes")):
        with pytest.raises(CorruptObject, match=match):
            device_codecs.decode(bytes(payload), 301, spec, "cpu")
    if name == "int4":
        pad = bytearray(good)
        pad[-1] |= 0x10  # the unused high nibble after the 301st value
        with pytest.raises(CorruptObject, match="pad nibble"):
            device_codecs.decode(bytes(pad), 301, spec, "cpu")


def test_what_is_left_to_the_host():
    assert not device_codecs.supported(CodecSpec("fp16"))
    assert not device_codecs.supported(CodecSpec("int4"), seed=3)  # numpy's PCG64 draws
    assert device_codecs.supported(CodecSpec("topk2"))
    with pytest.raises(ValueError, match="fp16"):
        device_codecs.encode(torch.zeros(4), CodecSpec("fp16"))
