"""How large honest outer gradients are: what the norm guard's factors are chosen from.

    .venv/bin/python -m benchmarks.delta_norms [--setups tiny,reference,micro] [--work DIR]
    .venv/bin/python -m benchmarks.delta_norms --runs URL [URL ...]   # runs you have

Trains each setup (every worker and the aggregator in threads of this process,
``quorum: 1.0``, so every contribution is on time and honest) or reads finished runs,
and reports per run, over every (fragment, round): the largest and median accepted
contribution's norm over the norm of its fragment's initial parameters (what
``sync.guard.params_ratio`` multiplies) and the largest spread inside one mean
(largest over smallest norm: what ``sync.guard.ratio`` bounds from round 0 when a
mean has three or more). `diloco.audit.norm_ratios` computes them from the store.

Setups: ``tiny`` (the default recipe, 240 steps, streaming P 2), ``reference`` (the
quality benchmark's 0.89M model, blocking DiLoCo H 50, four workers, 300 steps) and
``micro`` (the tests' 2 x 32 model at learning rate 0.01, H 4, 64 steps).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
from pathlib import Path
from typing import Any

from benchmarks.recipe import REFERENCE_MODEL
from benchmarks.report import md_table, output_args, publish, rerendered, timed

SETUPS: dict[str, list[str]] = {
    "tiny": [],
    "reference": [f"model.overrides={REFERENCE_MODEL}", "data.seq_len=64",
                  "data.batch_size=16", "optim.lr=3e-3", "optim.warmup_steps=30",
                  "train.steps=300", "sync.schedule.mode=diloco", "sync.schedule.fragments=1",
                  "sync.schedule.overlap=0", "sync.schedule.sync_every=50", "workers=[a, b, c, d]"],
    "micro": ["model.overrides={d_model: 32, n_layers: 2, n_heads: 2, max_seq_len: 64}",
              "data.seq_len=16", "data.batch_size=4", "optim.warmup_steps=2",
              "optim.lr=0.01", "sync.schedule.sync_every=4", "sync.schedule.fragments=2", "sync.schedule.overlap=1",
              "train.steps=64"],
}
COMMON = ["sync.membership.quorum=1.0", "train.eval_every=0", "train.checkpoint_every=0",
          "train.threads=1"]


def train(setup: str, url: str) -> None:
    """One run of ``setup`` to the end, in this process."""
    from diloco.aggregator import Aggregator  # noqa: PLC0415
    from diloco.run import open_run  # noqa: PLC0415
    from workers.config import load_config  # noqa: PLC0415
    from workers.loop import WorkerLoop  # noqa: PLC0415
    from workers.runs import create_run  # noqa: PLC0415

    cfg = load_config("tiny", [*SETUPS[setup], *COMMON])
    create_run(cfg, url)
    agg, stop = Aggregator(open_run(url)), threading.Event()
    agg_thread = threading.Thread(target=agg.run, args=(stop, 7200), daemon=True)
    agg_thread.start()
    loops = [WorkerLoop.open(url, w) for w in cfg.workers]
    threads = [threading.Thread(target=loop.run) for loop in loops]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    agg_thread.join(600)
    stop.set()
    for loop in loops:
        loop.close()


def summarise(name: str, url: str) -> dict[str, Any]:
    from diloco.audit import norm_ratios  # noqa: PLC0415
    from diloco.run import open_run  # noqa: PLC0415

    rows = norm_ratios(open_run(url))
    return {"run": name, "url": url, "means": len(rows),
            "max_over_params": max(r["max_over_params"] for r in rows),
            "median_over_params": sorted(r["median_over_params"] for r in rows)[len(rows) // 2],
            "max_spread": max(r["spread"] for r in rows), "rounds": rows}


def markdown(report: dict[str, Any]) -> str:
    rows = [[r["run"], r["means"], f"{r['max_over_params']:.3f}",
             f"{r['median_over_params']:.3f}", f"{r['max_spread']:.2f}"] for r in report["runs"]]
    return ("## Honest outer gradients against the norm guard\n\n"
            + md_table(["run", "means", "largest norm / initial params",
                        "median norm / initial params", "largest spread in a mean"], rows)
            + f"\n\nDefaults: norm_guard_params {report['norm_guard_params']:g}, "
            f"norm_guard {report['norm_guard']:g}.")


def main(argv: list[str] | None = None) -> int:
    from diloco.config import SyncConfig  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--runs", nargs="*", default=None, help="finished runs to read instead")
    p.add_argument("--work", default=None, help="where trained runs go (default: temporary)")
    output_args(p, "delta_norms")
    args = p.parse_args(argv)
    if rerendered(args, markdown):
        return 0
    work = Path(args.work or tempfile.mkdtemp(prefix="delta-norms-"))

    def measure() -> list[dict[str, Any]]:
        if args.runs:
            return [summarise(u.rstrip("/").rsplit("/", 1)[-1], u) for u in args.runs]
        out = []
        for setup in [s for s in args.setups.split(",") if s]:
            url = str(work / setup)
            train(setup, url)
            out.append(summarise(setup, url))
        return out

    runs, seconds = timed(measure)
    defaults = SyncConfig()
    publish(args.out, {"runs": runs, "wall_seconds": seconds,
                       "norm_guard_params": defaults.guard.params_ratio,
                       "norm_guard": defaults.guard.ratio}, markdown, args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
