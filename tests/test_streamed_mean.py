"""The mean is summed a zarr chunk at a time from contributions kept encoded
(`storage.arrays.Coded`), so the aggregator holds one float32 sum, not a decoded copy
of each contribution. The bits must be those of the old path, which decoded every
contribution whole and summed ``acc += x_m * float32(w_m)`` in sorted key order:
that formula is written out here as the reference, for dense, block and sparse
codecs, across several zarr chunks, and with a contribution rejected (NaN in its
last chunk only: the first, norm pass must find it before it counts)."""

from __future__ import annotations

import numpy as np
import pytest
from test_aggregator_shards import WORKERS, make_run

from diloco.aggregator import Aggregator
from diloco.config import SyncConfig
from diloco.run import open_run
from storage import arrays
from storage.exchange import weighted_sum
from storage.objectstore import ObjectStore

TOKENS = {"w0": 10, "w1": 11, "w2": 12}  # make_run's: weights 10/33, 11/33, 12/33
BAD = (0, 1, "w2")


@pytest.fixture(autouse=True)
def several_chunks(monkeypatch):
    """Chunks of about 1,000 values: a fragment of about 4,700 is 5 zarr chunks, the
    last one shorter (zarr pads it), as a 250M-value fragment is 4 of 62.5M."""
    monkeypatch.setattr(arrays, "MAX_CHUNK", 1000)


def bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def reference(values: dict[str, np.ndarray], weights: dict[str, float]) -> np.ndarray:
    """The mean as it was summed before: whole decoded arrays, sorted keys."""
    acc = np.zeros(next(iter(values.values())).size, np.float32)
    for key in sorted(weights):
        acc += values[key] * np.float32(weights[key])
    return acc


def run_of(codec: str, bad: dict | None = None) -> str:
    """make_run's run (K = 1) sent with ``codec``, the means sent down uncoded (so a
    committed mean is the sum itself) unless the codec is sparse (a peers mean)."""
    cfg = SyncConfig(
        schedule={"mode": "diloco", "sync_every": 2, "fragments": 2},
        codec={"up": codec, "down": "none", "block_size": 32},
    )
    return make_run(1, bad, cfg)


@pytest.mark.parametrize("codec", ["none", "int8", "int4", "topk2"])
def test_the_streamed_sum_has_the_bits_of_the_whole_arrays_sum(codec):
    """`weighted_sum` of contributions kept encoded, of decoded ones, and of both
    mixed (a peers-mean reader holds its own decoded) equals the old formula."""
    ex = open_run(ObjectStore(run_of(codec)))
    n = ex.manifest.numel(1)
    held = {w: ex.hold_delta(1, 0, w)[0] for w in WORKERS}
    assert len(held["w0"].chunks) >= 2 and n % held["w0"].chunk_len  # a padded last chunk
    decoded = {w: ex.fetch_delta(1, 0, w)[0] for w in WORKERS}
    weights = {w: TOKENS[w] / 33 for w in WORKERS}
    expected = bits(reference(decoded, weights))
    assert np.array_equal(bits(weighted_sum(n, held, weights)), expected)
    assert np.array_equal(bits(weighted_sum(n, decoded, weights)), expected)
    mixed = {**held, "w1": decoded["w1"]}
    assert np.array_equal(bits(weighted_sum(n, mixed, weights)), expected)
    # the norm pass: the float64 norm of the decoded values, to rounding of the sum
    for w in WORKERS:
        whole = np.linalg.norm(decoded[w].astype(np.float64))
        assert np.sqrt(held[w].sumsq()) == pytest.approx(whole, rel=1e-12)


@pytest.mark.parametrize("codec", ["none", "int8", "int4", "topk2"])
def test_the_aggregators_mean_is_the_old_mean_without_the_rejected(codec):
    """The aggregator's committed means equal the old formula over the accepted
    contributions with the committed weights; with codec none, w2's round 1 of
    fragment 0 has a NaN in its last chunk only, is rejected and weighs nothing."""
    u = run_of(codec, {BAD: "nan"} if codec == "none" else None)
    agg = Aggregator(open_run(ObjectStore(u)))
    agg.run(timeout=30.0, poll_interval=0.01)
    ex = agg.exchange
    for p, rounds in enumerate(ex.manifest.rounds):
        for r in range(rounds):
            mean, commit = ex.fetch_mean(p, r)
            weights = commit["weights"]
            if (p, r, "w2") == BAD and codec == "none":
                assert ex.rejections(p, r)["w2"].startswith("NonFiniteValues")
                assert weights == {"w0": 10 / 21, "w1": 11 / 21}
            else:
                assert weights == {w: TOKENS[w] / 33 for w in WORKERS}
            values = {w: ex.fetch_delta(p, r, w)[0] for w in weights}
            assert np.array_equal(bits(mean), bits(reference(values, weights)))
