"""Smoke tests of the benchmarks: their arithmetic, the counting proxy, the network
namespaces (when root), and a 2-step quality run end to end."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

# benchmarks/ is not an installed package: importable from the repository root,
# which `python -m pytest` puts on sys.path and the `pytest` script does not.
ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import (  # noqa: E402
    bench_bandwidth,
    bench_elastic,
    bench_quality,
    bench_traffic,
    netns,
    run_all,
)
from benchmarks.contenders import Contender, load  # noqa: E402
from benchmarks.measurements import summarise_traffic  # noqa: E402
from benchmarks.recipe import CODECS, MODES, reference_overrides  # noqa: E402
from benchmarks.report import RESULTS  # noqa: E402
from benchmarks.timed_worker import Clock  # noqa: E402
from tests.s3server import MotoS3Server  # noqa: E402
from workers.config import ConfigError  # noqa: E402

N = 885_888  # parameters of the reference model (recipe.REFERENCE_MODEL)


def test_reference_model_size():
    """4 blocks of (4 x 128^2 attention + 3 x 128 x 384 SwiGLU + 2 x 128 norms) =
    4 x 213,248, plus the tied 256 x 128 embedding and the final norm (128)."""
    cfg = load(Contender("diloco"), reference_overrides())
    assert cfg.model_config_resolved.num_parameters() == 4 * 213_248 + 32_768 + 128 == N


def test_data_parallel_arithmetic():
    """docs/algorithms.md section 8: a ring all-reduce sends and receives 2 (M-1)/M x 32 bits
    per parameter each way: 4 bytes at M = 2, 6 bytes at M = 4."""
    assert bench_traffic.dp_arithmetic(N, 2) == {"up": 4 * N, "down": 4 * N}
    assert bench_traffic.dp_arithmetic(N, 4) == {"up": 6 * N, "down": 6 * N}
    assert bench_quality.dp_bytes_per_step(N, 2) == 8 * N  # up + down
    # int4 up (4 + 32/128 bits) + int8 down (8 + 32/128 bits) every H = 100 steps:
    # 12.5 / 100 bits a step against 64: 512 times less, above the 500 target.
    diloco_bits = (4 + 32 / 128 + 8 + 32 / 128) / 100
    assert 64 / diloco_bits == pytest.approx(512)


def test_steady_state_leaves_the_final_round_out():
    """Per step = sum over fragments of the mean bytes of a scheduled round / H."""
    per_round = {
        "0/r000000": {"bytes_up": 100, "bytes_down": 200, "requests": 4},
        "0/r000001": {"bytes_up": 300, "bytes_down": 400, "requests": 6},
        "0/r000002": {"bytes_up": 9999, "bytes_down": 9999, "requests": 99},  # final
        "1/r000000": {"bytes_up": 50, "bytes_down": 60, "requests": 2},
    }
    worker = {"traffic": {"per_round": per_round}}
    got = bench_traffic.steady_state(worker, rounds=[3, 1], sync_every=10,
                                     final=[True, False])
    # fragment 0: mean of (100, 300) / 10 = 20 up; fragment 1: 50 / 10 = 5 up
    assert got == {"bytes_up": 25.0, "bytes_down": 36.0, "requests": 0.7}


def test_summarise_traffic_splits_exchange_rounds_and_payloads():
    snap = {
        "requests": 9, "bytes_up": 1_100, "bytes_down": 5_000,
        "by_category": {
            "": {"requests": 1, "bytes_up": 0, "bytes_down": 500},  # run.json
            "global/init/0": {"requests": 2, "bytes_up": 0, "bytes_down": 4_000},
            "frag/0/r000000/delta/w0/abc": {"requests": 2, "bytes_up": 1_000, "bytes_down": 0},
            "frag/0/r000000/commits": {"requests": 1, "bytes_up": 100, "bytes_down": 0},
            "frag/0/r000000/mean/agg/xyz": {"requests": 3, "bytes_up": 0, "bytes_down": 500},
        },
        "objects_up": {"frag/0/r000000/delta/w0/abc/zarr.json": 200,
                       "frag/0/r000000/delta/w0/abc/c/0": 800},
        "objects_down": {"frag/0/r000000/mean/agg/xyz/c/0": 500},
    }
    s = summarise_traffic(snap)
    assert s["exchange"] == {"requests": 6, "bytes_up": 1_100, "bytes_down": 500}
    assert s["other"] == {"requests": 3, "bytes_up": 0, "bytes_down": 4_500}
    assert s["per_round"] == {"0/r000000": {"requests": 6, "bytes_up": 1_100,
                                            "bytes_down": 500}}
    assert s["delta_payload_bytes"] == {"0/r000000": 1_000}
    assert s["mean_payload_bytes"] == {"0/r000000": 500}


def test_clock_utilisation():
    """10 s loop, 1 s in merges, 2 s of final drain, 0.5 s of status writes:
    compute 6.5 s; utilisation 6.5 / 10, steady 6.5 / 8."""
    c = Clock()
    c.loop_start, c.loop_end = 100.0, 110.0
    c.sync_s, c.finish_s, c.status_s = 1.0, 2.0, 0.5
    r = c.report()
    assert r["compute_s"] == pytest.approx(6.5)
    assert r["utilisation"] == pytest.approx(0.65)
    assert r["utilisation_steady"] == pytest.approx(6.5 / 8)


def test_caps_and_lowest_cap():
    assert bench_bandwidth.parse_caps("none, 1000,1") == [None, 1e9, 1e6]
    assert bench_bandwidth.cap_label(1e9) == "1 Gbit/s"
    assert bench_bandwidth.cap_label(3e6) == "3 Mbit/s"

    def r(cap, ok):
        return {"mode": "eager", "cap_bits_per_s": cap, "keeps_95": ok}

    # the ladder stops at the first failing rung from the top, even if a lower passes
    rows = [r(None, True), r(1e9, True), r(1e7, True), r(1e6, False), r(3e5, True)]
    assert bench_bandwidth.lowest_cap(rows, "eager") == 1e7
    assert bench_bandwidth.lowest_cap([r(None, False)], "eager") == "not reached"
    # data-parallel's steps at a cap: budget / all-reduce seconds a step, at least 3
    assert bench_bandwidth.dp_steps(None, 90, N, 2, 60) == 90
    assert bench_bandwidth.dp_steps(1e6, 90, N, 2, 60) == 3  # 28 s a step
    assert bench_bandwidth.dp_steps(1e9, 90, N, 2, 60) == 90


def test_contender_overrides_are_valid_configs():
    for mode in ("data-parallel", *MODES):
        for codec in CODECS:
            c = Contender(mode, codec, workers=4, outer_lr=0.5, outer_momentum=0.0)
            if "sync.schedule.overlap=12" in MODES.get(mode, []) and "sync.schedule.sync_every=8" in CODECS[codec]:
                with pytest.raises(ConfigError, match="tau < H/P = 4, got 12"):
                    load(c, reference_overrides(steps=100))  # said before anything runs
                continue
            cfg = load(c, reference_overrides(steps=100))
            assert len(cfg.workers) == 4
            if mode != "data-parallel":
                assert cfg.sync.outer.lr == 0.5 and cfg.sync.outer.momentum == 0.0
    with pytest.raises(ValueError, match="mode"):
        Contender("nope")


def test_counting_proxy_counts_both_ways():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo():
        conn, _ = server.accept()
        with conn:
            data = b""
            while len(data) < 1000:  # the proxy may forward it in several pieces
                data += conn.recv(1 << 16)
            conn.sendall(data * 3)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    proxy = bench_traffic.CountingProxy(f"http://127.0.0.1:{port}")
    try:
        host, pport = proxy.endpoint_url.rsplit("/", 1)[-1].split(":")
        with socket.create_connection((host, int(pport))) as c:
            c.sendall(b"x" * 1000)
            got = b""
            while len(got) < 3000:
                got += c.recv(1 << 16)
        t.join(5)
        deadline = threading.Event()
        for _ in range(100):  # each pump counts after forwarding: wait for both
            if proxy.counts()["down"] == 3000 and proxy.counts()["up"] == 1000:
                break
            deadline.wait(0.05)
        assert proxy.counts() == {"up": 1000, "down": 3000, "connections": 1}
    finally:
        proxy.close()
        server.close()


def test_run_all_commands():
    quick = run_all.command("quality", True, False, RESULTS)
    assert quick[1:3] == ["-m", "benchmarks.bench_quality"]
    assert "--no-mlflow" in quick and "quick-quality" in quick
    full = run_all.command("codecs", False, True, RESULTS)
    assert full[-2:] == ["--out", str(RESULTS / "codecs.json")]


def test_run_all_refuses_unknown_names_with_the_allowed_ones(capsys):
    """`python -m benchmarks.run_all --only codecs,speed`: exit 2 before anything runs,
    naming the unknown and the allowed; an empty --only is refused the same way."""
    for only, unknown in (("codecs,speed", "unknown speed"), (" , ", "unknown (empty)")):
        with pytest.raises(SystemExit) as exit_:
            run_all.main(["--only", only])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert unknown in err and "allowed: codecs, exchange, quality, traffic, bandwidth" in err


def test_s3_server_binds_the_given_host():
    """The one moto server of tests and benchmarks, on another loopback address
    (127.0.0.2: all of 127/8 is loopback on Linux), as the benchmarks bind it to a
    bridge's address; a fresh bucket, and storage options s3fs can use."""
    import boto3  # noqa: PLC0415
    import s3fs  # noqa: PLC0415

    with MotoS3Server("127.0.0.2") as server:
        assert server.endpoint_url.startswith("http://127.0.0.2:")
        bucket = server.new_bucket()
        client = boto3.client("s3", endpoint_url=server.endpoint_url,
                              aws_access_key_id="testing", aws_secret_access_key="testing",
                              region_name="us-east-1")
        assert bucket in [b["Name"] for b in client.list_buckets()["Buckets"]]
        fs = s3fs.S3FileSystem(**server.options())
        fs.pipe(f"{bucket}/x", b"abc")
        assert fs.cat(f"{bucket}/x") == b"abc"
        assert server.options("http://127.0.0.1:9")["endpoint_url"] == "http://127.0.0.1:9"


needs_netns = pytest.mark.skipif(
    netns.available() is not None, reason=f"network namespaces: {netns.available()}")


@needs_netns
def test_netns_topology_is_set_up_capped_and_cleaned_up():
    prefix = "dlbz-"
    netns.cleanup(prefix)
    with netns.Topology(2, prefix=prefix, subnet="10.213.77") as topo:
        assert sorted(netns.namespaces(prefix)) == ["dlbz-w0", "dlbz-w1"]
        assert {"dlbz-br", "dlbz-w0h", "dlbz-w1h"} <= set(netns.links(prefix))
        topo.set_cap(5e6)
        classes = subprocess.run(["tc", "class", "show", "dev", "dlbz-w0h"],
                                 capture_output=True, text=True).stdout
        assert "rate 5Mbit" in classes
        inside = subprocess.run([*topo.workers[1].prefix, "tc", "class", "show", "dev",
                                 "dlbz-w1n"], capture_output=True, text=True).stdout
        assert "rate 5Mbit" in inside
        # the worker reaches the bridge's address
        probe = subprocess.run(
            [*topo.workers[0].prefix, "python3", "-c",
             "import socket; s = socket.socket(); s.settimeout(2); "
             f"print(s.connect_ex(('{topo.host_addr}', 9)))"],
            capture_output=True, text=True)
        assert probe.stdout.strip() in ("111", "0")  # refused (nothing listens): reachable
        assert topo.workers[0].counters()["up"] > 0
    assert netns.namespaces(prefix) == [] and netns.links(prefix) == []


@needs_netns
def test_netns_cleanup_removes_leftovers_by_prefix():
    prefix = "dlby-"
    subprocess.run(["ip", "netns", "add", f"{prefix}w0"], check=True)
    subprocess.run(["ip", "link", "add", f"{prefix}w0h", "type", "veth", "peer", "name",
                    f"{prefix}w0n"], check=True)
    try:
        with pytest.raises(RuntimeError, match="leftovers"):
            netns.Topology(1, prefix=prefix).__enter__()
        removed = netns.cleanup(prefix)
        assert f"netns {prefix}w0" in removed
        assert netns.namespaces(prefix) == [] and netns.links(prefix) == []
    finally:
        netns.cleanup(prefix)


@pytest.mark.slow
def test_quality_two_step_smoke(tmp_path, monkeypatch):
    """Data-parallel against blocking DiLoCo with int4, 2 steps each, end to end:
    processes, aggregator, canonical eval, JSON and Markdown. The score is taken on 4
    validation batches instead of the recipe's 32: five evaluations (each data-parallel
    rank, each DiLoCo worker, the canonical model) were a third of this test's CPU,
    and their size is not what it checks."""
    monkeypatch.setenv("DILOCO_TRACKING", "off")
    recipe = bench_quality.reference_overrides
    monkeypatch.setattr(bench_quality, "reference_overrides",
                        lambda *a, **k: [*recipe(*a, **k), "train.eval_batches=4"])
    report = bench_quality.main([
        "--steps", "2", "--sync-every", "2", "--workers", "2", "--modes", "diloco",
        "--codecs", "int4", "--sweep", "none", "--no-mlflow", "--out", "smoke",
        "--results-dir", str(tmp_path)])
    rows = report["results"]["rows"]
    assert [r["mode"] for r in rows] == ["data-parallel", "diloco"]
    for r in rows:
        assert 4.0 < r["eval_loss"] < 6.0  # near ln 256 = 5.55 after 2 steps
    dp, dl = rows
    assert dp["gap"] == 0.0
    # one round of int4 up / int8 down per worker over 2 steps, far below data-parallel
    assert dl["bytes_per_step"] < dp["bytes_per_step"] / 5
    saved = json.loads((tmp_path / "smoke.json").read_text())
    assert saved["results"]["rows"][1]["eval_loss"] == dl["eval_loss"]
    assert "| DiLoCo (blocking) |" in (tmp_path / "smoke.md").read_text()


def test_quality_long_sets_the_long_horizon_and_an_explicit_option_wins():
    """``--long`` is the long-horizon run (>= 100 rounds per fragment at M = 2 for
    streaming and the two exchange-hiding modes); an option given with it still wins."""
    args = bench_quality.parse(["--long"])
    assert (args.steps, args.sync_every, args.workers, args.out) == (3000, 30, "2",
                                                                     "quality-long")
    assert set(args.modes.split(",")) == {"streaming", "streaming-auto", "eager-tau12"}
    assert args.steps // args.sync_every >= 100
    args = bench_quality.parse(["--long", "--steps", "6000", "--out", "x"])
    assert (args.steps, args.sync_every, args.out) == (6000, 30, "x")
    assert bench_quality.parse([]).steps == 600


def test_bandwidth_target():
    """100x: data-parallel's lowest passing cap (or, when none passes, the estimate)
    over adaptive eager's."""
    t = bench_bandwidth.target({"eager": 3e6, "data-parallel": 1e9}, None)
    assert t["ratio"] == pytest.approx(1e9 / 3e6) and t["met"]
    t = bench_bandwidth.target({"eager": 3e6, "data-parallel": "not reached"}, 2e9)
    assert t["ratio"] == pytest.approx(2e9 / 3e6) and t["met"]
    t = bench_bandwidth.target({"eager": 3e7, "data-parallel": 1e9}, None)
    assert t["ratio"] == pytest.approx(1e9 / 3e7) and not t["met"]
    assert not bench_bandwidth.target({"eager": "not reached", "data-parallel": 1e9},
                                      None)["met"]


def test_diloco_bench_runs_the_chosen_benchmarks(tmp_path):
    """`diloco bench --quick --only codecs`: the benchmark runs as its own process and
    its JSON and the summary land in --results-dir; a bad name is refused with the
    allowed ones, before anything runs."""
    from typer.testing import CliRunner  # noqa: PLC0415

    from cli.app import app  # noqa: PLC0415

    runner = CliRunner()
    out = runner.invoke(app, ["bench", "--only", "codecs", "--quick", "--no-mlflow",
                              "--results-dir", str(tmp_path)])
    assert out.exit_code == 0, out.output
    result = json.loads((tmp_path / "quick-codecs.json").read_text())
    assert result  # the codec table, measured
    summary = (tmp_path / "quick-summary.md").read_text()
    assert "## codecs" in summary and "ok" in summary
    bad = runner.invoke(app, ["bench", "--only", "codecs,speed"])
    assert bad.exit_code == 2
    assert "unknown speed" in bad.output and "bandwidth" in bad.output


def _elastic_row(name: str, tokens: float, wall: float, live: float, fast: float,
                 loss: float, **extra) -> dict:
    return {"scenario": name, "applied_tokens": tokens, "wall_s": wall,
            "goodput": tokens / wall, "live_workers": live,
            "fast_steps_per_s": dict.fromkeys(bench_elastic.FAST, fast), "eval_loss": loss,
            "joiner": None, "late": 0, "dropped": 0,
            "audit": {"lost": [], "double": []}, **extra}


def test_elastic_arithmetic_targets_and_table(tmp_path):
    """Goodput against fault-free per live worker, fast workers' throughput, eval loss
    interpolated on the fault-free curve at equal applied tokens, the targets, the
    table; and its config is a valid run config (a real run: `diloco bench elastic`)."""
    from workers.config import load_config  # noqa: PLC0415

    args = bench_elastic.parser().parse_args(["--steps", "36", "--sync-every", "6"])
    cfg = load_config("tiny", bench_elastic.overrides(args, "file:///tmp/data"))
    assert cfg.workers == ["w0", "w1", "w2", "w3"] and cfg.sync.liveness.lease_s == 5.0
    assert cfg.train.keep_checkpoints == 0 and cfg.train.threads == 1
    curve = [(100.0, 4.0), (200.0, 3.0), (400.0, 2.0)]
    assert bench_elastic.interpolate(curve, 300.0) == (2.5, True)
    assert bench_elastic.interpolate(curve, 500.0) == (2.0, False)
    rows = [
        _elastic_row("fault-free", 400, 10, 4.0, 2.0, 2.0),
        # 3 1/3 workers alive on average: 10 tokens/s each fault-free, 30 measured
        _elastic_row("kill", 300, 10, 10 / 3, 2.0, 2.5 * 1.005),
        _elastic_row("straggler", 400, 20, 4.0, 1.0, 2.0),
        _elastic_row("join", 400, 10, 4.5, 2.0, 2.0,
                     joiner={"rounds_to_first_contribution": 2}),
    ]
    bench_elastic.compare(rows, curve)
    kill = rows[1]
    assert kill["goodput_rel"] == pytest.approx(0.9)
    assert kill["fast_rel"] == 1.0 and kill["eval_gap"] == pytest.approx(0.005)
    assert rows[2]["fast_rel"] == 0.5
    met = {t["target"]: t["met"] for t in bench_elastic.targets(rows)}
    assert met["kill: goodput >= 0.88"] == "yes"
    assert met["straggler: fast workers lose <= 5% throughput"] == "no"
    assert met["joiner's first contribution within 2 rounds"] == "yes"
    assert met["audit: lost = double = 0 in every scenario"] == "yes"
    report = {"environment": bench_elastic.environment([], "benchmarks.bench_elastic"),
              "wall_seconds": 1.0, "results": {"rows": rows},
              "settings": {"steps": 36, "sync_every": 6, "model": "m", "slow_factor": 3.0,
                           "tokens_per_step": 512, "lease_s": 3.0, "grace_min_s": 0.1,
                           "grace_max_s": 3.0},
              "targets": bench_elastic.targets(rows)}
    bench_elastic.publish("elastic", report, bench_elastic.markdown, tmp_path)
    md = (tmp_path / "elastic.md").read_text()
    assert "| w3 SIGKILLed at 1/3, never back |" in md and "0.900" in md
    assert "lease_s = 3" in md


def test_diloco_bench_elastic_is_wired():
    """`diloco bench elastic` = `--only elastic`: run_all runs bench_elastic (quick:
    tiny sizes, no MLflow flag it would refuse)."""
    assert "elastic" in run_all.BENCHMARKS
    cmd = run_all.command("elastic", True, False, RESULTS)
    assert cmd[1:3] == ["-m", "benchmarks.bench_elastic"] and "quick-elastic" in cmd
    args = bench_elastic.parser().parse_args(cmd[3:])
    assert args.out == "quick-elastic" and not args.mlflow
    from typer.testing import CliRunner  # noqa: PLC0415

    from cli.app import app  # noqa: PLC0415

    bad = CliRunner().invoke(app, ["bench", "elastic", "speed"])  # names as arguments
    assert bad.exit_code == 2 and "unknown speed" in bad.output and "elastic" in bad.output


def test_bench_model_times_both_classes_and_the_imports(tmp_path):
    """benchmarks/bench_model at smoke size: a step time for each class, the import
    costs, the table; and `diloco bench` knows every benchmark run_all runs. One torch
    thread (the benchmark's default is 2): this runs in the test process, which keeps
    one (tests/conftest.py), and a second thread only spins on two busy cores."""
    from benchmarks import bench_model  # noqa: PLC0415
    from cli.bench import BENCHMARKS  # noqa: PLC0415

    report = bench_model.main(["--presets", "tiny", "--steps", "1", "--seq-len", "16",
                               "--threads", "1", "--import-repeats", "1",
                               "--results-dir", str(tmp_path)])
    row = report["steps"][0]
    assert row["preset"] == "tiny" and row["parameters"] == 3_279_104
    assert row["ours_ms"] > 0 and row["transformers_ms"] > 0
    imports = report["imports"]
    assert imports["transformers"]["rss_mb"] > imports["torch"]["rss_mb"]
    md = (tmp_path / "model.md").read_text()
    assert "| tiny | 3,279,104 |" in md and "+ transformers" in md
    assert tuple(BENCHMARKS) == tuple(run_all.BENCHMARKS)
