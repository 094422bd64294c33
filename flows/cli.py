"""The ``diloco`` command: run, follow, resume, cancel and deploy training runs.

    diloco run                          # the embedded default: tiny recipe, two local "regions"
    diloco run configs/small.yaml --set train.steps=2000
    diloco status tiny-20260101-120000  # a run URL, or a run's name under runs/
    diloco resume tiny-20260101-120000
    diloco cancel tiny-20260101-120000
    diloco deploy                       # infra/prefect.yaml on $PREFECT_API_URL
    diloco prepare-data builtin:shakespeare --out runs/data/shakespeare

Errors a user can act on are one line on stderr and exit status 2; nothing is
launched. A run that fails exits 1, a cancelled one 3, Ctrl-C 130.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

HELP = """Train one language model across regions with Streaming DiLoCo.

\b
  diloco run                   the embedded default: tiny recipe, two local "regions"
  diloco run small --set train.steps=2000
  diloco status RUN            RUN: a run URL, or a run's name under runs/
  diloco resume RUN
  diloco cancel RUN
  diloco deploy                infra/prefect.yaml on $PREFECT_API_URL
  diloco prepare-data builtin:shakespeare --out runs/data/shakespeare

Errors you can act on print one line and exit with status 2 (nothing is launched);
a failed run exits 1, a cancelled one 3, Ctrl-C 130.
"""

app = typer.Typer(
    name="diloco", help=HELP, no_args_is_help=True, add_completion=False,
    rich_markup_mode=None, pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
# In a terminal, its width; piped (CI, tests, logs), wide enough for the tables.
console = Console(width=None if sys.stdout.isatty() else 110)
errors = Console(stderr=True, width=None if sys.stderr.isatty() else 110)

EXIT_FAILED, EXIT_USAGE, EXIT_CANCELLED, EXIT_INTERRUPTED = 1, 2, 3, 130


class Backend(StrEnum):
    local = "local"
    deployments = "deployments"


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    errors.print(f"[bold red]error:[/] {message}", highlight=False, markup=True,
                 soft_wrap=True)
    return typer.Exit(code)


def _user_errors() -> tuple[type[BaseException], ...]:
    """The errors that are the user's to fix: one message, exit 2."""
    from flows.deploy import DeployError  # noqa: PLC0415
    from flows.launchers import LaunchError  # noqa: PLC0415
    from flows.runs import RunNotFound, StoreUnreachable  # noqa: PLC0415
    from storage.errors import ManifestInvalid, RunExists  # noqa: PLC0415
    from workers.config import ConfigError  # noqa: PLC0415
    from workers.data import DataError  # noqa: PLC0415

    return (ConfigError, RunNotFound, StoreUnreachable, RunExists, ManifestInvalid, DataError,
            DeployError, LaunchError)


def _quiet_logs(verbose: bool) -> None:
    """Before Prefect and MLflow are imported: their INFO lines would tear through
    the progress bars. The temporary server of the embedded default sends no
    telemetry (it would only print errors on machines without internet access)."""
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if verbose else "ERROR")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    if not os.environ.get("PREFECT_API_URL"):
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        # The temporary server needs more than Prefect's default 20 s to start on a
        # busy two-core machine; a slow start must not fail the run.
        os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def _shown(url: str) -> str:
    """A local run path relative to the working directory when it is under it."""
    if "://" in url:
        return url
    try:
        return str(Path(url).relative_to(Path.cwd()))
    except ValueError:
        return url


def _mlflow_hint() -> str:
    if os.environ.get("DILOCO_TRACKING", "").lower() in ("off", "0", "false", "no"):
        return "tracking off (DILOCO_TRACKING=off)"
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri and not uri.startswith("sqlite:"):
        return uri
    return f"mlflow ui --backend-store-uri {uri or 'sqlite:///mlflow.db'}"


def _prefect_hint() -> str:
    url = os.environ.get("PREFECT_API_URL")
    return url.removesuffix("/api") if url else "temporary local server"


# -- run and resume --------------------------------------------------------------------


def _drive(*, run_url: str, flow_kwargs: dict[str, Any], resume: bool, verbose: bool,
           storage_options: dict | None = None) -> None:
    """Run the train flow with a live display, then print the figures."""
    _quiet_logs(verbose)
    from flows.progress import LiveProgress, print_report  # noqa: PLC0415
    from flows.report import build_report  # noqa: PLC0415
    from flows.runs import open_run  # noqa: PLC0415
    from flows.train import train  # noqa: PLC0415

    start = time.monotonic()
    shown = _shown(run_url)
    console.print(f"[bold]{'resuming' if resume else 'training'}[/] {shown}  "
                  f"(Prefect: {_prefect_hint()})", highlight=False)
    live = LiveProgress(lambda: open_run(run_url, storage_options), console)
    state = None
    try:
        with live:
            state = train(run_url=run_url, resume=resume, storage_options=storage_options,
                          return_state=True, **flow_kwargs)
    except KeyboardInterrupt:
        errors.print(f"\ninterrupted: the jobs saved their checkpoints. Continue with:\n"
                     f"  diloco resume {shown}")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    try:
        exchange = open_run(run_url, storage_options)
    except Exception:  # noqa: BLE001 - it failed before the run was created
        exchange = None
    if state is not None and state.is_failed() and exchange is None:
        raise fail(_state_message(state))
    outcome = ("finished" if state.is_completed() else
               "cancelled" if state.is_cancelled() else "failed")
    report = build_report(exchange, run_url=run_url, state=outcome,
                          wall_seconds=time.monotonic() - start,
                          message="" if outcome == "finished" else _state_message(state))
    print_report(console, report, initial_eval=_initial_eval(exchange),
                 where=[("store", shown), ("status", f"diloco status {_run_ref(run_url)}"),
                        ("MLflow", _mlflow_hint()), ("Prefect", _prefect_hint())]
                 + ([("resume", f"diloco resume {_run_ref(run_url)}")]
                    if outcome != "finished" else []))
    if outcome == "failed":
        raise typer.Exit(EXIT_FAILED)
    if outcome == "cancelled":
        raise typer.Exit(EXIT_CANCELLED)


def _state_message(state: Any) -> str:
    message = state.message or state.type.value
    return message.removeprefix("Flow run encountered an exception: ")


def _initial_eval(exchange: Any) -> float | None:
    from workers.status import read_status  # noqa: PLC0415

    return (read_status(exchange.store, "aggregator") or {}).get("initial_eval_loss")


def _run_ref(run_url: str) -> str:
    """How to name the run on the command line: its name if it is under runs/."""
    from flows.runs import DEFAULT_STORE  # noqa: PLC0415

    if "://" not in run_url and Path(run_url).parent == Path(DEFAULT_STORE).resolve():
        return Path(run_url).name
    return _shown(run_url)


@app.command()
def run(
    config: Annotated[str, typer.Argument(
        help="a recipe in configs/ (tiny, small, gpu-150m, gpu-1b) or a YAML file")] = "tiny",
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", metavar="KEY=VALUE",
        help="override a config field, e.g. --set train.steps=100 (repeatable)")] = None,
    run_url: Annotated[str | None, typer.Option(
        "--run-url", help="where the run lives (default: <store>/<name>-<time>)")] = None,
    backend: Annotated[Backend, typer.Option(
        help="local: worker processes on this machine; deployments: Prefect deployments "
             "of each region's work pool (see diloco deploy)")] = Backend.local,
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
    Prefect without a server to install, MLflow on SQLite (mlflow.db).
    """
    _quiet_logs(verbose)
    from flows.runs import absolute, new_run_url, reach_store, resolve_run  # noqa: PLC0415
    from storage.errors import StoreError  # noqa: PLC0415
    from workers.config import load_config  # noqa: PLC0415
    from workers.runs import ensure_dataset  # noqa: PLC0415

    try:
        if continue_from:
            from flows.train import continuation  # noqa: PLC0415

            parent = resolve_run(continue_from)
            cfg = continuation(parent, overrides, extra_steps)
        else:
            if extra_steps is not None:
                raise fail("--extra-steps goes with --continue-from; use --set train.steps=N")
            cfg = load_config(config, overrides)
        reach_store(absolute(run_url) if run_url else cfg.store)
        url = absolute(run_url) if run_url else new_run_url(cfg)
        if _exists(url):
            raise fail(f"a run already exists at {url}; continue it with: diloco resume "
                       f"{_shown(url)}, or choose another --run-url")
    except _user_errors() as exc:
        raise fail(str(exc)) from None
    dataset = cfg.dataset_url(url)
    try:
        with console.status(f"preparing the dataset {_shown(dataset)} ..."):
            ensure_dataset(cfg, url)
    except (*_user_errors(), StoreError, OSError) as exc:
        raise fail(f"cannot prepare the dataset {_shown(dataset)}: {exc}") from None
    flow_kwargs: dict[str, Any] = {"backend": backend.value, "nproc": nproc,
                                   "evaluate": not no_eval}
    if continue_from:
        flow_kwargs.update(resume_run=parent, extra_steps=extra_steps, overrides=overrides)
    else:
        flow_kwargs["config"] = cfg.model_dump(mode="json")
    _drive(run_url=url, flow_kwargs=flow_kwargs, resume=False, verbose=verbose)


def _exists(url: str) -> bool:
    from flows.runs import open_run  # noqa: PLC0415

    try:
        open_run(url)
        return True
    except Exception:  # noqa: BLE001
        return False


@app.command()
def resume(
    run: Annotated[str, typer.Argument(help="a run URL, or a run's name under runs/")],
    backend: Annotated[Backend, typer.Option(help="how to launch the jobs")] = Backend.local,
    nproc: Annotated[int, typer.Option(min=1, help="processes per worker island")] = 1,
    force: Annotated[bool, typer.Option(
        help="resume even if some job reported progress in the last minute")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Prefect's logs too")] = False,
) -> None:
    """Continue a stopped run from its checkpoints (after cancel, a crash or Ctrl-C)."""
    _quiet_logs(verbose)
    from flows.control import cancel_request, clear_cancel, read_launcher  # noqa: PLC0415
    from flows.progress import print_report  # noqa: PLC0415
    from flows.report import build_report, snapshot  # noqa: PLC0415

    url, exchange = _open_run(run)
    snap = snapshot(exchange)
    parties = [*snap["workers"].values(), snap["aggregator"]]
    alive = _local_pids(read_launcher(exchange.store) or {})
    recent = [p["name"] for p in parties if p.get("state") == "running"
              and _age(p.get("updated")) < 60]
    if alive or (recent and not force):
        who = ", ".join(f"{n} (pid {pid})" for n, pid in alive.items()) or ", ".join(recent)
        raise fail(f"{_shown(url)} is still running ({who}); stop it first with: diloco "
                   f"cancel {run}" + ("" if alive else "  (or --force if those jobs are gone)"))
    if cancel_request(exchange.store):
        console.print("withdrawing the cancel request")
    if all(p.get("state") == "finished" for p in parties):
        clear_cancel(exchange.store)
        console.print(f"{_shown(url)} has already finished; nothing to resume")
        print_report(console, build_report(exchange, run_url=url, state="finished",
                                           wall_seconds=0.0),
                     initial_eval=_initial_eval(exchange),
                     where=[("store", _shown(url)), ("MLflow", _mlflow_hint())])
        return
    _drive(run_url=url, flow_kwargs={"backend": backend.value, "nproc": nproc}, resume=True,
           verbose=verbose)


# -- status and cancel -----------------------------------------------------------------


def _open_run(run: str) -> tuple[str, Any]:
    """A run named on the command line: (its URL, its exchange); a clear error if the
    name resolves to nothing, the store is unreachable or holds no run."""
    from flows.runs import open_run, reach_store, resolve_run  # noqa: PLC0415

    try:
        url = resolve_run(run)
        reach_store(url)
        return url, open_run(url)
    except _user_errors() as exc:
        raise fail(str(exc)) from None


@app.command()
def status(
    run: Annotated[str, typer.Argument(help="a run URL, or a run's name under runs/")],
    as_json: Annotated[bool, typer.Option("--json", help="print the status as JSON")] = False,
) -> None:
    """Every party's progress, read from the run's store."""
    from flows.control import cancel_request, read_launcher  # noqa: PLC0415
    from flows.progress import print_status  # noqa: PLC0415
    from flows.report import snapshot  # noqa: PLC0415

    url, exchange = _open_run(run)
    launcher, cancel = read_launcher(exchange.store), cancel_request(exchange.store)
    if as_json:
        print(json.dumps({"run_url": url, **snapshot(exchange), "launcher": launcher,
                          "cancel": cancel}, indent=1, default=str))
        return
    print_status(console, exchange, _shown(url), launcher, cancel)


@app.command()
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
    from flows.control import read_launcher, request_cancel  # noqa: PLC0415
    from flows.report import snapshot  # noqa: PLC0415

    url, exchange = _open_run(run)
    request = request_cancel(exchange.store, reason)
    console.print(f"cancel requested ({request['requested'][:19]}, by {request['by']})")
    launcher = read_launcher(exchange.store) or {}
    jobs = launcher.get("jobs", {})
    if launcher.get("backend") == "deployments" and os.environ.get("PREFECT_API_URL"):
        _quiet_logs(False)
        from flows.launchers import cancel_flow_runs  # noqa: PLC0415

        changed = cancel_flow_runs([j["flow_run"] for j in jobs.values()], "diloco cancel")
        console.print(f"set {len(changed)} flow runs to Cancelling")
    if not wait:
        return
    deadline = time.monotonic() + timeout
    with console.status("waiting for the jobs to checkpoint and stop ..."):
        while time.monotonic() < deadline:
            if not _still_running(snapshot(exchange), launcher):
                break
            time.sleep(1.0)
        else:
            _force_stop(launcher)
    snap = snapshot(exchange)
    states = {w: s.get("state", "not started") for w, s in snap["workers"].items()}
    states["aggregator"] = snap["aggregator"].get("state", "not started")
    console.print("stopped: " + ", ".join(f"{n} {s}" for n, s in states.items()))
    console.print(f"continue with: diloco resume {run}")


def _local_pids(launcher: dict) -> dict[str, int]:
    """The launcher's local job PIDs that are alive on this host and still ours."""
    if launcher.get("backend") != "local" or launcher.get("host") != socket.gethostname():
        return {}
    alive = {}
    for name, job in launcher.get("jobs", {}).items():
        pid = job.get("pid")
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if [a.decode(errors="replace") for a in cmdline if a] == job.get("command"):
            alive[name] = pid  # the same command: not a recycled PID
    return alive


def _age(iso: str | None) -> float:
    """Seconds since an ISO time (infinite if there is none)."""
    from datetime import UTC, datetime  # noqa: PLC0415

    if not iso:
        return float("inf")
    try:
        return (datetime.now(UTC) - datetime.fromisoformat(iso)).total_seconds()
    except ValueError:
        return float("inf")


def _still_running(snap: dict, launcher: dict) -> bool:
    if _local_pids(launcher):
        return True
    parties = [*snap["workers"].values(), snap["aggregator"]]
    if launcher.get("backend") == "local" and launcher.get("host") == socket.gethostname():
        return False  # their processes are gone, whatever the status says
    return any(p.get("state") == "running" for p in parties)


def _force_stop(launcher: dict) -> None:
    for name, pid in _local_pids(launcher).items():
        errors.print(f"{name} (pid {pid}) did not stop in time; killing it")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


# -- deploy and data ---------------------------------------------------------------


@app.command()
def deploy(
    prefect_file: Annotated[Path, typer.Option(
        "--file", help="the deployments file")] = Path("infra/prefect.yaml"),
    names: Annotated[list[str] | None, typer.Option(
        "--name", help="deploy only these deployments (repeatable)")] = None,
    create_pools: Annotated[bool, typer.Option(
        help="create the work pools the file names when missing")] = True,
    pool_type: Annotated[str, typer.Option(
        help="type of the pools it creates (process, docker, kubernetes...)")] = "process",
) -> None:
    """Create the deployments of infra/prefect.yaml (train, a worker per region,
    aggregator) on the Prefect server at $PREFECT_API_URL."""
    from flows import deploy as deploying  # noqa: PLC0415

    path = prefect_file
    if not path.exists() and not path.is_absolute():
        path = deploying.PREFECT_FILE
    try:
        with console.status(f"deploying {path} ..."):
            done = deploying.deploy(path, names=names, create_pools=create_pools, pool_type=pool_type)
    except _user_errors() as exc:
        raise fail(str(exc)) from None
    if done["created_pools"]:
        console.print(f"created work pools: {', '.join(done['created_pools'])}")
    console.print(f"deployments: {', '.join(done['deployments'])} (pools: "
                  f"{', '.join(done['pools'])})")
    console.print("start a worker per pool: " + "; ".join(
        f"prefect worker start --pool {p}" for p in done["pools"]))


@app.command("prepare-data")
def prepare_data(
    sources: Annotated[list[str], typer.Argument(
        help="files, folders, glob patterns, fsspec URLs, or builtin:shakespeare[/part]")],
    out: Annotated[str, typer.Option(help="the dataset's URL: a path, file://, s3://...")],
    tokenizer: Annotated[str, typer.Option(
        help="'byte', or a Hugging Face tokenizers .json file")] = "byte",
    val_fraction: Annotated[float, typer.Option(
        help="fraction of each file's tokens held out for validation")] = 0.01,
    max_files: Annotated[int | None, typer.Option(help="read only the first N files")] = None,
    max_bytes: Annotated[int | None, typer.Option(help="stop after N bytes of text")] = None,
) -> None:
    """Tokenise text into a dataset in a store (what a run's data.dataset points at)."""
    from rich.progress import Progress  # noqa: PLC0415

    from workers.data import prepare_data as prepare  # noqa: PLC0415

    try:
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("tokenising", total=None)

            def show(name: str, done: int, total: int) -> None:
                bar.update(task, completed=done, total=total, description=name[-40:])

            info = prepare(sources, out, tokenizer=tokenizer, val_fraction=val_fraction,
                           progress=show, max_files=max_files, max_bytes=max_bytes)
    except (*_user_errors(), ValueError, OSError, ImportError) as exc:
        raise fail(str(exc)) from None
    console.print(f"dataset {info.url}: {info.files} files, {info.bytes_read:,} bytes of text, "
                  f"{info.train_tokens:,} train and {info.val_tokens:,} val tokens "
                  f"({info.seconds:.1f} s)")
    console.print(f"use it with: diloco run --set data.dataset={info.url}")


# -- bench -----------------------------------------------------------------------------

BENCHMARKS = ("codecs", "exchange", "quality", "traffic", "bandwidth")


def _benchmarks_root() -> Path:
    """The checkout holding benchmarks/ (it is not part of the installed package)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "run_all.py").exists():
        raise fail("diloco bench runs from a source checkout: benchmarks/ was not found "
                   f"beside {Path(__file__).resolve().parent}")
    return root


@app.command()
def bench(
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
    tokens, traffic, and compute utilisation under capped bandwidth (root).

    Each benchmark runs as its own process, one after the other; each writes JSON
    and Markdown, and benchmarks/results/summary.md gathers them. A full run takes
    hours on two cores; --quick checks that everything works in a few minutes."""
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown or not names:
        raise fail(f"--only: unknown {', '.join(unknown) or '(empty)'}; allowed: "
                   f"{', '.join(BENCHMARKS)}")
    root = _benchmarks_root()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from benchmarks import run_all  # noqa: PLC0415

    argv = ["--only", ",".join(names)]
    if quick:
        argv.append("--quick")
    if not mlflow:
        argv.append("--no-mlflow")
    if results_dir is not None:
        argv += ["--results-dir", str(results_dir)]
    code = run_all.main(argv)
    if code:
        raise typer.Exit(EXIT_FAILED)


# -- compare ---------------------------------------------------------------------------


def add_compare_command(cli: typer.Typer) -> None:
    """``diloco compare`` (runs side by side in MLflow) comes from flows/compare.py,
    written separately; it is registered here when that module provides
    ``compare_command``."""
    try:
        from flows.compare import compare_command  # noqa: PLC0415
    except ImportError:
        return
    cli.command("compare")(compare_command)


add_compare_command(app)


def main() -> None:  # pragma: no cover - the console script calls app()
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
