"""Same inputs, same model: a short default run, repeated, on an idle machine and on
one a CPU hog loads.

    .venv/bin/python -m benchmarks.bench_jitter [--repeats 5] [--steps 60] [--hogs 2]

The default recipe (tiny: two workers, streaming P 2, H 30, int4 up / int8 down) at
``train.steps`` ``--steps``, every party a real process on a local directory store
(``python -m workers --aggregate`` and one ``--worker`` each), at the default quorum
(0.5, adaptive grace) and at ``quorum: 1.0`` (every round waits for everyone), each
``--repeats`` times idle and as many times beside ``--hogs`` busy-looping processes.
Per group: how many distinct canonical models the repeats made (a SHA-256 of every
fragment's canonical parameters: one means the model did not depend on timing), the
spread of the canonical eval loss, contributions applied late or dropped (from the
store: `diloco.audit`), and the mean wall time, the default's against quorum 1.0 in
the same condition. The target: one model across all of them, and the default within
3% of quorum 1.0's wall time.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import ROOT, md_table, output_args, publish, rerendered, timed

GROUPS = (("default", "idle"), ("quorum 1.0", "idle"), ("default", "hog"),
          ("quorum 1.0", "hog"))


def _spin() -> None:  # a CPU hog: one core's worth of busy loop
    while True:
        pass


def run_once(url: str, steps: int, strict: bool) -> dict[str, Any]:
    """Create and train one run with real job processes; its wall time and outcome."""
    py = [sys.executable, "-m", "workers", "--run", url, "--log-level", "WARNING"]
    sets = [f"train.steps={steps}", "train.eval_every=0", "train.log_model=false"]
    if strict:
        sets.append("sync.membership.quorum=1.0")
    subprocess.run([*py, "--create", "--config", "tiny",
                    *[x for s in sets for x in ("--set", s)]],
                   check=True, cwd=ROOT, capture_output=True)
    t0 = time.perf_counter()
    jobs = [subprocess.Popen([*py, "--aggregate"], cwd=ROOT, stdout=subprocess.DEVNULL),
            *(subprocess.Popen([*py, "--worker", w], cwd=ROOT, stdout=subprocess.DEVNULL)
              for w in ("region-a", "region-b"))]
    codes = [j.wait(timeout=3600) for j in jobs]
    wall = time.perf_counter() - t0
    if any(codes):
        raise RuntimeError(f"{url}: a job failed (exit codes {codes})")
    return {"wall_s": wall, **outcome(url)}


def outcome(url: str) -> dict[str, Any]:
    from benchmarks.contenders import canonical_eval  # noqa: PLC0415
    from diloco.audit import audit  # noqa: PLC0415
    from diloco.run import load_canonical, open_run, plan_for  # noqa: PLC0415
    from workers.config import RunConfig  # noqa: PLC0415
    from workers.model import build_model  # noqa: PLC0415

    ex = open_run(url)
    cfg = RunConfig.stored(ex.manifest.config)
    model = build_model(cfg.model_config_resolved, seed=cfg.train.seed)
    load_canonical(ex, plan_for(model, cfg.sync), model)
    digest = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        digest.update(name.encode() + p.detach().contiguous().numpy().tobytes())
    report = audit(ex)
    return {"hash": digest.hexdigest()[:16], "eval_loss": canonical_eval(url, cfg),
            "late": report["applied_late"], "dropped": report["dropped_stale"]}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    losses = [r["eval_loss"] for r in runs]
    return {"repeats": len(runs), "models": len({r["hash"] for r in runs}),
            "hashes": sorted({r["hash"] for r in runs}),
            "eval_loss_min": min(losses), "eval_loss_max": max(losses),
            "late": sum(r["late"] for r in runs), "dropped": sum(r["dropped"] for r in runs),
            "wall_s": statistics.mean(r["wall_s"] for r in runs)}


def markdown(report: dict[str, Any]) -> str:
    g = report["groups"]
    rows = []
    for key, s in g.items():
        quorum, condition = key.split(" / ")
        strict = g.get(f"quorum 1.0 / {condition}")
        rel = (f"{100 * (s['wall_s'] / strict['wall_s'] - 1):+.1f}%"
               if strict and quorum == "default" else "")
        rows.append([quorum, condition, s["repeats"], s["models"],
                     f"{s['eval_loss_min']:.4f} .. {s['eval_loss_max']:.4f}",
                     f"{s['late']} / {s['dropped']}", f"{s['wall_s']:.1f}", rel])
    every = {h for s in g.values() for h in s["hashes"]}
    return ("## Same inputs, same model: repeats of a default run\n\n"
            + md_table(["quorum", "machine", "repeats", "distinct models", "eval loss",
                        "late / dropped", "wall s", "vs quorum 1.0"], rows)
            + f"\n\nDistinct canonical models over every run: {len(every)}. "
            f"{report['steps']} steps of the tiny recipe; hog: {report['hogs']} busy loops.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--hogs", type=int, default=2)
    output_args(p, "jitter")
    args = p.parse_args(argv)
    if rerendered(args, markdown):
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench-jitter-"))

    def measure() -> dict[str, Any]:
        groups: dict[str, list[dict[str, Any]]] = {}
        for i in range(args.repeats):  # interleaved: drift of the machine hits all alike
            for quorum, condition in GROUPS:
                hogs = []
                if condition == "hog":
                    hogs = [multiprocessing.Process(target=_spin, daemon=True)
                            for _ in range(args.hogs)]
                    for h in hogs:
                        h.start()
                try:
                    url = str(work / f"{quorum.replace(' ', '')}-{condition}-{i}")
                    got = run_once(url, args.steps, quorum != "default")
                finally:
                    for h in hogs:
                        h.terminate()
                groups.setdefault(f"{quorum} / {condition}", []).append(got)
                print(f"{quorum} / {condition} #{i}: {got}", flush=True)
        return {k: summary(v) for k, v in groups.items()} | {"_runs": groups}

    measured, seconds = timed(measure)
    runs = measured.pop("_runs")
    publish(args.out, {"groups": measured, "runs": runs, "steps": args.steps,
                       "hogs": args.hogs, "wall_seconds": seconds}, markdown,
            args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
