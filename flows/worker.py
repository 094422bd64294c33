"""The `worker` flow: one worker of a run as a Prefect flow run, in the region of the
work pool that runs it (deployments name it ``flows/worker.py:worker``).

The job itself, `run_worker_job`, is in flows/worker_job.py, which imports no
Prefect: the local launcher starts that module, and each job process is spared the
second of CPU Prefect's import costs. ``python -m flows.worker`` runs the same job.
"""

from __future__ import annotations

import sys

from prefect import flow
from prefect.states import Cancelled

from flows.jobs import refuse_secret_parameters, run_id_of
from flows.worker_job import main, run_worker_job

__all__ = ["main", "run_worker_job", "worker", "worker_run_name"]


def worker_run_name() -> str:
    """``<run id>/<worker>``: the name of a worker's flow run."""
    from prefect.runtime import flow_run  # noqa: PLC0415

    params = flow_run.parameters or {}
    return f"{run_id_of(params.get('run_url'))}/{params.get('worker')}"


@flow(name="worker", log_prints=True, flow_run_name=worker_run_name)
def worker(run_url: str, worker: str, storage_options: dict | None = None, nproc: int = 1,
           join: bool = False, claim: str | None = None):
    """One worker of a run, in this work pool's region: trains to the end, resuming
    from its checkpoints; a cancelled flow run checkpoints before it stops.
    ``join=True`` adds a worker of a new name to the running run (``claim``: its
    membership record's id, so a retried flow run is the same joiner); a worker
    that leaves the run (``diloco leave``) ends Completed with state ``left``."""
    refuse_secret_parameters(storage_options)
    out = run_worker_job(run_url, worker, storage_options, nproc, join=join, claim=claim)
    if out["state"] not in ("finished", "left"):
        return Cancelled(message=f"worker {worker} {out['state']} after step "
                                 f"{out.get('steps', out.get('step'))}; checkpoint saved")
    return out


if __name__ == "__main__":
    sys.exit(main())
