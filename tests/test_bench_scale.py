"""`diloco bench scale` at 1e6 parameters on local disk: every stage of the round is
timed, every party's peak RSS is reported, the round completes (w0 decodes the mean
the aggregator published), and the reduce throughput has its K = 2 ratio."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import bench_scale, run_all  # noqa: E402
from diloco.arithmetic import split_sizes  # noqa: E402


def test_scale_round_at_1e6_on_local_disk(tmp_path):
    code = bench_scale.main(["--params", "1e6", "--backends", "file", "--shards", "1,2",
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
    code = bench_scale.main(["--params", "2e5", "--fragments", "2", "--backends", "file",
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
