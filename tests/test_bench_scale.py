"""`diloco bench scale` at 1e6 parameters on local disk: every stage of the round is
timed, every party's peak RSS is reported, the round completes (w0 decodes the mean
the aggregator published), and the reduce throughput has its K = 2 ratio. The recipe
sizes (small, 150m) shrunk to a tiny model: real runs whose every stage, blocked time
and peak RSS is in the table; the stage clock's bookkeeping."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import pickle
import sys
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from forkhost import ForkHost, fork_call  # noqa: E402

from benchmarks import bench_scale, run_all, stages  # noqa: E402
from diloco.arithmetic import split_sizes  # noqa: E402

# -- the benchmark's child processes, forked ---------------------------------------------
# `diloco bench scale` runs every party of the round (`python -m benchmarks.bench_scale
# --party`), each shard of the reduce (multiprocessing, spawn) and each recipe size
# (`python -m benchmarks.scale_recipes`) in a fresh interpreter, whose start and
# imports (numpy, the store; torch for the last two) were most of this file's CPU.
# Here `main` runs in a process forked from a host that imported them once
# (tests/forkhost.py), and those children are forked from it: each is still a process
# of its own, with its own peak RSS and CPU clock, and runs the same function. One
# party and one recipe size still start as the benchmark starts them, so that its
# command lines stay tested, and the shards' target is checked to pickle as spawn
# needs.

#: what the forked children import: the test module (so its functions unpickle) and
#: the benchmark's children's modules
PRELOAD = ("test_bench_scale", "benchmarks.bench_shards", "benchmarks.scale_recipes",
           "benchmarks.contenders", "benchmarks.recipe", "benchmarks.timed_worker",
           "diloco.aggregator", "diloco.run", "diloco.shards", "storage.exchange",
           "storage.spec", "workers.config", "workers.runs", "workers.model")


@pytest.fixture(scope="module")
def host() -> Iterator[ForkHost]:
    with ForkHost(*PRELOAD) as started:
        yield started


def _party(role: str, url: str, options: dict, env: dict[str, str]) -> dict:
    """What `python -m benchmarks.bench_scale --party` does (bench_scale._child)."""
    os.environ.update(env)
    return json.loads(json.dumps(bench_scale.party(role, url, options)))


def _recipe_row(size: str, argv: list[str]) -> dict:
    """What `python -m benchmarks.scale_recipes` does (scale_recipes.child): its row."""
    from benchmarks import scale_recipes  # noqa: PLC0415

    os.chdir(ROOT)
    out = io.StringIO()
    with redirect_stdout(out):
        assert scale_recipes.main([size, *argv]) == 0
    return json.loads(out.getvalue().splitlines()[-1])


class _ForkingMultiprocessing:
    """bench_shards' ``mp``: its shard processes forked (from a forked process that ran
    nothing but imports) instead of spawned."""

    @staticmethod
    def get_context(method: str):
        assert method == "spawn"
        return multiprocessing.get_context("fork")


def forked_main(argv: list[str], real_party: str = "", real_size: str = "") -> int:
    """`bench_scale.main` with its children forked (see above), in a forked process:
    ``real_party`` and ``real_size`` still start as the benchmark starts them."""
    from benchmarks import bench_shards, scale_recipes  # noqa: PLC0415

    real_child, real_recipe = bench_scale._child, scale_recipes.child

    def child(role, url, options, env):
        if role == real_party:
            return real_child(role, url, options, env)
        row = fork_call(_party, role, url, options, env)
        print(json.dumps(row), flush=True)
        return row

    def recipe(size, argv):
        return real_recipe(size, argv) if size == real_size else fork_call(
            _recipe_row, size, argv)

    bench_scale._child, scale_recipes.child = child, recipe
    bench_shards.mp = _ForkingMultiprocessing
    return bench_scale.main(argv)


def test_scale_round_at_1e6_on_local_disk(tmp_path, host):
    from benchmarks import bench_shards  # noqa: PLC0415

    # what spawning the shards needs of their target (here they are forked)
    assert pickle.loads(pickle.dumps(bench_shards._shard)) is bench_shards._shard
    code = host.call(forked_main, [
        "--sizes", "1b", "--params", "1e6", "--backends", "file", "--shards", "1,2",
        "--reduce-log2n", "14", "--results-dir", str(tmp_path)], real_party="fetch")
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


def test_peers_round_reads_the_other_contributions(tmp_path, host):
    """topk2 with mean_from peers: no mean payload; w0 sums the contributions and gets
    the bits the aggregator's weights give."""
    code = host.call(forked_main, ["--sizes", "1b", "--params", "2e5", "--fragments", "2",
                                   "--backends", "file", "--peers", "--shards", "",
                                   "--results-dir", str(tmp_path)])
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


def test_recipe_sizes_run_for_real(tmp_path, host):
    """small and 150m (P = 4 and 6) with a tiny model: H = P x 2, H + 2 steps, so
    fragment 0 has two scheduled rounds and every fragment a final one. (small's run
    starts as `python -m benchmarks.scale_recipes`, 150m's is forked; the workers of
    both are `benchmarks.timed_worker` processes.)"""
    code = host.call(forked_main, [
        "--sizes", "small,150m", "--stride", "2", "--recipe-seq-len", "32",
        "--recipe-batch-size", "2", "--recipe-set", TINY, "--results-dir", str(tmp_path)],
        real_size="small")
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
