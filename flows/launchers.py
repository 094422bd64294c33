"""Launching a run's jobs: one interface, two backends.

- `LocalLauncher`: the jobs are child processes of this one on this machine
  (``python -m flows.worker_job`` / ``python -m flows.aggregator_job``: the jobs of
  the flows, without importing Prefect), started with subprocess (never fork: s3fs
  is not fork-safe), each in its own session so that stopping one stops its
  torchrun ranks too. Their output goes to ``<run>/logs/<job>.log`` for a local
  store, else to a temporary folder. They need no Prefect API.
- `DeploymentLauncher`: each job is a flow run of a deployment, created with
  ``run_deployment(..., timeout=0)`` (not waiting) and an idempotency key, so a
  retried parent never launches a job twice: the workers on ``worker/<worker>`` (the
  deployment in that region's work pool), the aggregator on ``aggregator/aggregator``.
  Stopping sets the flow runs to Cancelling, which Prefect does not do by itself
  for `run_deployment` children of a cancelled parent. Flow-run parameters land
  in Prefect's database: credentials in ``storage_options`` are refused.

Job states, as `poll` reports them: ``running``, ``finished``, ``stopped`` (ended
after a stop request or a signal, checkpoint saved) and ``failed``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

from flows.jobs import EXIT_FINISHED, EXIT_STOPPED
from storage.backends import USE_THE_ENVIRONMENT, refuse_credentials, secret_options

log = logging.getLogger(__name__)

AGGREGATOR = "aggregator"
#: the jobs of a sharded aggregator's shards 1..K-1 (shard 0 is ``aggregator``)
SHARD_JOB = "aggregator-s"


def shard_of(name: str) -> int | None:
    """The shard a job name runs (``aggregator-s2``: 2), None for another job."""
    if name.startswith(SHARD_JOB) and name[len(SHARD_JOB):].isdigit():
        return int(name[len(SHARD_JOB):])
    return None


class LaunchError(Exception):
    """A job could not be launched."""


class Launcher(Protocol):
    backend: str

    def start(self, run_url: str, name: str, *, join: bool = False,
              claim: str | None = None) -> None:
        """Launch the job ``name``: a worker's name, or ``aggregator``; ``join``: a
        worker joining the running run (``claim``: its membership record's id)."""

    def poll(self) -> dict[str, str]:
        """The state of every job launched so far."""

    def stop(self, names: list[str], grace: float) -> None:
        """Ask the jobs to stop (they checkpoint); force them after ``grace`` s."""

    def record(self) -> dict[str, Any]:
        """What ``members/launcher.json`` keeps about the jobs."""

    def where(self, name: str) -> str:
        """Where to look for a job's output."""


def _local_dir(run_url: str) -> Path | None:
    if "://" not in run_url:
        return Path(run_url)
    if run_url.startswith("file://"):
        return Path(run_url.removeprefix("file://"))
    return None


class LocalLauncher:
    """Jobs as child processes on this machine."""

    backend = "local"

    def __init__(self, *, storage_options: dict | None = None, nproc: int = 1,
                 log_dir: str | Path | None = None, evaluate: bool = True,
                 env: dict[str, str] | None = None, detached: bool = False):
        """``detached``: the jobs outlive this process (``diloco join`` starts one
        and exits): no ``--exit-with-parent``."""
        self.detached = detached
        self.storage_options = storage_options
        self.nproc = nproc
        self.log_dir = Path(log_dir) if log_dir else None
        self.evaluate = evaluate
        self.env = env or {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, list[str]] = {}
        self.logs: dict[str, Path] = {}
        self.exited: dict[str, int] = {}

    def _logs_for(self, run_url: str) -> Path:
        if self.log_dir is None:
            local = _local_dir(run_url)
            run_id = run_url.rstrip("/").rsplit("/", 1)[-1]
            self.log_dir = (local / "logs" if local is not None
                            else Path(tempfile.gettempdir()) / "diloco-logs" / run_id)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self.log_dir

    def command(self, run_url: str, name: str, *, join: bool = False,
                claim: str | None = None) -> list[str]:
        if name == AGGREGATOR:
            cmd = [sys.executable, "-m", "flows.aggregator_job", "--run", run_url]
            if not self.evaluate:
                cmd.append("--no-eval")
        elif shard_of(name):
            cmd = [sys.executable, "-m", "flows.aggregator_job", "--run", run_url,
                   "--shard", str(shard_of(name))]
        else:
            cmd = [sys.executable, "-m", "flows.worker_job", "--run", run_url, "--worker", name,
                   "--nproc", str(1 if join else self.nproc)]
            if join:
                cmd.append("--join")
            if claim:
                cmd += ["--claim", claim]
        return cmd if self.detached else [*cmd, "--exit-with-parent"]

    def start(self, run_url: str, name: str, *, join: bool = False,
              claim: str | None = None) -> None:
        cmd = (self.command(run_url, name, join=join, claim=claim) if join or claim
               else self.command(run_url, name))
        path = self._logs_for(run_url) / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        env.pop("DILOCO_LAUNCHER_PID", None)
        if not self.detached:  # --exit-with-parent: the job checks it before slow imports
            env["DILOCO_LAUNCHER_PID"] = str(os.getpid())
        if self.storage_options:  # never on the command line, where ps shows it
            env["DILOCO_STORAGE_OPTIONS"] = json.dumps(self.storage_options)
        with open(path, "ab") as out:
            try:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env,
                                        start_new_session=True)
            except OSError as exc:
                raise LaunchError(f"could not start {name}: {exc}") from exc
        self.procs[name], self.commands[name], self.logs[name] = proc, cmd, path
        self.exited.pop(name, None)
        log.info("started %s (pid %d), output in %s", name, proc.pid, path)

    def poll(self) -> dict[str, str]:
        out = {}
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is None:
                out[name] = "running"
                continue
            self.exited[name] = code
            if code == EXIT_FINISHED:
                out[name] = "finished"
            elif code in (EXIT_STOPPED, -signal.SIGTERM, -signal.SIGINT):
                out[name] = "stopped"
            else:
                out[name] = "failed"
        return out

    def stop(self, names: list[str], grace: float) -> None:
        running = {n: self.procs[n] for n in names
                   if n in self.procs and self.procs[n].poll() is None}
        for name, proc in running.items():
            log.info("stopping %s (pid %d)", name, proc.pid)
            kill_job(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for name, proc in running.items():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) did not stop within %.0f s; killing it", name,
                            proc.pid, grace)
                kill_job(proc.pid, signal.SIGKILL, group=True)
                proc.wait()

    def record(self) -> dict[str, Any]:
        return {"backend": self.backend, "jobs": {
            name: {"pid": proc.pid, "command": self.commands[name], "log": str(self.logs[name]),
                   "exit": proc.poll()}
            for name, proc in self.procs.items()}}

    def where(self, name: str) -> str:
        path = self.logs.get(name)
        if path is None:
            return ""
        tail = _tail(path)
        return f"output in {path}" + (f"; last lines:\n{tail}" if tail else "")


def kill_job(pid: int, sig: int, group: bool = False) -> None:
    """Send ``sig`` to a job's process (or its whole process group: torchrun and its
    ranks); a job that is already gone is not an error."""
    with contextlib.suppress(ProcessLookupError):
        (os.killpg if group else os.kill)(pid, sig)


def _tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in text[-lines:])


# -- Prefect deployments -------------------------------------------------------------------

_PREFECT_STATES = {
    "SCHEDULED": "running", "PENDING": "running", "RUNNING": "running", "PAUSED": "running",
    "CANCELLING": "running", "COMPLETED": "finished", "CANCELLED": "stopped",
    "FAILED": "failed", "CRASHED": "failed",
}


class DeploymentLauncher:
    """Jobs as flow runs of the worker deployment of each region's work pool.

    The parameters of a flow run are stored in Prefect's database and shown in its
    UI, so ``storage_options`` holding a credential (key, secret, token, password,
    ``aws_secret_access_key``..., nested ones such as ``client_kwargs`` included)
    are refused here, before anything is launched: each work pool's machines have
    their own credentials in their environment (the bucket policies give each
    role its own). The other options (an endpoint, a region) are passed on.
    """

    backend = "deployments"

    def __init__(self, *, key: str, worker_deployment: str = "worker/{worker}",
                 aggregator_deployment: str = "aggregator/aggregator",
                 storage_options: dict | None = None, nproc: int | None = None,
                 evaluate: bool = True):
        found = secret_options(storage_options)
        if found:
            raise LaunchError(f"{found[0]}: the deployments backend would store it in "
                              f"Prefect's database with the flow-run parameters; remove it "
                              f"and, on each work pool's machines, {USE_THE_ENVIRONMENT}")
        self.key = key
        self.worker_deployment = worker_deployment
        self.aggregator_deployment = aggregator_deployment
        self.storage_options = storage_options
        self.nproc = nproc
        self.evaluate = evaluate
        self.flow_runs: dict[str, str] = {}
        self.deployments: dict[str, str] = {}
        self.attempts: dict[str, int] = {}

    def deployment_for(self, name: str) -> str:
        if name == AGGREGATOR or shard_of(name):
            return self.aggregator_deployment
        return self.worker_deployment.format(worker=name)

    def parameters(self, run_url: str, name: str, *, join: bool = False,
                   claim: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"run_url": refuse_credentials(run_url, what="run_url")}
        if name == AGGREGATOR:
            if not self.evaluate:
                params["evaluate"] = False
        elif shard_of(name):
            params["shard"] = shard_of(name)
        else:
            params["worker"] = name
            if self.nproc and not join:
                params["nproc"] = self.nproc
            if join:
                params["join"] = True
            if claim:
                params["claim"] = claim
        if self.storage_options:
            params["storage_options"] = self.storage_options
        return params

    def start(self, run_url: str, name: str, *, join: bool = False,
              claim: str | None = None) -> None:
        from prefect.deployments import run_deployment  # noqa: PLC0415

        attempt = self.attempts.get(name, 0) + 1
        self.attempts[name] = attempt
        key = f"{self.key}:{name}" + (f":{attempt}" if attempt > 1 else "")
        deployment = self.deployment_for(name)
        run_id = run_url.rstrip("/").rsplit("/", 1)[-1]
        launch = _api_retrying(run_deployment)
        try:
            flow_run = launch(
                deployment, parameters=self.parameters(run_url, name, join=join, claim=claim),
                timeout=0,
                idempotency_key=key, flow_run_name=f"{run_id}/{name}",
                tags=["diloco", f"run:{run_id}"],
            )
        except Exception as exc:  # ObjectNotFound, unreachable API...
            raise LaunchError(f"could not launch {name} on deployment {deployment!r}: "
                              f"{type(exc).__name__}: {exc}") from exc
        self.flow_runs[name] = str(flow_run.id)
        self.deployments[name] = deployment
        log.info("launched %s: flow run %s of deployment %s", name, flow_run.id, deployment)

    def poll(self) -> dict[str, str]:
        from prefect import get_client  # noqa: PLC0415

        out = {}
        with get_client(sync_client=True) as client:
            for name, run_id in self.flow_runs.items():
                try:
                    state = client.read_flow_run(run_id).state
                except Exception as exc:  # noqa: BLE001 - the API may blink; the store is truth
                    log.debug("could not read flow run %s: %s", run_id, exc)
                    out[name] = "running"
                    continue
                out[name] = _PREFECT_STATES.get(state.type.value if state else "PENDING",
                                                "running")
        return out

    def stop(self, names: list[str], grace: float) -> None:
        """Cancelling: each flow run's Prefect worker stops its process (SIGTERM, then
        SIGKILL after its own grace period). This waits at most ``grace`` seconds,
        and less than the 30 s Prefect gives this flow's own process when it is
        the one being cancelled."""
        cancel_flow_runs([self.flow_runs[n] for n in names if n in self.flow_runs],
                         "the run was cancelled")
        wait = min(grace, 20.0)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            states = self.poll()
            if all(states.get(n) != "running" for n in names):
                return
            time.sleep(1.0)
        log.warning("flow runs still not stopped after %.0f s: %s", wait,
                    [n for n, s in self.poll().items() if s == "running" and n in names])

    def record(self) -> dict[str, Any]:
        return {"backend": self.backend, "key": self.key,
                "worker_deployment": self.worker_deployment, "jobs": {
            name: {"flow_run": run_id, "deployment": self.deployments[name]}
            for name, run_id in self.flow_runs.items()}}

    def where(self, name: str) -> str:
        run_id = self.flow_runs.get(name)
        return f"flow run {run_id} (prefect flow-run logs {run_id})" if run_id else ""


#: Tries of one launch against an API that answers 5xx or drops the connection, and
#: the first wait (doubled each time): about 14 s in all, on top of Prefect's client's
#: own retries of 429 and 503, which a server overloaded for longer (seen: a 503 that
#: failed a whole train run) outlasts.
LAUNCH_TRIES, LAUNCH_WAIT_S = 4, 2.0


def _transient(exc: BaseException) -> bool:
    """An API error worth another try: a 5xx answer, or no answer."""
    import httpx  # noqa: PLC0415 - Prefect's HTTP client

    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500
    return isinstance(exc, httpx.TransportError)


def _api_retrying(fn: Any) -> Any:
    """``fn`` retried while the API fails transiently (`_transient`). Safe for a
    launch: its idempotency key makes a second create return the first flow run."""
    from tenacity import (  # noqa: PLC0415
        retry,
        retry_if_exception,
        stop_after_attempt,
        wait_exponential,
    )

    def note(state: Any) -> None:
        log.warning("Prefect's API failed a launch (%s); try %d of %d",
                    state.outcome.exception(), state.attempt_number + 1, LAUNCH_TRIES)

    return retry(retry=retry_if_exception(_transient), stop=stop_after_attempt(LAUNCH_TRIES),
                 wait=wait_exponential(multiplier=LAUNCH_WAIT_S, max=8 * LAUNCH_WAIT_S),
                 before_sleep=note, reraise=True)(fn)


def cancel_flow_runs(flow_run_ids: list[str], message: str) -> list[str]:
    """Set every unfinished flow run to Cancelling (Cancelled if it never started);
    returns the ids it changed."""
    from prefect import get_client  # noqa: PLC0415
    from prefect.states import Cancelled, Cancelling  # noqa: PLC0415

    changed = []
    with get_client(sync_client=True) as client:
        for run_id in flow_run_ids:
            try:
                state = client.read_flow_run(run_id).state
                if state is None or state.is_final():
                    continue
                new = Cancelling(message=message) if state.is_running() or \
                    state.is_cancelling() else Cancelled(message=message)
                client.set_flow_run_state(run_id, new, force=True)
                changed.append(run_id)
            except Exception as exc:  # noqa: BLE001 - best effort; the store request stays
                log.warning("could not cancel flow run %s: %s", run_id, exc)
    return changed
