"""The aggregator's guarantees: bad contributions are rejected, counted and never
applied; racing aggregators publish one mean per (fragment, round); an aggregator
killed at any point and restarted reaches the same bits."""

from __future__ import annotations

import hashlib
import threading
import uuid

import google_crc32c
import numpy as np
import pytest
import torch

from diloco.aggregator import Aggregator
from diloco.config import SyncConfig
from diloco.run import open_run
from replicas import Blocks, data, train_replicas
from storage.arrays import encode_array
from storage.exchange import Exchange, Prepared
from storage.objectstore import ObjectStore


def url() -> str:
    return f"memory://agg/{uuid.uuid4().hex}"


def state_hash(agg: Aggregator) -> str:
    h = hashlib.sha256()
    for p in range(len(agg.outer)):
        h.update(agg.canonical(p).numpy().tobytes())
        m = agg.momentum(p)
        h.update(b"-" if m is None else m.numpy().tobytes())
        r = agg.residual[p]
        h.update(b"-" if r is None else r.numpy().tobytes())
    return h.hexdigest()


# int4 both ways: error feedback on the workers and on the aggregator's mean, so a
# restarted aggregator must restore its residuals exactly too.
CFG = SyncConfig(
    schedule={"mode": "streaming", "sync_every": 4, "fragments": 2, "overlap": 1, "alpha": 0.5},
    codec={"up": "int4", "down": "int4", "block_size": 32},
)
STEPS = 14


class Killed(Exception):
    pass


def with_kills(u: str, kills: set[tuple[str, int, int]], restarts: list[int],
               keep: int = 0):
    """An aggregator thread that dies at the given (stage, fragment, round) points and
    is restarted from the store each time, as a crashed flow run would be."""

    def aggregate(stop: threading.Event) -> Aggregator:
        remaining = set(kills)

        def fault(stage, p, r):
            if (stage, p, r) in remaining:
                remaining.discard((stage, p, r))
                raise Killed(f"{stage} {p} {r}")

        while True:
            agg = Aggregator(open_run(ObjectStore(u)), fault=fault, keep_checkpoints=keep)
            try:
                agg.run(stop, 60.0)
                return agg
            except Killed:
                restarts.append(1)

    return aggregate


@pytest.mark.parametrize("keep", [0, 1])
def test_killed_aggregator_resumes_to_the_same_state(keep):
    """Killed at five points and restarted from the store, it reaches the bits of an
    aggregator never killed, whether it keeps every round checkpoint or only the
    newest (resuming reads only the newest)."""
    reference = train_replicas(url(), Blocks, data, CFG, total_steps=STEPS, inner_lr=0.05)
    u = url()
    restarts: list[int] = []
    kills = {("published", 0, 1), ("stepped", 1, 0), ("checkpointed", 0, 2),
             ("published", 1, 2), ("stepped", 0, 3)}
    killed = train_replicas(u, Blocks, data, CFG, total_steps=STEPS, inner_lr=0.05,
                            aggregate=with_kills(u, kills, restarts, keep=keep))
    assert len(restarts) == len(kills)
    assert state_hash(killed.aggregator) == state_hash(reference.aggregator)
    # a fresh aggregator opened on the finished run loads the same final state
    assert state_hash(Aggregator(open_run(ObjectStore(u)))) == state_hash(
        reference.aggregator)
    for w in ("w0", "w1"):
        assert killed.traces[w].losses == reference.traces[w].losses


def test_the_aggregator_keeps_only_the_newest_round_checkpoints():
    """keep_checkpoints = 2: each fragment's two newest round checkpoints remain,
    whole (commit and arrays); older ones are gone, arrays included."""
    from diloco.run import latest_global  # noqa: PLC0415
    from storage.checkpoints import read_checkpoint  # noqa: PLC0415

    u = url()

    def aggregate(stop: threading.Event) -> Aggregator:
        agg = Aggregator(open_run(ObjectStore(u)), keep_checkpoints=2)
        agg.run(stop, 60.0)
        return agg

    res = train_replicas(u, Blocks, data, CFG, total_steps=STEPS, inner_lr=0.05,
                         aggregate=aggregate)
    store = ObjectStore(u)
    ex = open_run(store)
    for p, rounds in enumerate(ex.manifest.rounds):
        under = store.list(f"global/frag/{p}")
        commits = sorted(k for k in under if k.endswith(".json") and k.count("/") == 3)
        assert commits == [f"global/frag/{p}/r{r:06d}.json" for r in (rounds - 2, rounds - 1)]
        assert all(k.startswith((f"global/frag/{p}/r{rounds - 2:06d}",
                                 f"global/frag/{p}/r{rounds - 1:06d}")) for k in under), under
        r, key = latest_global(ex, p)
        assert r == rounds - 1
        arrays, _ = read_checkpoint(store, key)
        assert torch.equal(torch.from_numpy(arrays["params"]), res.aggregator.canonical(p))
    with pytest.raises(ValueError, match="keep_checkpoints"):
        Aggregator(ex, keep_checkpoints=-1)


def test_two_aggregators_racing_publish_one_mean_each():
    reference = train_replicas(url(), Blocks, data, CFG, total_steps=STEPS, inner_lr=0.05)
    u = url()
    rivals: list[Aggregator] = []

    def aggregate(stop: threading.Event) -> Aggregator:
        a = Aggregator(open_run(ObjectStore(u)), name="agg-a")
        b = Aggregator(open_run(ObjectStore(u)), name="agg-b")
        rivals.extend([a, b])
        tb = threading.Thread(target=b.run, args=(stop, 60.0))
        tb.start()
        a.run(stop, 60.0)
        tb.join(60.0)
        return a

    res = train_replicas(u, Blocks, data, CFG, total_steps=STEPS, inner_lr=0.05,
                         aggregate=aggregate)
    a, b = rivals
    assert state_hash(a) == state_hash(b) == state_hash(reference.aggregator)
    store = ObjectStore(u)
    ex = res.aggregator.exchange
    for p, rounds in enumerate(ex.manifest.rounds):
        for r in range(rounds):
            keys = [k for k in store.list(f"frag/{p}/r{r:06d}") if k.endswith("mean.json")]
            assert keys == [f"frag/{p}/r{r:06d}/mean.json"]
    # every round was either created by one and adopted by the other
    created = {(x.fragment, x.round) for x in a.stats.rounds + b.stats.rounds if not x.adopted}
    total = sum(ex.manifest.rounds)
    assert len(created) == total
    assert len(a.stats.rounds) == len(b.stats.rounds) == total


# -- bad contributions ------------------------------------------------------------------
def _crc_chunk(values: bytes) -> bytes:
    return values + np.array([google_crc32c.value(values)], dtype="<u4").tobytes()


class BadWorker(Exchange):
    """Worker w2's store client, sending a different kind of bad payload in chosen
    rounds: the aggregator must reject each, never apply it, and go on."""

    def publish_prepared(self, prepared: Prepared, *, tokens, extra=None):
        p, r = prepared.fragment, prepared.round
        chunk = f"{prepared.payload}/c/0"
        kind = {(0, 0): "flip", (1, 0): "truncate", (0, 1): "shape", (1, 1): "nan"}.get((p, r))
        if kind == "flip":  # bytes changed after hashing: a corrupt upload
            b = bytearray(prepared.blobs[chunk])
            b[5] ^= 0x40
            prepared.blobs[chunk] = bytes(b)
        elif kind == "truncate":  # the chunk never arrives: a partial upload
            del prepared.blobs[chunk]
        elif kind == "shape":  # a consistent payload of the wrong length
            wrong = np.ones(prepared.decoded.size + 3, dtype=np.float32)
            blobs, record, decoded = encode_array(prepared.payload, wrong, self.up)
            prepared = Prepared(p, r, prepared.worker, prepared.payload, blobs, record, decoded)
        elif kind == "nan":  # consistent checksums around a NaN: only decoding catches it
            values = bytearray(prepared.blobs[chunk][:-4])
            values[0:4] = np.array([np.nan], dtype="<f4").tobytes()
            prepared.blobs[chunk] = _crc_chunk(bytes(values))
            prepared.record["c/0"] = {
                "size": len(prepared.blobs[chunk]),
                "sha256": hashlib.sha256(prepared.blobs[chunk]).hexdigest(),
            }
        return super().publish_prepared(prepared, tokens=tokens, extra=extra)


def test_bad_contributions_are_rejected_counted_and_never_applied():
    cfg = SyncConfig(
        schedule={"mode": "streaming", "sync_every": 4, "fragments": 2, "overlap": 1, "alpha": 0.5},
        codec={"up": "none", "down": "none"},
    )
    res = train_replicas(
        url(), Blocks, data, cfg, workers=("w0", "w1", "w2"), total_steps=STEPS,
        inner_lr=0.05,
        wrap_exchange=lambda w, ex: BadWorker(ex.store, ex.manifest) if w == "w2" else ex,
    )
    agg = res.aggregator
    ex = agg.exchange
    assert agg.stats.rejected == 4
    expected = {(0, 0): "CorruptObject", (1, 0): "PartialObject",
                (0, 1): "ShapeMismatch", (1, 1): "NonFiniteValues"}
    for (p, r), error in expected.items():
        reasons = ex.rejections(p, r)
        assert list(reasons) == ["w2"]
        assert reasons["w2"].startswith(error), reasons
        mean, commit = ex.fetch_mean(p, r)
        # tokens are equal, so the two good workers weigh 1/2 each
        assert commit["weights"] == {"w0": 0.5, "w1": 0.5}
        d0, _ = ex.fetch_delta(p, r, "w0")
        d1, _ = ex.fetch_delta(p, r, "w1")
        assert np.array_equal(mean, d0 * np.float32(0.5) + d1 * np.float32(0.5))
    # rounds without tampering use all three workers
    _, commit = ex.fetch_mean(0, 2)
    assert sorted(commit["weights"]) == ["w0", "w1", "w2"]
    for p in range(2):
        assert torch.isfinite(agg.canonical(p)).all()
    # the bad worker went on training and ended on the canonical model too
    w2 = res.traces["w2"]
    for p in range(2):
        assert torch.equal(w2.sync.outer_params(p), agg.canonical(p))


def test_quorum_after_deadline_goes_on_without_a_silent_worker():
    """Worker w2 never sends: with quorum 2/3 and a short deadline, each round is
    reduced from w0 and w1 once the deadline has passed."""
    cfg = SyncConfig(
        schedule={"mode": "diloco", "sync_every": 2, "fragments": 1},
        membership={"quorum": 0.6, "deadline_s": 0.2},
    )
    from diloco.run import new_run  # noqa: PLC0415

    u = url()
    new_run(ObjectStore(u), Blocks(), cfg, workers=["w0", "w1", "w2"], total_steps=4)
    ex = open_run(ObjectStore(u))
    for r in range(2):
        for w in ("w0", "w1"):
            ex.publish_delta(0, r, w, np.full(ex.manifest.numel(0), 0.1, np.float32),
                             tokens=10)
    agg = Aggregator(open_run(ObjectStore(u)))
    agg.run(timeout=10.0, poll_interval=0.02)
    for r in range(2):
        _, commit = ex.fetch_mean(0, r)
        assert commit["weights"] == {"w0": 0.5, "w1": 0.5}
    assert agg.done


@pytest.mark.parametrize("mode", ["diloco", "streaming"])
def test_aggregator_waits_for_every_worker_before_the_deadline(mode):
    cfg = SyncConfig(
        schedule={"mode": mode, "sync_every": 2, "fragments": 1},
        membership={"deadline_s": 30.0},
    )
    from diloco.run import new_run  # noqa: PLC0415

    u = url()
    new_run(ObjectStore(u), Blocks(), cfg, workers=["w0", "w1"], total_steps=2)
    ex = open_run(ObjectStore(u))
    ex.publish_delta(0, 0, "w0", np.zeros(ex.manifest.numel(0), np.float32), tokens=1)
    agg = Aggregator(open_run(ObjectStore(u)))
    assert agg.poll_once() is False
    assert ex.fetch_mean(0, 0) is None
