"""The Prefect Docker worker of a region, which says when a job was killed for memory.

    python -m flows.docker_worker --pool region-a [--work-queue default] [--name NAME]

It is prefect-docker's worker (``prefect worker start --type docker``) with one
addition. A job killed by the kernel's OOM killer is reported by Prefect as
"Process exited with status code: -9 ... Typically caused by ... exceeding memory
limits, or by manual cancellation" (the engine's process in the container, when it
outlives the flow's) or as "Flow run infrastructure exited with non-zero status
code 137" (prefect-docker), as for `docker kill`; the job cannot say it ran out of
memory itself, being the process that was killed. The engine knows
(``State.OOMKilled``) and the Docker worker is the one party that asks it. So here
a container the engine reports OOMKilled ends its flow run Crashed with one line
that says so and names the memory limit (the pool's ``mem_limit`` job variable),
and the job's status in the run's store says the same, written with this worker's
own bucket credentials: `diloco status` shows it, and the train flow, which
relaunches a failed job once and then fails the run, names it.

Run it where ``prefect worker start --type docker`` would run, with the same
environment (``PREFECT_API_URL``, ``DOCKER_HOST``, the region's ``AWS_*`` keys) and
the same package (prefect-docker, the ``cloud`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import warnings
from typing import Any

from prefect.states import Crashed
from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration

from flows.jobs import set_state
from flows.launchers import AGGREGATOR
from storage.objectstore import ObjectStore

log = logging.getLogger(__name__)


def killed_for_memory(limit: str | None) -> str:
    """The one line of a job whose container the OOM killer ended (the flow run's
    name, or the status's, says whose)."""
    over = f"its container's limit of {limit}" if limit else "its container's memory"
    return (f"killed for memory: over {over} (OOMKilled); raise the work pool's "
            f"mem_limit job variable, then diloco resume the run")


def job_name(flow_run_name: str, parameters: dict[str, Any]) -> str | None:
    """The party a flow run's job plays in its run, whose status it may write: the
    worker's name, or the aggregator (its flow run is ``<run>/aggregator``, as the
    launcher names it); None for the train flow or an aggregator shard."""
    if "worker" in parameters:
        return str(parameters["worker"])
    if "run_url" in parameters and flow_run_name.rpartition("/")[2] == AGGREGATOR:
        return AGGREGATOR
    return None


# The subclass keeps the type "docker" (the pools' type: another would be a "type
# mismatch"), so Prefect's registry of worker types says it replaces prefect-docker's
# in this process, which is what it is for; a strict superset, told once here.
warnings.filterwarnings("ignore", message="Type 'RegionDockerWorker' .* will be overridden")


class RegionDockerWorker(DockerWorker):
    """prefect-docker's worker; a flow run whose container the engine OOM-killed ends
    Crashed with `killed_for_memory`'s line, in its state and in the job's status."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: the engine's last word on each watched container, by flow-run id
        self._ended: dict[str, dict[str, Any]] = {}

    def _watch_container_safe(self, container: Any, configuration: DockerWorkerJobConfiguration,
                              created_event: Any) -> Any:
        container = super()._watch_container_safe(container, configuration, created_event)
        flow_run_id = (configuration.env or {}).get("PREFECT__FLOW_RUN_ID")
        if flow_run_id:
            self._ended[str(flow_run_id)] = dict(container.attrs.get("State") or {})
        return container

    async def run(self, flow_run: Any, configuration: DockerWorkerJobConfiguration,
                  task_status: Any = None) -> Any:
        result = await super().run(flow_run, configuration, task_status)
        state = self._ended.pop(str(flow_run.id), {})
        if state.get("OOMKilled"):
            await self._killed_for_memory(flow_run, configuration.mem_limit)
        return result

    async def _killed_for_memory(self, flow_run: Any, limit: str | None) -> None:
        """The store first (the train flow reads the job's status when it sees the
        flow run fail), then the flow run's state. That state is often Crashed
        already: the engine's parent process in the container outlives the flow's
        own and says "status code -9 ... memory limits, or manual cancellation";
        this line replaces it (forced: a Crashed state is final), unless the flow
        run had Completed before the kill."""
        current = await self.client.read_flow_run(flow_run.id)
        if current.state is not None and current.state.is_completed():
            return
        params = flow_run.parameters or {}
        name = job_name(flow_run.name or "", params)
        line = killed_for_memory(limit)
        if name is not None:
            await asyncio.to_thread(_record, params, name, line)
        await self.client.set_flow_run_state(flow_run.id, Crashed(message=line), force=True)
        self.get_flow_run_logger(flow_run).error("%s: %s", flow_run.name, line)


def _record(params: dict[str, Any], name: str, line: str) -> None:
    """The job's status says ``failed`` with LINE (best effort: a store this worker's
    keys cannot reach leaves the line in Prefect only)."""
    try:
        store = ObjectStore(params["run_url"], storage_options=params.get("storage_options"),
                            name=f"{name}-docker-worker")
        set_state(store, name, "failed", error=line)
    except Exception as exc:  # noqa: BLE001 - the flow run's state still says it
        log.warning("could not record in the store that %s was killed for memory: %s: %s",
                    name, type(exc).__name__, exc)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flows.docker_worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool", required=True, help="the region's docker work pool")
    p.add_argument("--work-queue", action="append", default=None,
                   help="a work queue to serve (repeatable; default: all of the pool's)")
    p.add_argument("--name", default=None, help="the worker's name in Prefect")
    p.add_argument("--limit", type=int, default=None, help="flow runs at a time")
    return p


async def serve(args: argparse.Namespace) -> None:
    async with RegionDockerWorker(work_pool_name=args.pool, work_queues=args.work_queue,
                                  name=args.name, limit=args.limit) as worker:
        await worker.start()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
