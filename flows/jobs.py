"""What the worker and aggregator jobs share: how they stop, end and report.

A job stops the same way whatever asks it to: SIGTERM or SIGINT (a launcher, a
Prefect worker cancelling the flow run, Ctrl-C), the run's cancel request in the
store, or its launcher dying. Each of these sets one ``threading.Event``; the work
loop sees it between two steps, checkpoints and returns. The job then ends with
one of the states of `workers.status` and, as a process, with an exit status.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from flows.shard_status import shard_state, shard_statuses, silent_for
from storage.backends import (
    USE_THE_ENVIRONMENT,
    CredentialsInURL,
    secret_options,
)
from storage.errors import RunNotFound
from storage.exchange import Exchange
from storage.objectstore import ObjectStore
from storage.reach import StoreUnreachable
from tracking.hooks import Hooks
from tracking.mlflow_hooks import hooks_for
from workers.status import StatusBoard, read_status

log = logging.getLogger(__name__)

#: Exit statuses of ``python -m flows.worker`` and ``python -m flows.aggregator``.
EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_STOPPED = 143  # interrupted or cancelled, checkpoint saved (128 + SIGTERM)

EXIT_CODES = {"finished": EXIT_FINISHED, "left": EXIT_FINISHED, "interrupted": EXIT_STOPPED,
              "cancelled": EXIT_STOPPED, "failed": EXIT_FAILED}


def usage_errors() -> tuple[type[Exception], ...]:
    """Errors in what a job was given (exit status 2, one line): nothing was written."""
    return (CredentialsInURL, RunNotFound, StoreUnreachable)


def refuse_secret_parameters(storage_options: dict | None) -> None:
    """A flow's parameters are stored in Prefect's database (and shown in its UI):
    ``storage_options`` given to a flow must hold no credential."""
    found = secret_options(storage_options)
    if found:
        raise ValueError(f"{found[0]}: flow-run parameters are stored in Prefect's database; "
                         f"remove it and, where the flow runs, {USE_THE_ENVIRONMENT}")


def job_hooks(run_url: str, role: str, storage_options: dict | None) -> Hooks:
    """The tracking hooks of a job; no-op hooks if they cannot even be built."""
    try:
        return hooks_for(run_url, role=role, storage_options=storage_options)
    except Exception as exc:  # noqa: BLE001 - tracking never stops training
        log.warning("%s: tracking is off: %s", role, exc)
        return Hooks()


def close_hooks(hooks: Hooks) -> dict[str, int]:
    """Flush the tracking hooks; returns what was not logged (by kind), if anything."""
    try:
        return dict(hooks.close() or {})
    except Exception as exc:  # noqa: BLE001
        log.warning("tracking: could not flush: %s", exc)
        return {"flush": 1}


def record_not_logged(store: ObjectStore, name: str, counts: dict[str, int]) -> None:
    """Put a job's not-logged tracking counts in its status, where the train job's
    report and ``diloco run`` find them (the job may run in another region)."""
    if not counts:
        return
    try:
        current = read_status(store, name) or {}
        set_state(store, name, current.get("state", "finished"), not_logged=counts)
    except Exception as exc:  # noqa: BLE001 - best effort
        log.warning("%s: could not record the not-logged counts: %s", name, exc)


@contextmanager
def stop_on_signals(stop: threading.Event,
                    first: Callable[[], None] | None = None) -> Iterator[None]:
    """SIGTERM and SIGINT set ``stop`` while inside (main thread only; elsewhere,
    signals are someone else's). With ``first``, the first signal calls it instead
    and only a second one sets ``stop``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    seen = []

    def handler(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        seen.append(name)
        if first is not None and len(seen) == 1:
            log.info("received %s: finishing what is in flight", name)
            first()
        else:
            log.info("received %s: stopping after the current step", name)
            stop.set()

    for s in previous:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def set_state(store: ObjectStore, name: str, state: str, **fields: Any) -> None:
    """Overwrite the state in ``name``'s status, keeping its other fields."""
    current = read_status(store, name) or {}
    kept = {k: v for k, v in current.items() if k not in ("name", "state", "updated")}
    StatusBoard(store, name).update(state, force=True, **{**kept, **fields})


def flow_log(message: str, *args: Any, level: int = logging.INFO,
             fallback: logging.Logger | None = None) -> bool:
    """A line in the log of the Prefect flow (or task) run this code runs in, which
    the API keeps and the UI shows; outside one (a job of the local launcher), the
    line goes to ``fallback`` if given. True if it went to a flow run's log.

    A process that has not imported Prefect is in no flow run (the jobs the local
    launcher starts never import it), and is not made to import it here."""
    if "prefect" not in sys.modules:
        if fallback is not None:
            fallback.log(level, message, *args)
        return False
    from prefect import get_run_logger  # noqa: PLC0415
    from prefect.exceptions import MissingContextError  # noqa: PLC0415

    try:
        logger = get_run_logger()
    except MissingContextError:
        if fallback is not None:
            fallback.log(level, message, *args)
        return False
    logger.log(level, message, *args)
    return True


def run_id_of(run_url: str | None) -> str:
    """The run's id: the last part of its URL (``tiny-20261124-101500``)."""
    return (run_url or "").rstrip("/").rsplit("/", 1)[-1]


def print_result(result: dict[str, Any]) -> None:
    """The last line a job prints: its result as JSON (parsed by tests and tools)."""
    print(json.dumps(result, default=str), flush=True)


def to_launch(exchange: Exchange, snap: dict[str, Any]) -> list[str]:
    """The jobs a start or a resume launches: the aggregator unless it finished, and
    every member that has neither finished nor left: the manifest's workers and the
    workers that joined mid-run (relaunched as members, without ``--join``: their
    record exists). A worker that left is done and never relaunched."""
    from diloco.membership import has_left, read_json  # noqa: PLC0415
    from storage import layout  # noqa: PLC0415

    joined = [m["worker"] for m in run_members(exchange) if m.get("joined")]
    todo = []
    for w in [*exchange.manifest.workers, *joined]:
        status = snap["workers"].get(w) or read_json(exchange.store,
                                                     layout.member_status(w)) or {}
        if status.get("state") in ("finished", "left") or has_left(exchange.store, w):
            continue
        todo.append(w)
    if snap["aggregator"].get("state") != "finished":
        # a sharded aggregator (aggregator.shards = K): shard 0 is the aggregator job,
        # shards 1..K-1 jobs of their own (each resumes from its own part checkpoints)
        todo[:0] = ["aggregator", *(f"aggregator-s{s}" for s in range(1, exchange.shards))]
    return todo


def run_members(exchange: Exchange) -> list[dict[str, Any]]:
    """The run's members as the store has them (best effort: [] if unreadable)."""
    from diloco.membership import members_of  # noqa: PLC0415

    try:
        return members_of(exchange.store, exchange.manifest)
    except Exception as exc:  # noqa: BLE001 - a view; never stops a run
        log.warning("could not read the members: %s", exc)
        return []


def record_jobs(store: ObjectStore, launcher: Any) -> None:
    """``members/launcher.json``: this launcher's jobs, and those another command
    added (``diloco join``'s), kept."""
    from flows.control import read_launcher, write_launcher  # noqa: PLC0415

    mine = launcher.record()
    before = read_launcher(store) or {}
    others = {n: j for n, j in (before.get("jobs") or {}).items()
              if n not in mine["jobs"]} if before.get("backend") == mine["backend"] else {}
    write_launcher(store, {**mine, "jobs": {**others, **mine["jobs"]}})


def as_task(name: str, fn: Any) -> Any:
    """A stage of the train flow as a Prefect task named ``name`` (no cache: each
    call does its work)."""
    from prefect import task  # noqa: PLC0415
    from prefect.cache_policies import NO_CACHE  # noqa: PLC0415

    return task(fn, name=name, task_run_name=name,
                cache_policy=NO_CACHE)


def rename_flow_run(name: str) -> None:
    """Name the current flow run (best effort)."""
    from prefect import get_client  # noqa: PLC0415
    from prefect.runtime import flow_run  # noqa: PLC0415

    if not flow_run.id or flow_run.name == name:
        return
    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_name(flow_run.id, name)
    except Exception as exc:  # noqa: BLE001 - a name never stops a run
        log.warning("could not name the flow run %s: %s", name, exc)


def member_set(rows: list[dict[str, Any]] | None) -> str:
    """``; members: a (slot 0), c (joined, slot 2), b (left)`` for the progress
    artifact; "" before the members are known."""
    if not rows:
        return ""
    out = []
    for m in rows:
        tags = (["joined"] if m.get("joined") else []) + (
            ["left"] if m.get("left") else [f"slot {m['slot']}"] if m.get("slot") is not None
            else ["waiting for admission"])
        out.append(f"{m['worker']} ({', '.join(tags)})")
    return "; members: " + ", ".join(out)


def with_shards(report: dict[str, Any], exchange: Exchange) -> dict[str, Any]:
    """The report with ``aggregator_shards``: each of a sharded aggregator's shards
    1..K-1 (shard 0 is the aggregator's own row) as its status board last had it,
    so a report tells a shard that finished from one that died (``silent_s``)."""
    shards = shard_statuses(exchange)
    if shards:
        report["aggregator_shards"] = {
            name: {"state": shard_state(st), "rounds": st.get("rounds", 0),
                   "total_rounds": st.get("total_rounds"), "silent_s": silent_for(st)}
            for name, st in shards.items()}
    return report


def with_joiners(report: dict[str, Any], exchange: Exchange,
                 members: list[dict[str, Any]]) -> dict[str, Any]:
    """The report with a row per worker that joined mid-run (the manifest's workers
    have theirs), its tokens and bytes in the totals, and ``members``."""
    report["members"] = members
    g = report["global"]
    for m in members:
        if not m.get("joined") or any(w["worker"] == m["worker"] for w in report["workers"]):
            continue
        s = read_status(exchange.store, m["worker"]) or {}
        row = {"worker": m["worker"], "state": s.get("state", "not started"),
               "steps": s.get("step", 0), "total_steps": s.get("total_steps",
                                                               exchange.manifest.total_steps),
               "tokens": s.get("tokens", 0), "bytes_up": s.get("bytes_up", 0),
               "bytes_down": s.get("bytes_down", 0), "wait_s": s.get("wait_s", 0.0),
               "loss": s.get("loss"), "eval_loss": s.get("eval_loss")}
        report["workers"].append(row)
        g["tokens"] = (g.get("tokens") or 0) + (row["tokens"] or 0)
        for key, part in (("bytes_up", "workers_bytes_up"), ("bytes_down", "workers_bytes_down")):
            g[part] = (g.get(part) or 0) + (row[key] or 0)
            g[key] = (g.get(key) or 0) + (row[key] or 0)
            g["bytes_total"] = (g.get("bytes_total") or 0) + (row[key] or 0)
    return report
