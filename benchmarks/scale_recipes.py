"""`diloco bench scale` per model size: a short real run of a shipped recipe on this
machine, with every stage of its rounds timed and every party's peak RSS.

    .venv/bin/python -m benchmarks.scale_recipes small [--stride 3] [--seq-len 64] \\
        [--batch-size 4] [--set key=value ...]

prints the row as JSON on its last line (``benchmarks.bench_scale --sizes`` runs it,
one process per size, so that the aggregator's peak RSS is this process's).

**The run.** The recipe (``small``, or ``gpu-150m`` for size ``150m``) with M = 2
workers (``w0``, ``w1``), its own P, on the CPU with one torch thread per worker,
on local disk (``file://``), the byte-level Shakespeare dataset
(``benchmarks.recipe.ensure_dataset``; gpu-150m's 32k vocabulary holds the 256 byte
ids), and these changes, which the table states: ``sync.schedule.overlap=auto`` and
``sync.schedule.mode=streaming`` (auto needs it; gpu-150m's recipe is eager),
``sync.schedule.sync_every = P * stride`` and ``train.steps = H + stride``, so that fragment 0
completes two scheduled rounds and every fragment a final one (the drain);
``sync.membership.quorum=1.0`` (every round waits for both workers, as on a quiet machine);
a smaller ``data.seq_len`` and ``data.batch_size`` (a CPU step of the recipe's
batch takes too long here), ``optim.grad_accum=1``; no evaluation until the end
(one batch) and no periodic checkpoints.

Each worker is a ``benchmarks.timed_worker`` process (``benchmarks.contenders.
run_processes``), the aggregator a thread of this process; both time their stages
with ``benchmarks.stages``. Per worker: the inner step's compute seconds, its blocked
time (``timed_worker``: the calls that talk to the store) outside the final drain,
and of that the wait for means; ``send`` (the outer gradient of a fragment) and
``merge`` run on the training loop, the other stages beside it. Peak RSS: ``VmHWM`` of each worker process, and of
this process from just before the workers start (the aggregator's, with this
process's own base beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Size:
    """A size's shipped recipe and the CPU batch it runs with here."""

    recipe: str
    seq_len: int
    batch_size: int


SIZES = {"small": Size("small", seq_len=64, batch_size=4),
         "150m": Size("gpu-150m", seq_len=128, batch_size=2)}
WORKER_STAGES = ("encode", "upload", "fetch_download", "fetch_decode", "send", "merge")
#: the worker's own stages, on its training loop: never hidden by the overlap
ON_LOOP = ("send", "merge")
AGGREGATOR_STAGES = ("download", "decode", "reduce", "mean_encode", "mean_upload")


def overrides(size: str, stride: int, seq_len: int, batch_size: int, data_url: str,
              extra: list[str]) -> tuple[list[str], int]:
    """The ``--set`` list of the run (see the module docstring) and its H."""
    from workers.config import load_config  # noqa: PLC0415

    p = load_config(SIZES[size].recipe).sync.schedule.fragments
    h = p * stride
    return ["workers=[w0, w1]", f"name=bench-scale-{size}", f"train.steps={h + stride}",
            "train.eval_every=0", "train.eval_batches=1", "train.checkpoint_every=0",
            "train.threads=1", "train.device=cpu", f"data.dataset={data_url}",
            "data.tokenizer=byte", "data.split=even", f"data.seq_len={seq_len}",
            f"data.batch_size={batch_size}", "optim.grad_accum=1", "sync.schedule.mode=streaming",
            "sync.schedule.overlap=auto", f"sync.schedule.sync_every={h}", "sync.membership.quorum=1.0", *extra], h


def per_round(stages: dict[str, dict[str, float]], names: tuple[str, ...],
              rounds: int | None = None) -> dict[str, float]:
    """Seconds per round of each stage, drain included: total / calls, or / ``rounds``
    (the aggregator reads M contributions a round)."""
    out = {}
    for name in names:
        got = [stages[k] for k in (name, f"drain:{name}") if k in stages]
        calls = rounds or sum(int(g["calls"]) for g in got)
        if got and calls:
            out[name] = round(sum(g["seconds"] for g in got) / calls, 4)
    return out


def worker_row(result: dict[str, Any], float32_bytes: int) -> dict[str, Any]:
    """One worker's measurements: step time, blocked time outside the drain, RSS."""
    t, st = result["timing"], result["stages"]
    steady_loop = t["loop_s"] - t["drain_s"]
    blocked = t["blocked_s"] - t["drain_s"]
    merges = int(st.get("merge", {}).get("calls", 0))
    wait = st.get("wait", {}).get("seconds", 0.0)
    mem = result["memory"]
    return {
        "worker": result["worker"], "steps": int(result["steps"]),
        "step_s": round(t["compute_s"] / int(result["steps"]), 4),
        "steady_loop_s": round(steady_loop, 3), "merges": merges,
        "blocked_s": round(blocked, 3), "wait_s": round(wait, 3), "drain_s": round(t["drain_s"], 3),
        "blocked_per_round_s": round(blocked / merges, 3) if merges else None,
        "wait_per_round_s": round(wait / merges, 3) if merges else None,
        "blocked_share": round(blocked / steady_loop, 4) if steady_loop > 0 else None,
        "wait_share": round(wait / steady_loop, 4) if steady_loop > 0 else None,
        "peak_rss_mib": round(mem["peak_rss"] / 2**20), "base_rss_mib": round(mem["base_rss"] / 2**20),
        "peak_over_float32_x": round(mem["peak_rss"] / float32_bytes, 2),
        "rss_target_met": mem["peak_rss"] <= 5 * float32_bytes,  # 3x + AdamW's 2x
        "stages": per_round(st, WORKER_STAGES),
    }


def run(size: str, stride: int, seq_len: int, batch_size: int, extra: list[str]
        ) -> dict[str, Any]:
    """Train the size's recipe for H + stride steps with M = 2 (module docstring)."""
    from benchmarks import stages  # noqa: PLC0415
    from benchmarks.contenders import Contender, Workdir, run_processes  # noqa: PLC0415
    from benchmarks.recipe import ensure_dataset  # noqa: PLC0415
    from benchmarks.rss import reset_peak, status  # noqa: PLC0415
    from workers.config import load_config  # noqa: PLC0415
    from workers.runs import create_run  # noqa: PLC0415

    sets, h = overrides(size, stride, seq_len, batch_size, ensure_dataset(), extra)
    cfg = load_config(SIZES[size].recipe, sets)
    n = cfg.model_config_resolved.num_parameters()
    clock = stages.install()  # the aggregator's stages (a thread of this process)
    os.environ[stages.ENV] = "1"  # and the workers' (timed_worker reads it)
    with Workdir("bench-scale") as work:
        run_url = (work / f"{size}").as_uri()
        create_run(cfg, run_url)
        base = reset_peak()
        results, agg, wall = run_processes(
            Contender("streaming-auto", "int4", workers=2, sync_every=h), cfg, run_url,
            log_dir=work)
        peak = status("VmHWM")
    agg_stages = clock.report()
    rounds = int(agg_stages.get("mean_upload", {}).get("calls", 0))
    workers = [worker_row(r, 4 * n) for r in results]
    stage_s: dict[str, float] = {}
    for w in workers:  # the slower worker's, as in the exchange round
        for k, v in w["stages"].items():
            stage_s[k] = max(stage_s.get(k, 0.0), v)
    stage_s.update(per_round(agg_stages, AGGREGATOR_STAGES[:2], rounds))
    stage_s.update(per_round(agg_stages, AGGREGATOR_STAGES[2:]))
    latency = sum(v for k, v in stage_s.items() if k not in ON_LOOP)
    return {
        "size": size, "recipe": SIZES[size].recipe, "params": n, "workers": len(results),
        "fragments": cfg.sync.schedule.fragments, "sync_every": h, "steps": cfg.train.steps,
        "recipe_sync_every": load_config(SIZES[size].recipe).sync.schedule.sync_every,
        "seq_len": cfg.data.seq_len, "batch_size": cfg.data.batch_size,
        "up": cfg.sync.codec.up, "down": cfg.sync.codec.down,
        "overrides": sets, "wall_s": round(wall, 1), "aggregator_rounds": rounds,
        "completed": bool(agg is not None and agg.done and rounds >= 2),
        "stages_s": {k: round(v, 4) for k, v in stage_s.items()},
        "latency_s": round(latency, 3), "per_worker": workers,
        "aggregator_rss": {"peak_rss_mib": round(peak / 2**20), "base_rss_mib": round(base / 2**20),
                           "peak_over_float32_x": round(peak / (4 * n), 2),
                           "growth_over_float32_x": round((peak - base) / (4 * n), 2)},
        "load_average": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale_recipes",
                                description=__doc__.splitlines()[0])
    p.add_argument("size", choices=sorted(SIZES))
    p.add_argument("--stride", type=int, default=3, help="H/P of the run: H = P * stride")
    p.add_argument("--seq-len", type=int, default=None, help="default: per size")
    p.add_argument("--batch-size", type=int, default=None, help="default: per size")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="more overrides of the recipe (e.g. a smaller model for a test)")
    args = p.parse_args(argv)
    if args.stride < 2:
        raise SystemExit(f"--stride must be >= 2 (overlap auto starts at tau = stride - 1 "
                         f">= 1), got {args.stride}")
    size = SIZES[args.size]
    row = run(args.size, args.stride, args.seq_len or size.seq_len,
              args.batch_size or size.batch_size, args.set)
    print(json.dumps(row), flush=True)
    return 0


def child(size: str, argv: list[str]) -> dict[str, Any]:
    """Run ``main`` for ``size`` in a fresh process; its row."""
    import subprocess  # noqa: PLC0415

    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.scale_recipes", size, *argv],
                              stdout=subprocess.PIPE, stderr=err, text=True,
                              cwd=Path(__file__).resolve().parent.parent)
        if proc.returncode:
            err.seek(0)
            tail = "".join(err.readlines()[-15:])
            raise RuntimeError(f"bench scale size {size} failed ({proc.returncode}):\n{tail}")
    return json.loads(proc.stdout.splitlines()[-1])


if __name__ == "__main__":
    raise SystemExit(main())
