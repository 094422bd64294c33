"""``diloco run`` and ``diloco resume``: start or continue a run, show its progress,
print its figures.

The train flow (`flows.train`) does the work; this module resolves what the user
named, refuses what cannot work before anything is launched, and prints.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from cli.console import (
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    Backend,
    backend_named,
    console,
    errors,
    fail,
    mlflow_hint,
    prefect_hint,
    quiet_logs,
    shown,
    user_errors,
)
from cli.figures import print_report
from cli.progress import progress_for
from cli.store import describe, local_s3, read_back_hint
from flows.cancel import live_local_jobs
from flows.control import cancel_request, read_launcher
from storage.backends import refuse_credentials
from storage.errors import StoreError
from storage.local_s3 import BUCKET as LOCAL_S3_BUCKET
from storage.local_s3 import LOCAL_S3
from storage.local_s3 import STORE_URL as LOCAL_S3_URL
from workers.report import build_report, snapshot
from workers.status import read_status

#: The exit status after a SIGTERM, as a shell reports a process it ended (128 + 15).
EXIT_TERMINATED = 128 + signal.SIGTERM


class _Terminated(BaseException):
    """SIGTERM to this command: ``docker stop``, ``kill``, a Prefect worker cancelling
    its flow run. A BaseException, as KeyboardInterrupt is, so that no ``except
    Exception`` on the way takes it for an error."""


class _PrefectTerminationLines(logging.Filter):
    """Drops Prefect's "Crash detected! ... termination signal" records from the
    terminal (the flow run's log in Prefect keeps them): this command says in one line
    that it was stopped and how to go on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "termination signal" not in record.getMessage()


@contextmanager
def _sigterm_stops() -> Iterator[None]:
    """SIGTERM raises `_Terminated` in the main thread while the run is driven.

    Prefect swaps in its own handler while the train flow runs: it stops the flow
    (which stops the jobs, which checkpoint), restores this one and sends the signal
    again, so this one ends the command either way. A handler is needed even where
    Python's default would end the process: as pid 1 of a container the default is
    to ignore SIGTERM, and ``docker stop`` ended ``diloco run`` with a traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(_signum: int, _frame: Any) -> None:
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    quiet = _PrefectTerminationLines()
    handlers = list(logging.getLogger().handlers)  # Prefect's console handler is the root's
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        for handler in handlers:
            handler.removeFilter(quiet)


def _drive(*, run_url: str, flow_kwargs: dict[str, Any], resume: bool, verbose: bool,
           storage_options: dict | None = None,
           hints: list[tuple[str, str]] | None = None) -> None:
    """Run the train flow with a live display, then print the figures (and ``hints``,
    lines of the "where" table)."""
    quiet_logs(verbose)
    # Prefect and torch: imported here, after quiet_logs (see the package docstring).
    from diloco.run import open_run  # noqa: PLC0415 - torch
    from flows.server import server_log, tie_temporary_server  # noqa: PLC0415

    # (TerminationSignal: what Prefect raises for a SIGTERM while the train flow runs)
    from flows.train import TerminationSignal, train  # noqa: PLC0415
    from storage.reach import REACH_POLICY  # noqa: PLC0415

    start = time.monotonic()
    where = shown(run_url)
    console.print(f"[bold]{'resuming' if resume else 'training'}[/] {where}  "
                  f"(Prefect: {prefect_hint()})", highlight=False)
    # bars in a terminal; piped or in CI, a plain line per round, eval and state
    live = progress_for(console)(lambda: open_run(run_url, storage_options, retry=REACH_POLICY), console)
    state = None
    try:
        with _sigterm_stops(), live:
            try:  # Prefect's, when there is no PREFECT_API_URL: it dies with this command
                tie_temporary_server()
            except Exception as exc:  # noqa: BLE001 - a timeout, a port: one line, no traceback
                first = (str(exc).splitlines() or [type(exc).__name__])[0]
                raise fail(f"Prefect's temporary server did not start: {first} (its log: "
                           f"{server_log()}); or set PREFECT_API_URL to a running server",
                           EXIT_FAILED) from None
            state = train(run_url=run_url, resume=resume, storage_options=storage_options,
                          return_state=True, **flow_kwargs)
    except (KeyboardInterrupt, _Terminated, TerminationSignal) as exc:
        how = "interrupted" if isinstance(exc, KeyboardInterrupt) else "stopped by SIGTERM"
        errors.print(f"\n{how}: the jobs saved their checkpoints. Continue with:\n"
                     f"  diloco resume {where}")
        raise typer.Exit(EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt)
                         else EXIT_TERMINATED) from None
    try:
        exchange = open_run(run_url, storage_options)
    except Exception:  # noqa: BLE001 - it failed before the run was created
        exchange = None
    if state is not None and state.is_failed() and exchange is None:
        raise fail(_state_message(state))
    if state is not None and state.is_failed() and not resume and _lost_the_race(state):
        # another `diloco run` created this run between our check and our flow: it is
        # theirs, running or not; nothing of ours was written
        raise fail(f"a run already exists at {where}: another diloco run created it first; "
                   f"watch it with: diloco status {_run_ref(run_url)}, or choose another "
                   "--run-url")
    outcome = ("finished" if state.is_completed() else
               "cancelled" if state.is_cancelled() else "failed")
    report = build_report(exchange, run_url=run_url, state=outcome,
                          wall_seconds=time.monotonic() - start,
                          message="" if outcome == "finished" else _state_message(state))
    from flows.jobs import run_members, with_joiners, with_shards  # noqa: PLC0415

    with_joiners(report, exchange, run_members(exchange))  # the workers that joined too
    with_shards(report, exchange)  # and a sharded aggregator's other shards
    print_report(console, report, initial_eval=_initial_eval(exchange),
                 where=[("store", where), ("status", f"diloco status {_run_ref(run_url)}"),
                        ("MLflow", mlflow_hint()), ("Prefect", prefect_hint(ended=True))]
                 + ([("resume", f"diloco resume {_run_ref(run_url)}")]
                    if outcome != "finished" else []) + (hints or []))
    if outcome == "failed":
        raise typer.Exit(EXIT_FAILED)
    if outcome == "cancelled":
        raise typer.Exit(EXIT_CANCELLED)


def _lost_the_race(state: Any) -> bool:
    """Whether the failed train flow found the run already created (RunExists)."""
    from storage.errors import RunExists  # noqa: PLC0415

    try:
        return isinstance(state.result(raise_on_failure=False), RunExists)
    except Exception:  # noqa: BLE001 - no result kept: go by the message
        return "RunExists" in (state.message or "")


def _state_message(state: Any) -> str:
    message = state.message or state.type.value
    return message.removeprefix("Flow run encountered an exception: ")


def _initial_eval(exchange: Any) -> float | None:
    return (read_status(exchange.store, "aggregator") or {}).get("initial_eval_loss")


def _run_ref(run_url: str) -> str:
    """How to name the run on the command line: its name if it is under runs/."""
    from workers.locate import DEFAULT_STORE  # noqa: PLC0415 - torch

    if "://" not in run_url and Path(run_url).parent == Path(DEFAULT_STORE).resolve():
        return Path(run_url).name
    return shown(run_url)


def run(
    config: Annotated[str, typer.Argument(
        help="a shipped recipe (tiny, small, gpu-150m, gpu-1b) or a YAML file")] = "tiny",
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", metavar="KEY=VALUE",
        help="override a config field, e.g. --set train.steps=100 (repeatable)")] = None,
    store: Annotated[str | None, typer.Option(
        "--store", metavar="URL|local-s3",
        help="where runs are created (as --set store=URL); local-s3: S3 on this machine, "
             "SeaweedFS serving runs/.seaweedfs while the command runs")] = None,
    run_url: Annotated[str | None, typer.Option(
        "--run-url", help="where the run lives (default: <store>/<name>-<time>)")] = None,
    backend: Annotated[str, typer.Option(
        metavar="local|deployments",
        help="local: worker processes on this machine; deployments: Prefect deployments "
             "of each region's work pool (see diloco deploy)")] = Backend.local.value,
    nproc: Annotated[int, typer.Option(
        min=1, help="processes per worker island (torchrun when > 1)")] = 1,
    continue_from: Annotated[str | None, typer.Option(
        "--continue-from", metavar="RUN",
        help="start from the canonical model of this run (a new run; see --extra-steps)")] = None,
    extra_steps: Annotated[int | None, typer.Option(
        min=1, help="with --continue-from: the new run's steps (default: the old run's)")] = None,
    no_eval: Annotated[bool, typer.Option(
        "--no-eval", help="do not evaluate the canonical model in the aggregator")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Prefect's logs too")] = False,
) -> None:
    """Train: create a run, launch its workers and aggregator, show progress, report.

    With no arguments: the tiny recipe on two local "regions", the store in runs/,
    Prefect without a server to install, MLflow on SQLite (mlflow.db). With
    --store local-s3, the same on a real S3 server of this machine.
    """
    quiet_logs(verbose)
    chosen = backend_named(backend)
    _reach_prefect(chosen)
    overrides = [*(overrides or []), *([f"store={store}"] if store is not None else [])]
    if _store_override(overrides) != LOCAL_S3:
        _start(config, overrides, run_url, chosen, nproc, continue_from, extra_steps, no_eval,
               verbose)
        return
    if chosen is not Backend.local:
        raise fail("--store local-s3 is served on this machine's loopback, which only local "
                   "jobs reach: use --backend local, or a bucket every region reaches")
    overrides = [*overrides, f"store={LOCAL_S3_URL}"]
    from workers.config import load_config  # noqa: PLC0415 - torch

    try:  # what is wrong is said before anything is served
        if run_url:
            refuse_credentials(run_url, what="--run-url")
            if not run_url.startswith(f"s3://{LOCAL_S3_BUCKET}/"):
                raise fail(f"--run-url {run_url} is not in the local-s3 store: leave it "
                           f"out, or give s3://{LOCAL_S3_BUCKET}/<path>")
        if not continue_from:
            load_config(config, overrides)
    except user_errors() as exc:
        raise fail(str(exc)) from None
    with local_s3() as served:
        console.print(describe(served), highlight=False)
        _start(config, overrides, run_url, chosen, nproc, continue_from, extra_steps, no_eval,
               verbose, hints=[("local-s3", read_back_hint(served))])


def _reach_prefect(backend: Backend) -> None:
    """A ``PREFECT_API_URL`` no server answers: one line, before anything is written
    (the flow would fail only after the dataset and the run were created)."""
    from flows.server import api_unreachable  # noqa: PLC0415

    url = os.environ.get("PREFECT_API_URL")
    why = api_unreachable(url) if url else None
    if why:
        todo = ("start that server (prefect server start) or point PREFECT_API_URL at a "
                "running one" if backend is Backend.deployments else
                "unset PREFECT_API_URL to use a temporary local server, or start that "
                "server (prefect server start)")
        raise fail(f"PREFECT_API_URL={url}: no Prefect API answers ({why}); {todo}")


def _store_override(overrides: list[str]) -> str | None:
    """The value of the last ``store=...`` override, if any."""
    found = None
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key.strip() == "store":
            found = value.strip()
    return found


def _start(config: str, overrides: list[str], run_url: str | None, backend: Backend,
           nproc: int, continue_from: str | None, extra_steps: int | None, no_eval: bool,
           verbose: bool, hints: list[tuple[str, str]] | None = None) -> None:
    """Resolve the run (its config, URL and dataset), then drive it."""
    # torch (see the package docstring)
    from storage.reach import reach_store  # noqa: PLC0415
    from workers.config import load_config  # noqa: PLC0415
    from workers.locate import absolute, new_run_url, resolve_run  # noqa: PLC0415
    from workers.runs import continuation, ensure_dataset  # noqa: PLC0415

    try:
        for value, what in ((run_url, "--run-url"), (continue_from, "--continue-from")):
            if value:
                refuse_credentials(value, what=what)
        if continue_from:
            parent = resolve_run(continue_from)
            cfg = continuation(parent, overrides, extra_steps)
        else:
            if extra_steps is not None:
                raise fail("--extra-steps goes with --continue-from; use --set train.steps=N")
            cfg = load_config(config, overrides)
        reach_store(absolute(run_url) if run_url else cfg.store,
                    what="--run-url" if run_url else "store")
        url = absolute(run_url) if run_url else new_run_url(cfg)
        if _exists(url):
            raise fail(f"a run already exists at {url}; continue it with: diloco resume "
                       f"{shown(url)}, or choose another --run-url")
    except user_errors() as exc:
        raise fail(str(exc)) from None
    dataset = cfg.dataset_url(url)
    try:
        with console.status(f"preparing the dataset {shown(dataset)} ..."):
            ensure_dataset(cfg, url)
    except (*user_errors(), StoreError, OSError) as exc:
        raise fail(f"cannot prepare the dataset {shown(dataset)}: {exc}") from None
    flow_kwargs: dict[str, Any] = {"backend": backend.value, "nproc": nproc,
                                   "evaluate": not no_eval}
    if continue_from:
        flow_kwargs.update(resume_run=parent, extra_steps=extra_steps, overrides=overrides)
    else:
        flow_kwargs["config"] = cfg.model_dump(mode="json")
    _drive(run_url=url, flow_kwargs=flow_kwargs, resume=False, verbose=verbose, hints=hints)


def _exists(url: str) -> bool:
    from diloco.run import open_run  # noqa: PLC0415 - torch
    from storage.reach import REACH_POLICY  # noqa: PLC0415

    try:
        open_run(url, retry=REACH_POLICY)
        return True
    except Exception:  # noqa: BLE001
        return False


def open_named_run(run: str) -> tuple[str, Any]:
    """A run named on the command line: (its URL, its exchange); a clear error if the
    name resolves to nothing, the store is unreachable or holds no run."""
    from diloco.run import open_run  # noqa: PLC0415 - torch
    from storage.reach import REACH_POLICY  # noqa: PLC0415
    from workers.locate import resolve_run  # noqa: PLC0415

    try:
        url = resolve_run(run)
        return url, open_run(url, retry=REACH_POLICY)
    except user_errors() as exc:
        raise fail(str(exc)) from None


def _age(iso: str | None) -> float:
    """Seconds since an ISO time (infinite if there is none)."""
    if not iso:
        return float("inf")
    try:
        return (datetime.now(UTC) - datetime.fromisoformat(iso)).total_seconds()
    except ValueError:
        return float("inf")


def resume(
    run: Annotated[str, typer.Argument(help="a run URL, or a run's name under runs/")],
    backend: Annotated[str, typer.Option(
        metavar="local|deployments", help="how to launch the jobs")] = Backend.local.value,
    nproc: Annotated[int, typer.Option(min=1, help="processes per worker island")] = 1,
    force: Annotated[bool, typer.Option(
        help="resume even if some job reported progress in the last minute")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Prefect's logs too")] = False,
) -> None:
    """Continue a stopped run from its checkpoints (after cancel, a crash or Ctrl-C)."""
    quiet_logs(verbose)
    chosen = backend_named(backend)
    url, exchange = open_named_run(run)
    snap = snapshot(exchange)
    parties = [*snap["workers"].values(), snap["aggregator"]]
    alive = live_local_jobs(read_launcher(exchange.store) or {})
    recent = [p["name"] for p in parties if p.get("state") == "running"
              and _age(p.get("updated")) < 60]
    if alive or (recent and not force):
        who = ", ".join(f"{n} (pid {pid})" for n, pid in alive.items()) or ", ".join(recent)
        raise fail(f"{shown(url)} is still running ({who}); stop it first with: diloco "
                   f"cancel {run}" + ("" if alive else "  (or --force if those jobs are gone)"))
    if all(p.get("state") == "finished" for p in parties):
        raise fail(f"{shown(url)} has finished; there is nothing to resume (see: diloco "
                   f"status {run}, or start a new run from it: diloco run --continue-from "
                   f"{run})")
    _reach_prefect(chosen)
    if cancel_request(exchange.store):
        console.print("withdrawing the cancel request")
    _drive(run_url=url, flow_kwargs={"backend": chosen.value, "nproc": nproc}, resume=True,
           verbose=verbose)
