"""Stopping a run from any machine: the request, the flow runs, the wait, the kill.

``diloco cancel`` runs in another process than the one that launched the jobs, so
it stops them through what the run's store records (`flows.control`): the cancel
request every job polls, and the launcher record (local PIDs with their command
lines, or Prefect flow-run ids). In order:

1. `flows.control.request_cancel`: every job checkpoints at its next step and exits;
2. `cancel_deployment_jobs`: jobs launched as Prefect deployments are set to
   Cancelling (Prefect does not cancel ``run_deployment`` children by itself);
3. `wait_until_stopped`: until no recorded job is alive and no party (workers,
   the aggregator and its other shards) reports ``running``;
4. `kill_local_jobs`: whatever local job is still alive after the timeout is killed
   with its process group, exactly as `LocalLauncher.stop` kills a job that ignores
   SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import psutil

from flows.launchers import cancel_flow_runs, kill_job
from flows.shard_status import shard_state, shard_statuses, silent_for
from storage.exchange import Exchange
from workers.report import snapshot


def _on_this_host(record: dict[str, Any]) -> bool:
    return record.get("backend") == "local" and record.get("host") == socket.gethostname()


def live_local_jobs(record: dict[str, Any]) -> dict[str, int]:
    """The launcher record's local jobs that are alive on this host, by name -> PID.

    A PID counts only if its process still runs the recorded command line, so a
    recycled PID is never taken for a job."""
    if not _on_this_host(record):
        return {}
    alive = {}
    for name, job in record.get("jobs", {}).items():
        pid = job.get("pid")
        if not isinstance(pid, int):
            continue
        try:
            cmdline = [a for a in psutil.Process(pid).cmdline() if a]
        except (psutil.Error, OSError):
            continue
        if cmdline == job.get("command"):
            alive[name] = pid
    return alive


def cancel_deployment_jobs(record: dict[str, Any], message: str) -> list[str]:
    """Set the recorded flow runs of a deployments launch to Cancelling; returns the
    ids it changed (none for a local launch)."""
    if record.get("backend") != "deployments":
        return []
    return cancel_flow_runs([j["flow_run"] for j in record.get("jobs", {}).values()
                             if j.get("flow_run")], message)


def still_running(exchange: Exchange, record: dict[str, Any]) -> bool:
    """Whether any job of the run may still be working."""
    if live_local_jobs(record):
        return True
    if _on_this_host(record):
        return False  # their processes are gone, whatever the status says
    snap = snapshot(exchange)
    parties = [*snap["workers"].values(), snap["aggregator"]]
    # a sharded aggregator's other shards too; one silent for several heartbeats
    # has died without saying so, and waiting for it would only run out the timeout
    parties += [st for st in shard_statuses(exchange).values() if silent_for(st) is None]
    return any(p.get("state") == "running" for p in parties)


def wait_until_stopped(exchange: Exchange, record: dict[str, Any], timeout: float,
                       poll: float = 1.0) -> bool:
    """Wait at most ``timeout`` seconds for every job to stop; True if they did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not still_running(exchange, record):
            return True
        time.sleep(poll)
    return not still_running(exchange, record)


def kill_local_jobs(record: dict[str, Any],
                    on_kill: Callable[[str, int], None] | None = None) -> list[str]:
    """SIGKILL the process group of every recorded local job still alive."""
    killed = []
    for name, pid in live_local_jobs(record).items():
        if on_kill is not None:
            on_kill(name, pid)
        with contextlib.suppress(PermissionError):
            kill_job(pid, signal.SIGKILL, group=True)
        killed.append(name)
    return killed


def party_states(exchange: Exchange) -> dict[str, str]:
    """Each worker's, the aggregator's and its other shards' state, as their status
    boards have it (a shard that went silent while running is shown as silent)."""
    snap = snapshot(exchange)
    states = {w: s.get("state", "not started") for w, s in snap["workers"].items()}
    states["aggregator"] = snap["aggregator"].get("state", "not started")
    for name, st in shard_statuses(exchange).items():
        states[name] = shard_state(st)
    return states


def prefect_reachable() -> bool:
    """Whether this process is pointed at a Prefect server (the flow runs of a
    deployments launch can only be cancelled through one)."""
    return bool(os.environ.get("PREFECT_API_URL"))
