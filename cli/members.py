"""``diloco join`` and ``diloco leave``: add a worker to a running run, or make one
leave it; and the members table of ``diloco status``.

    diloco join RUN --worker region-c [--batch-size 16] [--wait]
    diloco leave RUN --worker region-b [--wait]

Both check everything first and write nothing when a check fails (one line, exit 2).
``join`` launches the worker job the way the run's other jobs were launched (its
``members/launcher.json``): a detached local process with its log beside the run's,
or a flow run of the worker deployment with ``join=True``. The worker claims its
name (``members/NAME.json``) and the aggregator admits it to a free data slot.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated, Any

import typer

from cli.console import console, fail, shown, user_errors
from cli.run import open_named_run
from flows.control import read_launcher, write_launcher

RUN_HELP = "a run URL, or a run's name under runs/"


def _finished(exchange: Any) -> bool:
    """Every fragment's last mean is committed: nothing is left to train."""
    from diloco.membership import run_finished  # noqa: PLC0415

    return run_finished(exchange.store, exchange.manifest)


def _config(exchange: Any) -> Any:
    from workers.config import RunConfig  # noqa: PLC0415 - torch

    return RunConfig.stored(exchange.manifest.config)


def members(exchange: Any) -> list[dict[str, Any]]:
    """Every member (the manifest's workers and the joiners) with its slot, state,
    lease age (seconds since its status changed), join and leave times, the step it
    trains from and its rebases."""
    from diloco.membership import members_of, read_json  # noqa: PLC0415
    from storage import layout  # noqa: PLC0415

    store, now = exchange.store, datetime.now(UTC)
    out = []
    for m in members_of(store, exchange.manifest):
        name = m["worker"]
        status = read_json(store, layout.member_status(name)) or {}
        record = read_json(store, layout.member(name)) or {} if m["joined"] else {}
        left = read_json(store, layout.left(name)) if m["left"] else None
        out.append({**m, "lease_age_s": _age(m.get("updated"), now),
                    "joined_at": record.get("created"),
                    "left_at": (left or {}).get("created"),
                    "last_rounds": (left or {}).get("last_rounds"),
                    "rebases": status.get("rebases", 0),
                    "leave_requested": store.exists(layout.leave_request(name))})
    return out


def _age(iso: str | None, now: datetime) -> float | None:
    try:
        return round((now - datetime.fromisoformat(iso)).total_seconds(), 1) if iso else None
    except ValueError:
        return None


def print_members(rows: list[dict[str, Any]]) -> None:
    """The members table and the recent joins and leaves."""
    from rich.table import Table  # noqa: PLC0415

    table = Table(title="members", title_justify="left", box=None, pad_edge=False)
    for col in ("member", "slot", "state", "lease age", "joined", "left", "from step",
                "rebases"):
        table.add_column(col, justify="left" if col in ("member", "state") else "right")
    for m in rows:
        age = m["lease_age_s"]
        state = m.get("refused") and "refused" or m.get("state") or (
            "waiting for admission" if m["slot"] is None else "not started")
        if m["leave_requested"] and not m["left"]:
            state += " (leaving)"
        table.add_row(m["worker"], "-" if m["slot"] is None else str(m["slot"]), state,
                      "-" if age is None else f"{age:.0f} s",
                      (m["joined_at"] or "")[11:19] or ("mid-run" if m["joined"] else "start"),
                      (m["left_at"] or "")[11:19] or "-", str(m.get("from_step") or 0),
                      str(m.get("rebases") or 0))
    console.print(table)
    events = sorted(
        [(m["joined_at"], f"{m['worker']} joined") for m in rows if m["joined_at"]]
        + [(m["left_at"], f"{m['worker']} left after rounds {m['last_rounds']}")
           for m in rows if m["left_at"]])
    for at, what in events[-5:]:
        console.print(f"  {at[:19].replace('T', ' ')} UTC  {what}", highlight=False)


def _slots_free(exchange: Any, cfg: Any, rows: list[dict[str, Any]]) -> tuple[int, int]:
    """(free data slots, slots): slots held by members that have not left, and
    joiners still waiting for admission, are not free."""
    slots = max(cfg.data.slot_count(len(exchange.manifest.workers)),
                len(exchange.manifest.workers))
    held = sum(1 for m in rows if not m["left"] and not m.get("refused"))
    return slots - held, slots


def join(
    run: Annotated[str, typer.Argument(help=RUN_HELP)],
    worker: Annotated[str, typer.Option("--worker", help="the new worker's name")],
    batch_size: Annotated[int | None, typer.Option(
        min=1, help="its batch size (default: data.worker_batch_size or data.batch_size); "
                    "means are weighted by tokens")] = None,
    deployment: Annotated[str | None, typer.Option(
        help="deployments backend: the worker deployment to run it on "
             "(default: the run's, e.g. worker/NAME)")] = None,
    wait: Annotated[bool, typer.Option(
        help="wait until the aggregator admits it and print its data slot")] = False,
    timeout: Annotated[float, typer.Option(help="seconds --wait waits")] = 600.0,
) -> None:
    """Add a worker to a running run: it takes the newest committed state and a free
    data slot, then trains with the others (follow it with `diloco status RUN`)."""
    from diloco.membership import MembershipError, claim_name, new_claim  # noqa: PLC0415
    from storage import layout  # noqa: PLC0415

    url, exchange = open_named_run(run)
    manifest = exchange.manifest
    try:
        layout.check_name("worker", worker)
    except ValueError as exc:
        raise fail(f"--worker: {exc}") from None
    cfg = _config(exchange)
    if cfg.train.strategy != "diloco":
        raise fail(f"run {manifest.run_id!r} trains with train.strategy "
                   f"{cfg.train.strategy!r}: only 'diloco' runs take joiners")
    if _finished(exchange):
        raise fail(f"run {manifest.run_id!r} has finished (every fragment's last round is "
                   f"reduced): there is nothing to join; start a new run with diloco run")
    if worker in manifest.workers or exchange.store.exists(layout.member(worker)):
        raise fail(f"worker name {worker!r} is taken in run {manifest.run_id!r} "
                   f"(members/{worker}.json); pick another --worker")
    rows = members(exchange)
    free, slots = _slots_free(exchange, cfg, rows)
    if free <= 0:
        raise fail(f"run {manifest.run_id!r} has no free data slot: its {slots} slots "
                   f"(data.slots) are held by members that have not left; make one leave "
                   f"(diloco leave {run} --worker NAME) or create the run with more data.slots")
    claim = new_claim()
    record = read_launcher(exchange.store) or {}
    launcher = _launcher(record, deployment, claim)
    batch = batch_size or cfg.data.worker_batch_size.get(worker, cfg.data.batch_size)
    try:  # the claim, create-only: of two joins racing for the name, one wins
        claim_name(exchange.store, manifest, worker, claim, batch_size=batch)
    except MembershipError as exc:
        raise fail(str(exc)) from None
    try:
        launcher.start(url, worker, join=True, claim=claim)
    except user_errors() as exc:  # not launched: the name is free again
        exchange.store.delete(layout.member(worker))
        raise fail(str(exc)) from None
    jobs = {**record.get("jobs", {}), **launcher.record()["jobs"]}
    write_launcher(exchange.store, {**record, **launcher.record(), "jobs": jobs})
    console.print(f"{worker} is joining {shown(url)} ({launcher.where(worker) or launcher.backend}"
                  f"); follow it with: diloco status {run}", highlight=False)
    if wait:
        _wait_admitted(exchange, worker, launcher, timeout)


def _launcher(record: dict[str, Any], deployment: str | None, claim: str) -> Any:
    from flows.launchers import DeploymentLauncher, LocalLauncher  # noqa: PLC0415

    if record.get("backend") == "deployments":
        return DeploymentLauncher(
            key=f"join:{claim}", worker_deployment=deployment or record.get(
                "worker_deployment") or "worker/{worker}")
    if deployment:
        raise fail("--deployment: the run's jobs were launched locally, not as "
                   "deployments; leave --deployment out")
    return LocalLauncher(detached=True)


def _wait_admitted(exchange: Any, worker: str, launcher: Any, timeout: float) -> None:
    from diloco.membership import read_json  # noqa: PLC0415
    from storage import layout  # noqa: PLC0415

    deadline = time.monotonic() + timeout
    with console.status(f"waiting for the aggregator to admit {worker} ..."):
        while time.monotonic() < deadline:
            got = read_json(exchange.store, layout.admission(worker))
            if got is not None:
                if got.get("refused"):
                    raise fail(f"{worker} was not admitted: {got['refused']}", 1)
                console.print(f"{worker} admitted: data slot {got.get('slot')}")
                return
            if launcher.poll().get(worker) not in (None, "running"):
                raise fail(f"{worker} ended before its admission; "
                           f"{launcher.where(worker)}", 1)
            time.sleep(0.5)
    raise fail(f"{worker}: no admission after {timeout:.0f} s (is the run's aggregator "
               f"running? see diloco status)", 1)


def leave(
    run: Annotated[str, typer.Argument(help=RUN_HELP)],
    worker: Annotated[str, typer.Option("--worker", help="the worker that leaves")],
    wait: Annotated[bool, typer.Option(
        help="wait until it has left and print its last rounds")] = False,
    timeout: Annotated[float, typer.Option(help="seconds --wait waits")] = 600.0,
) -> None:
    """Make a worker leave the run: it finishes its round, commits, and stops; the
    others no longer wait for it."""
    from diloco.membership import read_json, request_leave  # noqa: PLC0415
    from storage import layout  # noqa: PLC0415

    url, exchange = open_named_run(run)
    store, manifest = exchange.store, exchange.manifest
    try:
        layout.check_name("worker", worker)
    except ValueError as exc:
        raise fail(f"--worker: {exc}") from None
    record = read_json(store, layout.member(worker)) or {}
    if worker not in manifest.workers and not record.get("join"):
        raise fail(f"{worker!r} is not a member of run {manifest.run_id!r} (members: "
                   f"{', '.join(m['worker'] for m in members(exchange))})")
    if store.exists(layout.left(worker)):
        raise fail(f"{worker} has already left run {manifest.run_id!r} "
                   f"(members/{worker}/left.json)")
    if _finished(exchange):
        raise fail(f"run {manifest.run_id!r} has finished: there is nothing to leave")
    asked = request_leave(store, worker, reason="diloco leave")
    console.print(f"{worker} {'asked' if asked else 'was already asked'} to leave "
                  f"{shown(url)}: it finishes its round, commits and stops", highlight=False)
    if not wait:
        return
    deadline = time.monotonic() + timeout
    with console.status(f"waiting for {worker} to leave ..."):
        while time.monotonic() < deadline:
            got = read_json(store, layout.left(worker))
            if got is not None:
                console.print(f"{worker} left after step {got.get('step')}; last rounds "
                              f"per fragment: {got.get('last_rounds')}")
                return
            if _finished(exchange):
                raise fail(f"run {manifest.run_id!r} finished before {worker} left", 1)
            time.sleep(0.5)
    raise fail(f"{worker} has not left after {timeout:.0f} s (is it running? see "
               f"diloco status {run})", 1)
