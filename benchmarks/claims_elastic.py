"""Claim C3's runs: a worker dropping at a third and one joining at a half, against
the fault-free run of the same seed: bench_elastic's ``drop-join`` and ``fault-free``
scenarios at ``--seed`` = the seed (its processes, recipe and measures: applied
tokens, the audit, the canonical model's eval loss; the fault-free run's canonical
checkpoints evaluated and interpolated at the faulty run's applied tokens).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks import bench_elastic as be


def options(argv: list[str]) -> argparse.Namespace:
    """bench_elastic's options (``argv`` as its command line takes them)."""
    return be.parser().parse_args(argv)


def scenario(name: str, args: argparse.Namespace, data_url: str, wd: Path,
             seed: int) -> dict[str, Any]:
    """bench_elastic's scenario ``name`` (``fault-free`` or ``drop-join``) at ``seed``."""
    be.STEP_S[0] = args.step_s
    return be.run_scenario(name, argparse.Namespace(**{**vars(args), "seed": seed}),
                           data_url, wd)


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
