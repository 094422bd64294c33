"""``diloco compare``: tracked runs side by side, printed as a table.

The comparison itself (finding the runs in MLflow, the rows, CSV, Markdown, plots,
the comparison run) is `tracking.compare`; this module parses the arguments and
prints.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console, Group, RenderableType
from rich.table import Table

from cli.console import fail
from tracking import compare as comparing


def rich_table(rows: list[comparing.CompareRow], width: int = 200) -> RenderableType:
    """A row per run when that fits ``width``; else a column per run, as many runs
    side by side as fit (more tables below when they do not). A figure or a run's
    name is never cut."""
    cells = comparing.formatted(rows)
    headers = comparing.headers(rows)  # the config fields that differ included
    measure = Console(width=width)
    table = Table(title="diloco compare", header_style="bold")
    for name, header in headers.items():
        table.add_column(header, justify="left" if comparing.is_text(name) else "right",
                         no_wrap=True)
    for row in cells:
        table.add_row(*row.values())
    if _fits(measure, table):
        return table
    tables: list[Table] = []
    todo = list(cells)
    while todo:
        for n in range(len(todo), 0, -1):  # the most runs that fit (one always goes)
            part = _by_run(todo[:n], list(headers.values())[1:],
                           title="diloco compare" if not tables else None)
            if n == 1 or _fits(measure, part):
                break
        tables.append(part)
        todo = todo[n:]
    return tables[0] if len(tables) == 1 else Group(*tables)


def _by_run(cells: list[dict[str, str]], headers: list[str], title: str | None) -> Table:
    table = Table(title=title, header_style="bold", show_header=True)
    table.add_column("", style="bold", no_wrap=True)
    for row in cells:
        table.add_column(row["run"], justify="right", no_wrap=True)
    for header in headers:
        table.add_row(header, *(row[header] for row in cells))
    return table


def _fits(console: Console, table: Table) -> bool:
    """Whether ``table`` fits the console's width whole (measured unbounded)."""
    options = console.options.update_width(1 << 20)
    return console.measure(table, options=options).maximum <= console.width


def compare_command(
    specs: Annotated[list[str], typer.Argument(
        help="run ids, run names, or MLflow filter strings (quote them), e.g. "
             "\"params.sync.schedule.mode = 'eager'\"")],
    tracking_uri: Annotated[str | None, typer.Option(
        "--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else "
                               "sqlite:///./mlflow.db)")] = None,
    out: Annotated[Path, typer.Option(
        "--out", help="directory for the plots, CSV and Markdown")] = Path("compare"),
    write_csv_file: Annotated[bool, typer.Option("--csv/--no-csv", help="write compare.csv")]
    = True,
    write_md_file: Annotated[bool, typer.Option("--md/--no-md", help="write compare.md")]
    = True,
    log_run: Annotated[bool, typer.Option(
        "--log", help="record the table and plots as artifacts of a comparison run")] = False,
) -> None:
    """Compare runs: a table of eval loss, tokens, bytes exchanged by every party (and
    the reduction against data-parallel), wall time, waiting and the config fields
    that differ between the runs; overlay plots as PNG."""
    console = Console(width=None if sys.stdout.isatty() else 240)  # a file or pipe: no squeezing
    formats = (["csv"] if write_csv_file else []) + (["md"] if write_md_file else [])
    try:
        result = comparing.compare(specs, tracking_uri=tracking_uri, out_dir=out,
                                   formats=formats, log=log_run)
    except comparing.CompareError as exc:
        raise fail(str(exc)) from None
    console.print(rich_table(result.rows, console.width))
    for path in [result.csv_path, result.md_path, *result.plots]:
        if path is not None:
            console.print(f"wrote {path}")
    if result.comparison_run_id:
        console.print(f"logged as MLflow run {result.comparison_run_id}")
