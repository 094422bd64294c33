"""Every benchmark in one command: codecs, exchange, quality, traffic, bandwidth, elastic,
prepare, model, scale, jitter.

    .venv/bin/python -m benchmarks.run_all [--only quality,traffic] [--quick] [--no-mlflow] \\
        [--results-dir DIR]

Each benchmark runs as its own process (``python -m benchmarks.<name>``, the same
command that reproduces it alone), one after the other, so that they do not share
the CPU. Each writes its JSON (and for quality, traffic and bandwidth a Markdown
table) under ``benchmarks/results/``; this command then writes
``benchmarks/results/summary.md`` with every table, the commands and their wall
times, and prints it. ``bandwidth`` needs root (network namespaces); without it, it
is reported as skipped. ``--quick`` runs every benchmark at smoke-test size and
writes ``quick-*`` results instead, leaving the real ones alone.

``diloco bench`` runs this module as a subprocess, with the checkout on PYTHONPATH
(benchmarks/ is not part of the installed package, and the product never imports
it). Exit status: 0 when every chosen benchmark ran (a skipped bandwidth counts as
ran), 1 when one failed, 2 for a bad ``--only`` (the message names the allowed
benchmarks), 130 when interrupted (Ctrl-C or SIGTERM; the running benchmark is
stopped first, so that it cleans up its processes, servers and namespaces).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.report import RESULTS, ROOT, stop_on_sigterm

BENCHMARKS = ("codecs", "exchange", "quality", "traffic", "bandwidth", "elastic", "prepare",
              "model", "scale", "jitter")

# Full-size arguments are each benchmark's defaults; quick ones are smoke-test sized.
QUICK: dict[str, list[str]] = {
    "codecs": ["--n", "1048576", "--repeats", "1"],
    "exchange": ["--backends", "file", "--mib", "1", "--repeats", "1"],
    "quality": ["--steps", "8", "--sync-every", "4", "--workers", "2", "--codecs", "int4",
                "--sweep", "none"],
    "traffic": ["--steps", "8", "--sync-every", "4", "--fragments", "1,2", "--workers", "2",
                "--dp-steps", "3"],
    "bandwidth": ["--caps", "none,10", "--steps", "6", "--sync-every", "4"],
    "elastic": ["--steps", "36", "--sync-every", "6", "--model",
                "{d_model: 32, n_layers: 2, n_heads: 2, max_seq_len: 64}"],
    "prepare": ["--size-mb", "8", "--file-mb", "4", "--train-mb", "2"],
    "model": ["--presets", "tiny", "--steps", "2", "--seq-len", "32", "--import-repeats", "1"],
    "scale": ["--params", "1000000", "--backends", "file", "--reduce-log2n", "16",
              "--recipe-seq-len", "32", "--recipe-batch-size", "2", "--recipe-set",
              "model.overrides={d_model: 32, n_layers: 6, n_heads: 2}"],
    "jitter": ["--repeats", "1", "--steps", "8", "--hogs", "1"],
}
MODULES = {name: f"benchmarks.bench_{name}" for name in BENCHMARKS}
HAS_MLFLOW = {"quality", "traffic", "bandwidth"}


def command(name: str, quick: bool, mlflow: bool, results_dir: Path) -> list[str]:
    prefix = "quick-" if quick else ""
    args = list(QUICK[name]) if quick else []
    if name in ("codecs", "exchange"):
        args += ["--out", str(results_dir / f"{prefix}{name}.json")]
    else:
        args += ["--out", f"{prefix}{name}", "--results-dir", str(results_dir)]
        if not mlflow:
            args.append("--no-mlflow")
    return [sys.executable, "-m", MODULES[name], *args]


def run_one(cmd: list[str]) -> tuple[int, str, float]:
    """Run a benchmark, echoing its standard output; returns (code, output, seconds)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    lines = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line)
        code = proc.wait()
    finally:
        _stop(proc)
    return code, "".join(lines), time.perf_counter() - t0


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stop our benchmark process if it still runs (we were interrupted): SIGTERM,
    which the benchmarks turn into their clean-up, then a kill if it hangs."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def summary(rows: list[dict], results_dir: Path, quick: bool) -> str:
    prefix = "quick-" if quick else ""
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    lines = [f"# Benchmark results ({date})", ""]
    for r in rows:
        lines += [f"## {r['name']}", "", f"`{r['command']}`: {r['status']}, "
                  f"{r['seconds']:.0f} s", ""]
        md = results_dir / f"{prefix}{r['name']}.md"
        if r["status"] == "ok" and md.exists():
            lines += [md.read_text().strip(), ""]
        elif r["status"] == "ok":
            table = [line for line in r["output"].splitlines() if not line.startswith("wrote ")]
            lines += ["```", *table, "```", ""]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks.run_all", description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(BENCHMARKS),
                   help=f"comma list of {', '.join(BENCHMARKS)}")
    p.add_argument("--quick", action="store_true", help="smoke-test sizes, quick-* results")
    p.add_argument("--no-mlflow", dest="mlflow", action="store_false",
                   help="do not log the contenders' runs to MLflow")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen benchmarks; 0 if all ran (a skipped bandwidth counts as ran),
    1 if one failed. A bad ``--only`` exits 2 (argparse), naming the allowed ones."""
    args = parser().parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown or not names:
        parser().error(f"--only: unknown {', '.join(unknown) or '(empty)'}; allowed: "
                       f"{', '.join(BENCHMARKS)}")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        cmd = command(name, args.quick, args.mlflow, args.results_dir)
        shown = " ".join([".venv/bin/python", *cmd[1:]])
        print(f"== {name}: {shown}", flush=True)
        if name == "bandwidth" and os.geteuid() != 0:
            rows.append({"name": name, "command": shown, "status": "skipped (needs root)",
                         "seconds": 0.0, "output": ""})
            continue
        code, output, seconds = run_one(cmd)
        status = "ok" if code == 0 else f"failed (exit {code})"
        if code == 0 and name == "bandwidth" and "bench_bandwidth skipped" in output:
            status = "skipped"
        rows.append({"name": name, "command": shown, "status": status,
                     "seconds": seconds, "output": output})
    prefix = "quick-" if args.quick else ""
    text = summary(rows, args.results_dir, args.quick)
    (args.results_dir / f"{prefix}summary.md").write_text(text + "\n")
    (args.results_dir / f"{prefix}summary.json").write_text(json.dumps(
        [{k: v for k, v in r.items() if k != "output"} for r in rows], indent=2) + "\n")
    print(text)
    return 0 if all(not r["status"].startswith("failed") for r in rows) else 1


if __name__ == "__main__":
    stop_on_sigterm()
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("benchmarks.run_all: interrupted", file=sys.stderr)
        sys.exit(130)
