"""What a contribution that missed its round is worth: fold, decay or drop it.

    .venv/bin/python -m benchmarks.bench_late [--workers 2,4] [--steps 600] \\
        [--policies fold,decay,drop] [--late-every 2]

The quality benchmark's setup (the 0.89M reference model, 16 x 64 tokens a worker
step, streaming P 2, tau 1, H 50, int4 up / int8 down) at M workers, every party in
threads of this process. Lateness is made, not waited for: the aggregator's
benchmark hook (``hold_back``) keeps worker 1's contribution out of every
``--late-every``-th round of each fragment, so that round is reduced without it (as
after a grace window) and the contribution is settled in the next mean exactly as a
real late one is, by ``sync.membership.late``:

- ``fold``: it joins the next mean at its token weight;
- ``decay``: the same, its weight halved for each round it is late;
- ``drop``: it is dropped (the worker's tokens never reach the model).

Each policy is compared at equal tokens with the same run where nothing is late
(``on time``). The canonical model's eval loss, over the quality benchmark's 32
held-out batches. One seed: differences of a few tenths of a percent are noise.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
from pathlib import Path
from typing import Any

from benchmarks.recipe import CODECS, MODES, ensure_dataset, reference_overrides
from benchmarks.report import md_table, output_args, publish, rerendered, timed

POLICIES = ("fold", "decay", "drop")


def overrides(workers: int, steps: int, data_url: str) -> list[str]:
    names = ",".join(f"w{i}" for i in range(workers))
    return [*reference_overrides(steps, data_url), *MODES["streaming"], *CODECS["int4"],
            "sync.schedule.sync_every=50", f"workers=[{names}]", "sync.membership.grace_s=0"]


def train(url: str, cfg_overrides: list[str], late_every: int | None) -> dict[str, Any]:
    """Train one run to the end; the aggregator holds back worker 1's contribution in
    every ``late_every``-th round (None: never)."""
    from benchmarks.contenders import canonical_eval  # noqa: PLC0415
    from diloco.aggregator import Aggregator  # noqa: PLC0415
    from diloco.run import open_run  # noqa: PLC0415
    from workers.config import load_config  # noqa: PLC0415
    from workers.loop import WorkerLoop  # noqa: PLC0415
    from workers.runs import create_run  # noqa: PLC0415

    cfg = load_config("tiny", cfg_overrides)
    create_run(cfg, url)
    late_one = cfg.workers[1]

    def hold_back(p: int, r: int, w: str) -> bool:
        return late_every is not None and w == late_one and r % late_every == late_every - 1

    agg, stop = Aggregator(open_run(url), hold_back=hold_back), threading.Event()
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
    return {"eval_loss": canonical_eval(url, cfg), "late": agg.stats.late,
            "dropped": agg.stats.dropped, "rounds": len(agg.stats.rounds)}


def markdown(report: dict[str, Any]) -> str:
    rows = []
    for m, runs in report["by_workers"].items():
        base = runs["on time"]["eval_loss"]
        for name, r in runs.items():
            delta = "" if name == "on time" else f"{100 * (r['eval_loss'] / base - 1):+.2f}%"
            rows.append([m, name, f"{r['eval_loss']:.4f}", delta, r["late"], r["dropped"]])
    return ("## A late contribution: fold, decay or drop (canonical eval loss)\n\n"
            + md_table(["M", "policy", "eval loss", "vs on time", "late applied", "dropped"],
                       rows)
            + f"\n\nWorker 1's contribution held back in one round of every "
            f"{report['late_every']} of each fragment; {report['steps']} steps, one seed.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="2,4")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--late-every", type=int, default=2)
    output_args(p, "late")
    args = p.parse_args(argv)
    if rerendered(args, markdown):
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench-late-"))
    data_url = ensure_dataset(work)

    def measure() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for m in [int(x) for x in args.workers.split(",")]:
            base = overrides(m, args.steps, data_url)
            runs = {"on time": train(str(work / f"m{m}-on-time"), base, None)}
            for policy in [x for x in args.policies.split(",") if x]:
                runs[policy] = train(str(work / f"m{m}-{policy}"),
                                     [*base, f"sync.membership.late={policy}"], args.late_every)
                print(f"M {m} {policy}: {runs[policy]}", flush=True)
            out[str(m)] = runs
        return out

    by_workers, seconds = timed(measure)
    publish(args.out, {"by_workers": by_workers, "steps": args.steps,
                       "late_every": args.late_every, "wall_seconds": seconds},
            markdown, args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
