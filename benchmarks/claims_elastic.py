"""Claim C3's runs: a worker dropping at a third and one joining at a half, against
the fault-free run of the same seed, through bench_elastic's parties.

bench_elastic has the two faults as separate scenarios, each at seed 0; the claim
asks for both in one run and for seeds. This module drives the same processes
(``bench_elastic.Proc``: its worker command, the aggregator as ``python -m workers
--aggregate``) with bench_elastic's recipe at ``train.seed`` = the seed, and
measures the same way (``bench_elastic.measure``: applied tokens, the audit, the
canonical model's eval loss; the fault-free run's canonical checkpoints evaluated
and interpolated at the faulty run's applied tokens).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks import bench_elastic as be


def options(argv: list[str]) -> argparse.Namespace:
    """bench_elastic's options (``argv`` as its command line takes them)."""
    return be.parser().parse_args(argv)


def recipe(args: argparse.Namespace, data_url: str, seed: int) -> list[str]:
    """bench_elastic's overrides at ``seed`` (model init and data order)."""
    return [f"train.seed={seed}" if o == "train.seed=0" else o
            for o in be.overrides(args, data_url)]


def scenario(name: str, args: argparse.Namespace, data_url: str, wd: Path,
             seed: int) -> dict[str, Any]:
    """``fault-free`` or ``drop-join`` (w3 SIGKILLed when w0 is a third of the way in,
    never back; w4 joins when w0 is halfway); bench_elastic's measures."""
    from workers.config import load_config  # noqa: PLC0415
    from workers.runs import create_run  # noqa: PLC0415

    be.STEP_S[0] = args.step_s
    url = str(wd / f"{name}-s{seed}")
    create_run(load_config("tiny", recipe(args, data_url, seed)), url)
    logs = wd / f"{name}-s{seed}.log"
    agg = be.Proc("aggregator", [be.sys.executable, "-m", "workers", "--run", url,
                                 "--aggregate", "--log-level", "WARNING"], logs)
    procs = [be.Proc(w, be._worker_cmd(url, w, wait_go=True), logs, wait_go=True)
             for w in (*be.FAST, be.FAULTED)]
    everyone = [agg, *procs]
    events: list[dict[str, Any]] = []
    steps = args.steps
    try:
        deadline = time.monotonic() + args.timeout
        while not (all(p.ready.is_set() for p in procs)
                   and Path(url, "members", "aggregator.json").exists()):
            if time.monotonic() > deadline or any(p.proc.poll() is not None for p in everyone):
                raise RuntimeError(f"C3 {name}: a party did not start; see {logs}")
            time.sleep(0.1)
        t0 = time.time()
        for p in procs:
            p.go()
        joiner = None
        if name == "drop-join":
            joiner = be.Proc(be.JOINER, be._worker_cmd(url, be.JOINER, join=True, preload=True),
                             logs, wait_go=True)
            everyone.append(joiner)
        dropped = joined = False
        while any(p.proc.poll() is None for p in everyone):
            if time.monotonic() > deadline:
                raise TimeoutError(f"C3 {name}: not finished after {args.timeout:.0f} s")
            lead = procs[0].step
            if joiner is not None and not dropped and lead >= steps // 3:
                procs[3].kill()
                dropped = True
                events.append({"event": "kill", "worker": be.FAULTED, "lead_step": lead})
            if joiner is not None and not joined and lead >= steps // 2:
                joiner.go()
                procs.append(joiner)
                joined = True
                events.append({"event": "join", "worker": be.JOINER, "lead_step": lead})
            be._check(everyone, f"C3 {name}", logs)
            time.sleep(0.2)
        be._check(everyone, f"C3 {name}", logs)
    finally:
        for p in everyone:
            p.stop()
    return be.measure(name, url, t0, procs, events)


def pair(argv: list[str], data_url: str, wd: Path, seed: int) -> dict[str, Any]:
    """One seed of C3: the fault-free run and the drop-and-join run; the latter's eval
    loss against the fault-free curve at its applied tokens (``eval_gap``)."""
    from diloco.run import open_run  # noqa: PLC0415

    args = options(argv)
    base = scenario("fault-free", args, data_url, wd, seed)
    ex = open_run(base["url"])
    curve = be.CanonicalEval(ex, base["url"]).curve(be.applied_tokens(ex)[0])
    faulty = scenario("drop-join", args, data_url, wd, seed)
    ref, within = be.interpolate(curve, faulty["applied_tokens"])
    audit = faulty["audit"]
    return {"eval_loss": faulty["eval_loss"], "fault_free_loss": base["eval_loss"],
            "eval_ref": ref, "eval_ref_within_curve": within,
            "eval_gap": faulty["eval_loss"] / ref - 1,
            "applied_tokens": faulty["applied_tokens"],
            "fault_free_tokens": base["applied_tokens"], "events": faulty["events"],
            "audit": audit if isinstance(audit, dict) else str(audit),
            "seconds": base["wall_s"] + faulty["wall_s"]}
