"""``diloco gc RUN``: show (and with ``--apply`` delete) what a run's store holds
that neither a resume nor an audit needs. The rules are `workers.gc`'s."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from cli.console import console, fail, shown
from cli.run import open_named_run
from storage.traffic import human_bytes
from workers import gc as collecting


def _contributions(value: str | None) -> int | str | None:
    if value is None:
        return None
    if value.strip().lower() == "all":
        return "all"
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise fail(f"--contributions {value}: use a number of rounds >= 0, or all")
    return n


def gc(
    run: Annotated[str, typer.Argument(help="a run URL, or a run's name under runs/")],
    apply: Annotated[bool, typer.Option(
        "--apply", help="delete (without it, only show what would be deleted)")] = False,
    contributions: Annotated[str | None, typer.Option(
        help="rounds per fragment whose outer-gradient payloads a finished run keeps, "
             "or 'all' (default: the run's retention.contributions)")] = None,
    worker_checkpoints: Annotated[int | None, typer.Option(
        min=1, help="checkpoints each worker keeps while the run can be resumed "
                    "(default: the run's retention.worker_checkpoints)")] = None,
    canonical_checkpoints: Annotated[int | None, typer.Option(
        min=0, help="canonical round checkpoints kept per fragment, 0: all "
                    "(default: the run's train.keep_checkpoints)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
) -> None:
    """Delete what a run no longer needs: old and finished workers' checkpoints, old
    canonical checkpoints, orphan payloads, payloads beyond the retention.

    A dry run unless --apply. A run that can still be resumed keeps each worker's
    newest checkpoint and every payload a resume may read.
    """
    keep = _contributions(contributions)
    url, exchange = open_named_run(run)
    plan = collecting.plan(exchange, contributions=keep, keep_worker=worker_checkpoints,
                           keep_canonical=canonical_checkpoints)
    if as_json:
        print(json.dumps({
            "run_url": url, "finished": plan.finished, "apply": apply,
            "before": plan.before.as_dict(), "before_bytes": plan.before.total_bytes,
            "freed_bytes": plan.freed_bytes, "freed_objects": plan.freed_objects,
            "deletions": [d.__dict__ for d in plan.deletions]}, indent=1))
        if not apply:
            return
    else:
        console.print(_table(plan))
        state = "finished" if plan.finished else "not finished (resume keeps what it needs)"
        console.print(f"{shown(url)}: {state}; {human_bytes(plan.before.total_bytes)} now, "
                      f"{human_bytes(plan.before.total_bytes - plan.freed_bytes)} after gc")
    if not plan.deletions:
        if not as_json:
            console.print("nothing to delete")
        return
    if not apply:
        console.print(f"dry run: nothing deleted; to delete {human_bytes(plan.freed_bytes)} "
                      f"({plan.freed_objects} objects): diloco gc {run} --apply")
        return
    with console.status("deleting ...") as spinner:
        done = [0]

        def show(d: collecting.Deletion) -> None:
            done[0] += d.bytes
            spinner.update(f"deleting ... {human_bytes(done[0])} of "
                           f"{human_bytes(plan.freed_bytes)}")

        freed = collecting.collect(exchange, plan, progress=show)
    if not as_json:
        console.print(f"deleted {human_bytes(freed)} ({plan.freed_objects} objects); the run "
                      f"holds {human_bytes(collecting.usage(exchange.store).total_bytes)}")


def _table(plan: collecting.Plan) -> Table:
    table = Table(show_edge=False, header_style="bold")
    for title, justify in (("kind", "left"), ("objects", "right"), ("size", "right"),
                           ("deleted", "right"), ("kept", "right")):
        table.add_column(title, justify=justify, no_wrap=True)
    gone = plan.by_kind()
    for kind in collecting.KINDS:
        if kind not in plan.before.objects:
            continue
        size = plan.before.bytes[kind]
        _, freed = gone.get(kind, (0, 0))
        table.add_row(kind, f"{plan.before.objects[kind]:,}", human_bytes(size),
                      human_bytes(freed) if freed else "-", human_bytes(size - freed))
    table.add_row("[bold]total[/]", f"{plan.before.total_objects:,}",
                  human_bytes(plan.before.total_bytes), human_bytes(plan.freed_bytes),
                  human_bytes(plan.before.total_bytes - plan.freed_bytes))
    return table
