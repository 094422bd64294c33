"""A benchmark's report, and what its command does around the measuring.

Every benchmark's command logs the same way (``cli_logging``), turns SIGTERM into
a clean stop (``stop_on_sigterm``), times itself (``timed``), records where and
with what it ran (``environment``), and writes JSON and Markdown under
``benchmarks/results/`` (``publish``); ``--from-json`` re-renders a saved report
through the same ``publish``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "numpy", "zarr", "s3fs", "moto"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def mlflow_status() -> str:
    """Whether contenders' runs reach MLflow, for the report."""
    from tracking.settings import tracking_enabled  # noqa: PLC0415 - mlflow settings

    if not tracking_enabled():
        return "tracking off (DILOCO_TRACKING=off): no-op hooks"
    return "tracking.mlflow_hooks.hooks_for(run_url, role='train') per contender"


def environment(argv: Sequence[str] | None, module: str) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python", "-m", module,
                             *(argv if argv is not None else sys.argv[1:])]),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "versions": versions(),
        "mlflow": mlflow_status(),
    }


def write_report(name: str, report: dict[str, Any], markdown: str,
                 out_dir: Path | None = None) -> tuple[Path, Path]:
    """``{name}.json`` and ``{name}.md`` under ``out_dir`` (benchmarks/results)."""
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / f"{name}.json", out_dir / f"{name}.md"
    js.write_text(json.dumps(report, indent=2, default=str) + "\n")
    md.write_text(markdown.rstrip() + "\n")
    return js, md


def publish(name: str, report: dict[str, Any], markdown: Callable[[dict[str, Any]], str],
            out_dir: Path | None = None, *, saved: bool = False) -> dict[str, Any]:
    """Render ``report`` with ``markdown`` plus the benchmark's wall time, write
    ``{name}.json`` and ``{name}.md``, and print the Markdown. ``saved``: the
    report was read back from a JSON file (``--from-json``), only re-rendered."""
    md = markdown(report) + \
        f"\n\nWall time of the whole benchmark: {report['wall_seconds']:.0f} s.\n"
    js, mdp = write_report(name, report, md, out_dir)
    print(md)
    if not saved:
        print(f"wrote {js} and {mdp}")
    return report


def md_table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; numbers right-aligned."""
    def cell(x: Any) -> str:
        return "" if x is None else str(x)

    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


# -- the command around it -----------------------------------------------------------


def cli_logging(*noisy: str) -> None:
    """The benchmarks' command-line logging: INFO, minus the chatty libraries."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in ("workers", "diloco", "storage", *noisy):
        logging.getLogger(name).setLevel(logging.WARNING)


def stop_on_sigterm() -> None:
    """Turn SIGTERM into KeyboardInterrupt in the main thread, so that a killed
    benchmark runs its ``finally`` blocks: stops its worker processes and servers and
    removes its namespaces."""
    import signal  # noqa: PLC0415

    def handler(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def output_args(p: argparse.ArgumentParser, out: str, mlflow_help: str | None = None) -> None:
    """The options every benchmark shares: where results go, re-rendering a saved
    result, and leaving MLflow out."""
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--out", default=out, help="results/<out>.json and .md")
    p.add_argument("--from-json", type=Path, default=None,
                   help="only render the Markdown of a saved result")
    p.add_argument("--no-mlflow", dest="mlflow", action="store_false", help=mlflow_help)


def rerendered(args: argparse.Namespace,
               markdown: Callable[[dict[str, Any]], str]) -> dict[str, Any] | None:
    """With ``--from-json``: the saved report, rendered and written again; else None."""
    if not args.from_json:
        return None
    return publish(args.out, json.loads(args.from_json.read_text()), markdown,
                   args.results_dir, saved=True)
