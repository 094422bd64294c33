"""``diloco bench``: the benchmarks of a source checkout, run as their own process.

The benchmarks sit above the product and are not installed with it, so the command
never imports them: it runs ``python -m benchmarks.run_all`` with the same flags,
with the checkout that holds this package on ``PYTHONPATH`` and the user's working
directory kept (relative paths and the default ``mlflow.db`` mean what they did).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from cli.console import EXIT_FAILED, EXIT_INTERRUPTED, fail

BENCHMARKS = ("codecs", "exchange", "quality", "traffic", "bandwidth", "elastic", "prepare",
              "model", "scale", "jitter")


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

    Each benchmark runs as its own process, one after the other; each writes JSON
    and Markdown, and benchmarks/results/summary.md gathers them. A full run takes
    hours on two cores; --quick checks that everything works in a few minutes."""
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
    path = [str(checkout()), *filter(None, [os.environ.get("PYTHONPATH")])]
    code = subprocess.call([sys.executable, "-m", "benchmarks.run_all", *argv],
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(path)})
    if code:
        raise typer.Exit(EXIT_INTERRUPTED if code == EXIT_INTERRUPTED else EXIT_FAILED)
