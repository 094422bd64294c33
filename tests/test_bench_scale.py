"""`diloco bench scale` at 1e6 parameters on local disk: every stage of the round is
timed, every party's peak RSS is reported, the round completes (w0 decodes the mean
the aggregator published), and the reduce throughput has its K = 2 ratio. The recipe
sizes (small, 150m) shrunk to a tiny model: real runs whose every stage, blocked time
and peak RSS is in the table; the stage clock's bookkeeping."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import bench_scale, run_all, stages  # noqa: E402
from diloco.arithmetic import split_sizes  # noqa: E402


def test_scale_round_at_1e6_on_local_disk(tmp_path):
    code = bench_scale.main(["--sizes", "1b", "--params", "1e6", "--backends", "file",
                             "--shards", "1,2",
                             "--reduce-log2n", "14", "--results-dir", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "scale.json").read_text())
    (row,) = report["rounds"]
    assert row["completed"] and row["backend"] == "file"
    assert row["fragment_values"] == split_sizes(1_000_000, 4)[0]
    assert set(row["stages_s"]) == set(bench_scale.STAGES)
    assert all(v >= 0 for v in row["stages_s"].values())
    assert row["latency_s"] > 0
    assert set(row["rss"]) == set(row["cpu_s"]) == {"w0", "w1", "aggregator", "fetch"}
    for party in row["rss"].values():
        assert party["peak_rss_mib"] >= party["base_rss_mib"] > 0
        assert party["peak_over_fragment_x"] > 0  # each party holds at least its data
    assert [r["shards"] for r in report["reduce"]] == [1, 2]
    assert report["reduce"][0]["ratio"] == 1.0 and report["reduce"][1]["ratio"] > 0
    blocked = report["blocked"]
    assert blocked["tau"] == 100 // 4 - 1 and 0 <= blocked["blocked_share"] <= 1
    md = (tmp_path / "scale.md").read_text()
    assert "| completed | True |" in md and "| aggregator |" in md and "a model" in md


def test_peers_round_reads_the_other_contributions(tmp_path):
    """topk2 with mean_from peers: no mean payload; w0 sums the contributions and gets
    the bits the aggregator's weights give."""
    code = bench_scale.main(["--sizes", "1b", "--params", "2e5", "--fragments", "2",
                             "--backends", "file",
                             "--peers", "--shards", "", "--results-dir", str(tmp_path)])
    assert code == 0
    (row,) = json.loads((tmp_path / "scale.json").read_text())["rounds"]
    assert row["completed"] and row["mean_from"] == "peers" and row["up"] == "topk2"


def test_blocked_share_model():
    """The overlap: auto model: a round of H/P steps hides tau = H/P - 1 of them."""
    b = bench_scale.blocked(latency_s=15.0, step_s=0.5, sync_every=100, fragments=4)
    assert b["blocked_s"] == 3.0 and b["blocked_share"] == round(3.0 / 15.5, 4)
    assert bench_scale.blocked(1.0, 0.5, 100, 4)["blocked_s"] == 0.0


def test_diloco_bench_scale_is_wired():
    cmd = run_all.command("scale", True, False, Path("/tmp/r"))
    assert cmd[1:3] == ["-m", "benchmarks.bench_scale"]
    args = bench_scale.parser().parse_args(cmd[3:])
    assert args.out == "quick-scale" and args.params == 1e6 and args.backends == "file"
    assert args.sizes == "small,150m,1b" and args.recipe_set  # quick: a tiny model


TINY = "model.overrides={d_model: 32, n_layers: 6, n_heads: 2}"


def test_recipe_sizes_run_for_real(tmp_path):
    """small and 150m (P = 4 and 6) with a tiny model: H = P x 2, H + 2 steps, so
    fragment 0 has two scheduled rounds and every fragment a final one."""
    code = bench_scale.main(["--sizes", "small,150m", "--stride", "2", "--recipe-seq-len",
                             "32", "--recipe-batch-size", "2", "--recipe-set", TINY,
                             "--results-dir", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "scale.json").read_text())
    assert not report["rounds"] and not report["reduce"]  # 1b not asked for
    small, mid = report["sizes"]
    assert (small["recipe"], mid["recipe"]) == ("small", "gpu-150m")
    for row, p in ((small, 4), (mid, 6)):
        assert row["fragments"] == p and row["sync_every"] == 2 * p
        assert row["steps"] == 2 * p + 2 and row["completed"]
        assert row["aggregator_rounds"] == 2 * p + 1  # fragment 0 twice, the rest once, p finals
        assert "sync.schedule.overlap=auto" in row["overrides"]
        assert set(row["stages_s"]) == {*bench_scale.STAGES, "send", "merge"}
        assert all(v >= 0 for v in row["stages_s"].values()) and row["latency_s"] > 0
        assert [w["worker"] for w in row["per_worker"]] == ["w0", "w1"]
        for w in row["per_worker"]:
            assert w["steps"] == row["steps"] and w["step_s"] > 0
            assert w["merges"] == row["steps"] // 2  # merge points outside the drain
            assert 0 <= w["wait_s"] <= w["blocked_s"] < w["steady_loop_s"]
            assert 0 <= w["blocked_share"] < 1
            assert w["peak_rss_mib"] >= w["base_rss_mib"] > 0
        agg = row["aggregator_rss"]
        assert agg["peak_rss_mib"] >= agg["base_rss_mib"] > 0
        for model in (row["blocked_cpu_model"], row["blocked_gpu_model"]):
            assert model["round_steps"] == row["recipe_sync_every"] // p
            assert 0 <= model["blocked_share"] <= 1
    assert mid["blocked_gpu_model"]["step_s"] == 0.3  # the stated 150M GPU step
    md = (tmp_path / "scale.md").read_text()
    assert "gpu-150m" in md and "a model at a stated GPU step" in md
    assert "| merge |" in md and "| send |" in md and "worker peak RSS" in md


def test_stage_clock_names_own_time_and_drain():
    """A stage inside another counts apart; stages under ``drain`` are named so; a
    fetch_mean that found nothing is a poll; store time splits a stage in two."""
    clock = stages.StageClock()
    store_get = clock.store_call(lambda: b"x")

    def fetch(found: bool):
        store_get()
        return (b"mean", {}) if found else None

    fetch_mean = clock.timed("fetch_mean", fetch)
    wait = clock.timed("wait", lambda: None)
    merge = clock.timed("merge", lambda: wait())
    drain = clock.timed("drain", lambda: (merge(), fetch_mean(True)))
    fetch_mean(False)
    fetch_mean(True)
    merge()
    drain()
    calls = {k: v["calls"] for k, v in clock.report().items()}
    assert calls == {"poll": 1, "fetch_download": 1, "fetch_decode": 1, "merge": 1, "wait": 1,
                     "drain": 1, "drain:merge": 1, "drain:wait": 1,
                     "drain:fetch_download": 1, "drain:fetch_decode": 1}
    assert all(v["seconds"] >= 0 for v in clock.report().values())
