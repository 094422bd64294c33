"""``diloco bench``: the benchmarks of a source checkout, run as their own process.

The benchmarks sit above the product and are not installed with it, so the command
never imports them: it runs ``python -m benchmarks.run_all`` with the same flags
(``diloco bench claims``: ``python -m benchmarks.bench_claims``, which has options of
its own), with the checkout that holds this package on ``PYTHONPATH`` and the user's
working directory kept (relative paths and the default ``mlflow.db`` mean what they
did).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from cli.console import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, fail

BENCHMARKS = ("codecs", "exchange", "quality", "traffic", "bandwidth", "elastic", "prepare",
              "model", "scale", "jitter")
# benchmarks/claims_plan.py's CLAIMS and PROFILES (checked equal by a test): the
# command refuses a bad name before starting anything
CLAIMS = ("C1", "C2", "C3", "C4", "C5", "C6", "C7", "C8", "C9")
CLAIM_PROFILES = ("quick", "full")


def checkout() -> Path:
    """The checkout holding benchmarks/ (it is not part of the installed package)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "run_all.py").exists():
        raise fail("diloco bench runs from a source checkout: benchmarks/ was not found "
                   f"beside {Path(__file__).resolve().parent}")
    return root


def bench(
    names: Annotated[list[str] | None, typer.Argument(
        help="benchmarks to run, e.g. `diloco bench elastic` (same as --only)",
        show_default=False)] = None,
    only: Annotated[str, typer.Option(
        help=f"comma list of: {', '.join(BENCHMARKS)}")] = ",".join(BENCHMARKS),
    quick: Annotated[bool, typer.Option(
        "--quick", help="smoke-test sizes; writes quick-* results, leaves the real ones")] = False,
    mlflow: Annotated[bool, typer.Option(
        "--mlflow/--no-mlflow", help="log the contenders' runs to MLflow")] = True,
    results_dir: Annotated[Path | None, typer.Option(
        help="where the JSON and Markdown go (default benchmarks/results)")] = None,
    claims: Annotated[str | None, typer.Option(
        help=f"`diloco bench claims`: comma list of {', '.join(CLAIMS)} (default all)",
        show_default=False)] = None,
    profile: Annotated[str | None, typer.Option(
        help=f"`diloco bench claims`: {' or '.join(CLAIM_PROFILES)} (default full; "
        "--quick means quick)", show_default=False)] = None,
    seeds: Annotated[str | None, typer.Option(
        help="`diloco bench claims`: comma list of seeds (default the profile's: 0,1,2)",
        show_default=False)] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="`diloco bench claims`: skip the runs already in the results")] = False,
    plan: Annotated[bool, typer.Option(
        "--plan", help="`diloco bench claims`: print the runs and the budget, run nothing")
    ] = False,
) -> None:
    """Measure against data-parallel: codecs, exchange latency, quality at equal
    tokens, traffic, compute utilisation under capped bandwidth (root), and elastic
    membership under faults (`diloco bench elastic`: workers killed, slow, joining), and
    dataset preparation of a 1 GB text corpus (`diloco bench prepare`: MB/s, peak RSS),
    and our model class against transformers' (`diloco bench model`: ms per step), and
    the exchange at scale per model size (`diloco bench scale`: short real runs of the
    small and gpu-150m recipes with every stage of a round timed, the blocked share of
    a round and peak RSS per party; a 1B model's fragment round on local disk and S3;
    the sharded aggregator's throughput), and whether repeats of a default run give
    one model on an idle and a loaded machine (`diloco bench jitter`).

    `diloco bench claims` checks the papers' claims (C1..C9, docs/claims.md) with
    seeds and gives each a verdict: `--claims C4,C5`, `--profile quick|full`,
    `--seeds 0,1,2`, `--resume`; `--plan` prints the runs and the budget.

    Each benchmark runs as its own process, one after the other; each writes JSON
    and Markdown, and benchmarks/results/summary.md gathers them. A full run takes
    hours on two cores; --quick checks that everything works in a few minutes."""
    claim_options = {"--claims": claims, "--profile": profile, "--seeds": seeds,
                     "--resume": resume or None, "--plan": plan or None}
    if names and names[0] == "claims":
        if len(names) > 1:
            raise fail(f"diloco bench claims: unexpected {' '.join(names[1:])}; choose the "
                       "claims with --claims, e.g. --claims C4,C5")
        argv = claims_argv(claims, "quick" if quick and profile is None else profile, seeds,
                           resume, plan, mlflow, results_dir)
        _run("benchmarks.bench_claims", argv)
        return
    given = [k for k, v in claim_options.items() if v is not None]
    if given:
        raise fail(f"{given[0]}: only with `diloco bench claims`")
    if names:
        only = ",".join(names)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown or not names:
        raise fail(f"--only: unknown {', '.join(unknown) or '(empty)'}; allowed: "
                   f"{', '.join(BENCHMARKS)}")
    argv = ["--only", ",".join(names)]
    if quick:
        argv.append("--quick")
    if not mlflow:
        argv.append("--no-mlflow")
    if results_dir is not None:
        argv += ["--results-dir", str(results_dir)]
    _run("benchmarks.run_all", argv)


def claims_argv(claims: str | None, profile: str | None, seeds: str | None, resume: bool,
                plan: bool, mlflow: bool, results_dir: Path | None) -> list[str]:
    """``benchmarks.bench_claims``'s arguments; a bad claim or profile is refused here,
    naming the option and the allowed values (the seeds are checked there)."""
    argv: list[str] = []
    if claims is not None:
        ids = [c.strip().upper() for c in claims.split(",") if c.strip()]
        unknown = [c for c in ids if c not in CLAIMS]
        if unknown or not ids:
            raise fail(f"--claims: unknown {', '.join(unknown) or '(empty)'}; allowed: "
                       f"{', '.join(CLAIMS)}")
        argv += ["--claims", ",".join(ids)]
    if profile is not None:
        if profile not in CLAIM_PROFILES:
            raise fail(f"--profile: unknown {profile!r}; allowed: {', '.join(CLAIM_PROFILES)}")
        argv += ["--profile", profile]
    if seeds is not None:
        argv += ["--seeds", seeds]
    argv += ["--resume"] if resume else []
    argv += ["--plan"] if plan else []
    argv += [] if mlflow else ["--no-mlflow"]
    if results_dir is not None:
        argv += ["--results-dir", str(results_dir)]
    return argv


def _run(module: str, argv: list[str]) -> None:
    """``python -m module argv`` with the checkout on PYTHONPATH; its exit status
    as ours (2, a usage error, stays 2)."""
    path = [str(checkout()), *filter(None, [os.environ.get("PYTHONPATH")])]
    code = subprocess.call([sys.executable, "-m", module, *argv],
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(path)})
    if code:
        raise typer.Exit(code if code in (EXIT_INTERRUPTED, EXIT_USAGE) else EXIT_FAILED)
