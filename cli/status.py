"""``diloco status`` and ``diloco cancel``: read a run's state from its store, or
stop it. How jobs are stopped is `flows.cancel`; this module prints."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from cli.console import console, errors, fail, quiet_logs, shown
from cli.figures import print_status
from cli.members import members, print_members
from cli.run import open_named_run
from flows import cancel as cancelling
from flows.control import cancel_request, read_launcher, request_cancel
from flows.shard_status import shard_statuses, silent_for
from workers.gc import usage
from workers.report import run_cost, snapshot


def status(
    run: Annotated[str, typer.Argument(help="a run URL, or a run's name under runs/")],
    as_json: Annotated[bool, typer.Option("--json", help="print the status as JSON")] = False,
) -> None:
    """Every party's progress, read from the run's store."""
    url, exchange = open_named_run(run)
    launcher, cancel = read_launcher(exchange.store), cancel_request(exchange.store)
    size = usage(exchange.store)  # one listing of the run's objects
    rows = members(exchange)
    if as_json:
        snap = snapshot(exchange)
        shards = {n: {**st, "silent_s": silent_for(st)} for n, st in
                  shard_statuses(exchange).items()}
        print(json.dumps({"run_url": url, **snap, "aggregator_shards": shards,
                          "members": rows,
                          "cost": run_cost(snap, exchange.manifest.config),
                          "launcher": launcher,
                          "cancel": cancel, "store": {"bytes": size.total_bytes,
                                                      "objects": size.total_objects,
                                                      "by_kind": size.as_dict()}},
                         indent=1, default=str))
        return
    print_status(console, exchange, shown(url), launcher, cancel, size)
    print_members(rows)
    print_failures(snapshot(exchange))


def print_failures(snap: dict) -> None:
    """A line per party whose status says failed, with its error as the party (or the
    Docker worker that saw its container OOM-killed) wrote it: why, in one line
    (soft-wrapped, so a narrow terminal does not split it)."""
    parties = {**snap.get("workers", {}), "aggregator": snap.get("aggregator") or {}}
    for name, st in parties.items():
        if st.get("state") == "failed" and st.get("error"):
            console.print(f"[red]{name} failed[/]: {st['error']}", highlight=False,
                          soft_wrap=True)


def cancel(
    run: Annotated[str, typer.Argument(help="a run URL, or a run's name under runs/")],
    reason: Annotated[str, typer.Option(help="recorded in the cancel request")] = "",
    wait: Annotated[bool, typer.Option(
        help="wait until every job has stopped")] = True,
    timeout: Annotated[float, typer.Option(help="seconds to wait")] = 180.0,
) -> None:
    """Stop a run: every job checkpoints and exits; `diloco resume RUN` continues it.

    Writes a cancel request into the run's store (every job and the train flow poll
    it), cancels the jobs' Prefect flow runs when they have any, and waits.
    """
    url, exchange = open_named_run(run)
    snap = snapshot(exchange)
    if all(p.get("state") == "finished" for p in [*snap["workers"].values(),
                                                   snap["aggregator"]]):
        raise fail(f"{shown(url)} has finished; there is nothing to cancel "
                   f"(see: diloco status {run})")
    request = request_cancel(exchange.store, reason)
    console.print(f"cancel requested ({request['requested'][:19]}, by {request['by']})")
    launcher = read_launcher(exchange.store) or {}
    if launcher.get("backend") == "deployments" and cancelling.prefect_reachable():
        quiet_logs(False)
        changed = cancelling.cancel_deployment_jobs(launcher, "diloco cancel")
        console.print(f"set {len(changed)} flow runs to Cancelling")
    if not wait:
        return
    with console.status("waiting for the jobs to checkpoint and stop ..."):
        stopped = cancelling.wait_until_stopped(exchange, launcher, timeout)
        if not stopped:
            cancelling.kill_local_jobs(launcher, on_kill=lambda name, pid: errors.print(
                f"{name} (pid {pid}) did not stop in time; killing it"))
    states = cancelling.party_states(exchange)
    console.print("stopped: " + ", ".join(f"{n} {s}" for n, s in states.items()))
    console.print(f"continue with: diloco resume {run}")
