#!/usr/bin/env python
"""Check one recipe end to end on this machine's accelerator before a real run.

Creates a run in a local store (a temporary directory unless --dir), trains its
workers for --steps inner steps in this process with the aggregator beside them,
and reports what a GPU run needs to be worth it: inner steps per second, the
exchange wait per merged round, and peak device memory (torch.cuda.max_memory_allocated;
peak RSS of this process on the CPU). Exits 1 if a worker fails, a loss is not
finite, no round was merged, the aggregator did not finish, or --device cuda has no
CUDA device; 2 on a bad argument or recipe field.

    python scripts/gpu_check.py                       # gpu-150m, 50 steps, cuda
    python scripts/gpu_check.py --recipe gpu-1b --steps 30 --dataset s3://.../c4-32k
    python scripts/gpu_check.py --device cpu --recipe small --steps 20   # here, no GPU
    python scripts/gpu_check.py --all --out DIR      # the whole prepared check (benchmarks/gpu.py)

Without --dataset the check trains on the built-in Shakespeare bytes (the model's
vocabulary may be larger than the data's). When --steps is shorter than two rounds of
the recipe, sync.schedule.sync_every is shortened (a multiple of sync.schedule.fragments, overlap kept
below a fragment's stride) so that the exchange is exercised; --set key=value
overrides anything (as `diloco run` does).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, from a checkout

from diloco.aggregator import Aggregator
from diloco.run import open_run
from workers.config import ConfigError, load_config
from workers.data.prepare import prepare_data
from workers.loop import WorkerLoop
from workers.runs import create_run


def arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="gpu-150m")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--workers", type=int, default=1, help="workers trained side by side")
    ap.add_argument("--dataset", help="a prepared dataset URL; default: built-in Shakespeare")
    ap.add_argument("--dir", help="where the run's store goes; default: a temporary directory")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    return ap.parse_args(argv)


def short_rounds(cfg, steps: int) -> list[str]:
    """Overrides that make ``steps`` hold at least two rounds of every fragment."""
    s = cfg.sync.schedule
    if steps >= 2 * s.sync_every:
        return []
    stride = max(1, steps // (2 * s.fragments))
    return [f"sync.schedule.sync_every={stride * s.fragments}",
            f"sync.schedule.overlap={min(s.overlap, stride - 1)}"]


def configure(args: argparse.Namespace, root: Path):
    if args.steps < 1 or args.workers < 1:
        raise ConfigError("--steps and --workers must be at least 1")
    dataset = args.dataset
    if dataset is None:
        dataset = str(root / "data")
        prepare_data(["builtin:shakespeare"], dataset, max_bytes=2_000_000)
    base = [f"train.steps={args.steps}", f"train.device={args.device}", "train.eval_every=0",
            "train.checkpoint_every=0", f"train.log_every={max(1, args.steps // 10)}",
            "train.log_model=false", f"data.dataset={dataset}", "data.split=even",
            "workers=[" + ",".join(f"check-{i}" for i in range(args.workers)) + "]"]
    cfg = load_config(args.recipe, [*base, *args.set])
    return load_config(args.recipe, [*base, *short_rounds(cfg, args.steps), *args.set])


def train(cfg, url: str) -> tuple[list, list, bool, float]:
    """Every worker in a thread, the aggregator in another: (results, loops, done, s)."""
    agg, stop = Aggregator(open_run(url)), threading.Event()
    agg_thread = threading.Thread(target=agg.run, args=(stop, 600), daemon=True)
    agg_thread.start()
    loops = [WorkerLoop.open(url, w) for w in cfg.workers]
    results: list = [None] * len(loops)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results[i] = loops[i].run()
        except BaseException as exc:  # reported below
            errors.append(exc)

    start = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(loops))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    agg_thread.join(120)
    stop.set()
    for loop in loops:
        loop.close()
    if errors:
        raise errors[0]
    return results, loops, agg.done, seconds


def peak_memory(device: str) -> int:
    if device == "cuda":
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--all" in argv:  # the prepared check of a lent GPU machine
        from benchmarks import gpu  # noqa: PLC0415

        return gpu.main([a for a in argv if a != "--all"])
    args = arguments(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        root = Path(args.dir or tmp)
        try:
            cfg = configure(args, root)
        except (ConfigError, ValueError) as exc:
            print(f"gpu_check: {exc}", file=sys.stderr)
            return 2
        url = str(root / "run")
        create_run(cfg, url)
        results, loops, done, seconds = train(cfg, url)
    merged = [loop.sync.stats.rounds_merged for loop in loops]
    waits = [r.wait_seconds for r in results]
    report = {
        "recipe": args.recipe, "device": args.device, "steps": args.steps,
        "workers": len(results), "sync_every": cfg.sync.schedule.sync_every,
        "steps_per_s": round(args.steps / seconds, 3),
        "rounds_merged": merged,
        "wait_per_round_s": [round(w / max(1, m), 4) for w, m in zip(waits, merged, strict=True)],
        "peak_memory_bytes": peak_memory(args.device),
        "final_loss": [r.final_loss for r in results], "aggregator_done": done,
    }
    print(json.dumps(report))
    problems = [name for name, bad in [
        ("a loss is not finite", any(not math.isfinite(r.final_loss) for r in results)),
        ("no round was merged", min(merged) == 0),
        ("the aggregator did not finish", not done),
    ] if bad]
    for p in problems:
        print(f"gpu_check: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
