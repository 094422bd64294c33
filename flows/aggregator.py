"""The `aggregator` flow: the run's aggregator as a Prefect flow run (deployments
name it ``flows/aggregator.py:aggregator``).

The job itself (`run_aggregator_job`, and `run_shard_job` for the shards of a
sharded aggregator) is in flows/aggregator_job.py, which imports no Prefect: the
local launcher starts that module, and the job is spared the second of CPU
Prefect's import costs. ``python -m flows.aggregator`` runs the same job.
"""

from __future__ import annotations

import sys

from prefect import flow
from prefect.states import Cancelled

from flows.aggregator_job import NAME, main, run_aggregator_job, run_shard_job
from flows.jobs import refuse_secret_parameters, run_id_of

__all__ = ["aggregator", "aggregator_run_name", "main", "run_aggregator_job", "run_shard_job"]


def aggregator_run_name() -> str:
    """``<run id>/aggregator``: the name of the aggregator's flow run."""
    from prefect.runtime import flow_run  # noqa: PLC0415

    params = flow_run.parameters or {}
    shard = f"-s{params['shard']}" if params.get("shard") else ""
    return f"{run_id_of(params.get('run_url'))}/{NAME}{shard}"


@flow(name="aggregator", log_prints=True, flow_run_name=aggregator_run_name)
def aggregator(run_url: str, storage_options: dict | None = None, evaluate: bool = True,
               shard: int = 0):
    """The run's aggregator: reduces every round and steps the canonical model;
    restartable at any moment (it resumes from the store). ``shard`` >= 1: one more
    shard of a sharded aggregator (``aggregator.shards``), one flow run each."""
    refuse_secret_parameters(storage_options)
    if shard:
        out = run_shard_job(run_url, storage_options, shard=shard)
        if out["state"] != "finished":
            return Cancelled(message=f"aggregator shard {shard} {out['state']}")
        return out
    out = run_aggregator_job(run_url, storage_options, evaluate=evaluate)
    if out["state"] != "finished":
        return Cancelled(message=f"aggregator {out['state']} after {out['rounds']} of "
                                 f"{out['total_rounds']} rounds")
    return out


if __name__ == "__main__":
    sys.exit(main())
