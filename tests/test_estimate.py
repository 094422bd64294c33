"""``diloco estimate`` and diloco/arithmetic.py: the figures a user pays by before a run
agree with what a measured run counts (issue 17: within 5%)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cli.app import app
from diloco import arithmetic as ar
from diloco.config import SyncConfig
from diloco.run import plan_for
from storage.codecs import CodecSpec, encoded_nbytes
from tests.replicas import Blocks, data, train_replicas


def _close(measured: int, estimated: int, what: str) -> None:
    assert abs(estimated - measured) <= 0.05 * measured, (what, measured, estimated)


@pytest.mark.parametrize("up, down, fragments, mean_from", [
    ("int4", "int8", 2, "aggregator"), ("int8", "int8", 1, "aggregator"),
    ("topk2", "int8", 2, "aggregator"), ("topk2", "topk2", 2, "peers"),
    ("int4", "int8", 2, "peers"),
])
def test_estimate_agrees_with_a_measured_tiny_run(tmp_path, up, down, fragments, mean_from):
    # chunks of 64 values, so the tiny model's fragments are several sparse chunks;
    # no norm guard: a tiny model's norms jump, and rejection notes are not modelled
    cfg = SyncConfig(
        schedule={"mode": "streaming", "sync_every": 4, "fragments": fragments},
        codec={"up": up, "down": down, "mean_from": mean_from, "chunk": 64, "k": 8},
        guard={"ratio": 0},
    )
    steps = 16
    res = train_replicas(f"file://{tmp_path}/run", Blocks, data, cfg, total_steps=steps)
    sizes = tuple(f.numel for f in plan_for(Blocks(), cfg).fragments)
    # the harness writes no status objects (a real worker does, once a second at most)
    s = ar.Setup(params=sum(sizes), workers=2, steps=steps, sync_every=4, fragments=fragments,
                 up=cfg.up, down=cfg.down, merge_alpha=cfg.schedule.merge_alpha, momentum=cfg.outer.momentum > 0,
                 residual=res.aggregator.feedback, status_every_s=None, sizes=sizes,
                 mean_from=mean_from)
    est = ar.per_run(s)
    for worker, trace in res.traces.items():
        counted = trace.sync.exchange.store.traffic
        _close(counted.bytes_up, est["worker"].up, f"{worker} up")
        _close(counted.bytes_down, est["worker"].down, f"{worker} down")
    counted = res.aggregator.exchange.store.traffic
    _close(counted.bytes_up, est["aggregator"].up, "aggregator up")
    _close(counted.bytes_down, est["aggregator"].down, "aggregator down")


def test_a_large_fragment_is_several_chunk_objects():
    n = 3 * 2**26  # above MAX_CHUNK: zarr splits the array, every chunk carries a crc
    nbytes, objects = ar.array_traffic(n, CodecSpec("int8"))
    assert objects == 4
    assert nbytes == ar.metadata_nbytes(n, CodecSpec("int8")) + 3 * (2**26 + 2**26 // 32 + 4)


def test_data_parallel_and_link_rates_follow_the_formulas():
    s = ar.Setup(params=10**9, workers=8, steps=10_000, sync_every=100, fragments=4,
                 up=CodecSpec("int4"), down=CodecSpec("int8"), overlap=5)
    assert ar.data_parallel_per_step(10**9, 8) == 7e9
    rates = ar.link_rates(s)
    wire = sum(ar.per_round(s)["worker"].wire())
    assert rates["streaming-average"] == pytest.approx(8 * wire / 100)
    one = sum(ar.worker_round(s, max(s.fragment_sizes)).wire())
    assert rates["streaming"] == pytest.approx(8 * one / 5)  # within tau = 5 steps
    assert rates["eager"] == pytest.approx(8 * one / 25)  # within H/P = 25 steps
    # 1/4 of the parameters per fragment, to within one block
    assert max(s.fragment_sizes) - min(s.fragment_sizes) < 128


def test_overlap_auto_may_hide_a_round_behind_every_step_but_one_of_its_stride():
    """Under ``overlap: auto`` a round may take up to H/P - 1 steps unseen, so the link
    it needs is what one fragment's round moves in those steps; rounds count as with
    the reference tau, ``overlap_start`` (by default H/P - 1)."""
    auto = ar.Setup.of(SyncConfig(
        schedule={"sync_every": 100, "fragments": 4, "overlap": "auto"},
        codec={"up": "int4", "down": "int8"},
    ), 10**9, 8, 10_000)
    fixed = ar.Setup.of(SyncConfig(
        schedule={"sync_every": 100, "fragments": 4, "overlap": 24},
        codec={"up": "int4", "down": "int8"},
    ), 10**9, 8, 10_000)
    assert auto.overlap == 24 and auto.hide_steps == 24
    assert ar.link_rates(auto)["streaming"] == pytest.approx(ar.link_rates(fixed)["streaming"])
    assert ar.per_round(auto) == ar.per_round(fixed)
    started = ar.Setup.of(SyncConfig(
        schedule={"sync_every": 100, "fragments": 4, "overlap": "auto", "overlap_start": 1},
        codec={"up": "int4", "down": "int8"},
    ),
                          10**9, 8, 10_000)
    assert started.overlap == 1 and ar.per_round(started) == ar.per_round(
        replace(fixed, overlap=1))


def test_peers_download_the_other_contributions_not_the_mean():
    base = ar.Setup(params=10**6, workers=4, fragments=1, up=CodecSpec("int4"),
                    down=CodecSpec("int8"))
    peers = ar.worker_round(ar.Setup(**{**vars(base), "mean_from": "peers"}), 10**6)
    contribution = ar.array_traffic(10**6, CodecSpec("int4"))[0]
    assert contribution * 3 < peers.down < contribution * 3 + 5000
    assert peers.up == ar.worker_round(base, 10**6).up


def _json(in_process, *args: str) -> dict:
    result = in_process.invoke(app, ["estimate", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_estimate_prices_the_bytes_with_the_providers_list_prices(in_process):
    out = _json(in_process, "--params", "1e8", "-M", "4", "--steps", "1000", "-H", "100",
                "-P", "2", "--codec-up", "int4", "--codec-down", "int8",
                "--provider", "s3", "--provider", "r2")
    s = ar.Setup(params=10**8, workers=4, steps=1000, sync_every=100, fragments=2,
                 up=CodecSpec("int4"), down=CodecSpec("int8"), overlap=0)
    run = ar.per_run(s)
    s3, r2 = out["providers"]["s3"][1], out["providers"]["r2"][1]
    assert s3["egress_down_usd"] == pytest.approx(4 * run["worker"].down / 1e9 * 0.09)
    assert s3["egress_up_usd"] == 0.0  # the workers' own provider: other, no fee
    assert r2["egress_down_usd"] == 0.0 and r2["requests_usd"] > 0
    assert out["providers"]["s3"][0]["up_per_round"] == pytest.approx(2 * 3 / 4 * 4e8)


def test_contenders_send_less_in_the_order_the_codecs_promise(in_process):
    out = _json(in_process, "--params", "1e9", "-M", "8", "--steps", "10000", "-H", "100",
                "-P", "4", "--contenders", "--provider", "s3")
    rows = {r["contender"]: r for r in out["providers"]["s3"]}
    assert rows["data-parallel"]["less_than_dp"] == 1
    assert rows["streaming int4/int8"]["less_than_dp"] > 1000
    assert (rows["streaming topk2, peers"]["total_usd"]
            < rows["streaming int4/int8"]["total_usd"] < rows["diloco float32"]["total_usd"])


@pytest.mark.parametrize("args, expected", [
    (["--params", "1e9", "--fragments", "3", "--sync-every", "100"],
     "sync_every (H) must be divisible by fragments (P): H = 100, P = 3"),
    (["--params", "1e9", "--codec-up", "int3"], "codec.up: must be one of"),
    (["--params", "1e9", "--mean-from", "peer"], "mean_from: Input should be 'aggregator'"),
    (["--params", "1e9", "--sparse-k", "5000"], "k: must be in [1, chunk = 4096]"),
    (["--params", "1e9", "--crossing", "moon"], "crossing: must be one of"),
    (["--params", "1e9", "--overlap", "soon"], "--overlap: a whole number of steps or auto"),
    (["--params", "1e9", "--provider", "s3", "--worker-provider", "aws"],
     "use --crossing inter-region or none"),
    ([], "--params: give a parameter count"),
])
def test_bad_input_is_one_line_and_exit_2(in_process, args, expected):
    result = in_process.invoke(app, ["estimate", *args])
    assert result.exit_code == 2, result.output
    assert expected in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("fragments", [2, 4])
def test_split_sizes_are_the_fragments_a_run_cuts(fragments):
    model = Blocks(width=32)  # 4,417 parameters, so every cut falls inside a tensor
    cfg = SyncConfig(schedule={"sync_every": 8, "fragments": fragments})
    planned = tuple(f.numel for f in plan_for(model, cfg).fragments)
    assert ar.split_sizes(sum(planned), fragments, cfg.codec.block_size) == planned


def test_a_large_fragment_is_cut_evenly_so_zarr_pads_little():
    """250M values (a 1B model's fragment at P = 4) are 4 chunks of 62.5M, not 4 of
    2^26 with a mostly padded last one: the bytes stored are within a block per chunk
    of the payload's own."""
    n = 250_000_000
    nbytes, objects = ar.array_traffic(n, CodecSpec("int4"))
    assert objects == 5
    payload = encoded_nbytes(n, CodecSpec("int4"))
    assert payload < nbytes - ar.metadata_nbytes(n, CodecSpec("int4")) < payload * 1.0001
