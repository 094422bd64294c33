"""Deployments on one machine, as in the cloud but on loopback: a Prefect server,
`diloco deploy` of infra/prefect.yaml from an unrelated directory (two process work
pools, region-a and region-b), a `prefect worker` per pool, each in a working
directory of its own, and a run of the `train` deployment that launches its workers
and aggregator through `run_deployment` into those pools. The deployments carry no
path of the deploying machine: the workers import the flows as modules.

The test process itself plays the user's laptop (`diloco deploy`, `run_deployment`
and the reads of the API in this process, on the server's API): the processes that
matter are the server, the workers and the flow runs they start."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from prefect import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.deployments import run_deployment
from prefect.states import Cancelling

from flows.control import read_launcher
from flows.deploy import read_deployments, work_pools
from infra.deployments import PREFECT_FILE
from storage.objectstore import ObjectStore

try:
    from prefect_server import PrefectServer
except ImportError:  # tests imported as a package
    from tests.prefect_server import PrefectServer

ROOT = Path(__file__).resolve().parent.parent

MICRO = [
    "model.overrides={d_model: 64, n_layers: 2, n_heads: 2, max_seq_len: 64}",
    "data.seq_len=32", "data.batch_size=8", "optim.warmup_steps=2", "train.steps=16",
    "train.eval_every=8", "train.eval_batches=2", "train.log_every=4", "train.threads=1",
    "train.checkpoint_every=8", "sync.schedule.sync_every=8", "sync.schedule.fragments=2", "sync.schedule.overlap=1",
]


def test_prefect_yaml_declares_a_worker_per_region_sharing_settings():
    """Two example regions, train with its schedules, the aggregator; the shared
    settings come from anchors; module entrypoints and no pull step, so nothing
    depends on where the file or the deploying machine's checkout is."""
    deployments = {d["name"]: d for d in read_deployments(PREFECT_FILE)}
    assert set(deployments) == {"train", "region-a", "region-b", "aggregator"}
    assert work_pools(list(deployments.values())) == ["region-a", "region-b"]
    for region in ("region-a", "region-b"):
        d = deployments[region]
        assert d["entrypoint"] == "flows.worker.worker"
        assert d["work_pool"]["name"] == region
        assert d["work_pool"]["job_variables"] == deployments["train"]["work_pool"][
            "job_variables"]
    assert deployments["train"]["entrypoint"] == "flows.train.train"
    assert deployments["aggregator"]["entrypoint"] == "flows.aggregator.aggregator"
    schedules = {s["slug"]: s for s in deployments["train"]["schedules"]}
    assert schedules["nightly-continue"]["parameters"] == {"resume_run": "latest",
                                                           "extra_steps": 600}
    text = PREFECT_FILE.read_text()
    assert "&job_variables" in text  # an anchor, not copies
    doc = yaml.safe_load(text)
    # `pull: []`, not an omitted key: prefect deploy would add the deploying cwd
    assert doc["pull"] == [] and all("pull" not in d for d in deployments.values())
    assert "DILOCO_WORKDIR" not in text and "set_working_directory" not in text


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """A server with the deployments of infra/prefect.yaml, made from a directory
    that is not the checkout, and a worker per pool, each in its own directory."""
    tmp = tmp_path_factory.mktemp("deployments")
    with PrefectServer(tmp / "prefect") as server:
        deployer = tmp / "laptop"
        deployer.mkdir()
        # MLflow has its own tests
        output = server.deploy(deployer, DILOCO_TRACKING="off")
        extra = {"DILOCO_TRACKING": "off"}
        for region in ("region-a", "region-b"):
            (tmp / region).mkdir()
        with server.worker("region-a", cwd=tmp / "region-a", env=extra), \
                server.worker("region-b", cwd=tmp / "region-b", env=extra):
            yield server, tmp, output


def train_params(store: Path, run_url: str | None, *extra: str) -> dict:
    params = {"config": "tiny", "backend": "deployments",
              "overrides": [*MICRO, f"store={store}",
                            'data.sources=["builtin:shakespeare/tragedies/*"]', *extra]}
    if run_url is not None:
        params["run_url"] = run_url
    return params


def worker_logs(server) -> str:
    return "\n".join(server.logs(f"worker-{p}.log")[-3000:] for p in ("region-a", "region-b"))


@pytest.fixture(scope="module")
def trained(deployed):
    """One run of the train deployment as its schedule starts one (no run_url: the
    run chooses its id), to its end, and what Prefect and the store say of it: where
    each job ran, the flow runs' names and logs, a second launch with the same key."""
    server, tmp, _ = deployed
    store = tmp / "runs"
    with server.api():
        train = run_deployment("train/train", parameters=train_params(store, None),
                               timeout=400, poll_interval=2)
        (run_dir,) = store.iterdir() if store.exists() else [None]
        assert run_dir is not None, f"no run under {store}: {train.state}" + worker_logs(server)
        seen = _inspect(run_dir.as_uri(), train)
    return train, run_dir, seen


def _inspect(run_url: str, train) -> dict:
    record = read_launcher(ObjectStore(run_url))
    assert record["backend"] == "deployments", record
    out = {"pools": {}, "queues": {}, "states": {}, "logs": {}}
    with get_client(sync_client=True) as client:
        for name, job in record["jobs"].items():
            run = client.read_flow_run(job["flow_run"])
            out["pools"][name] = run.work_pool_name
            out["queues"][name] = run.work_queue_name
            out["states"][name] = run.state.type.value
            parent = client.read_task_run(run.parent_task_run_id) if run.parent_task_run_id else None
            if parent is not None:
                parent_run = client.read_flow_run(parent.flow_run_id)
                out["parent"] = client.read_flow(parent_run.flow_id).name
                out["queues"]["train"] = parent_run.work_queue_name
        for run in client.read_flow_runs():  # the train run's children, by name
            if run.id == train.id or not run.name.startswith(train.name + "/"):
                continue
            if run.state.type.value == "COMPLETED":  # not a crashed first attempt, relaunched
                logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(
                    any_=[run.id])))
                out["logs"][run.name] = [entry.message for entry in logs]
        out["deployments"] = {
            d.name: {"entrypoint": d.entrypoint, "path": d.path, "pull_steps": d.pull_steps,
                     "stored": d.model_dump_json()}
            for d in client.read_deployments()}
    name, job = next(iter(record["jobs"].items()))
    again = run_deployment(job["deployment"], parameters={"run_url": run_url}, timeout=0,
                           idempotency_key=f"{record['key']}:{name}", as_subflow=False)
    out["relaunched_same_key"] = str(again.id) == job["flow_run"]
    return out


@pytest.mark.slow
def test_a_run_through_two_work_pools(deployed, trained):
    server, tmp, deploy_output = deployed
    assert "created process work pools: region-a, region-b" in deploy_output
    assert "train/train" in deploy_output and "worker/region-b" in deploy_output
    train, run_dir, seen = trained
    assert train.state.type.value == "COMPLETED", f"{train.state}\n" + worker_logs(server)

    # Where each job ran, and a second launch with the same key: no new flow run.
    assert seen["pools"] == {"region-a": "region-a", "region-b": "region-b",
                             "aggregator": "region-a"}
    # a queue per role in region A's pool, which its one worker serves whole
    assert seen["queues"] == {"region-a": "default", "region-b": "default",
                              "aggregator": "aggregator", "train": "launcher"}
    assert set(seen["states"].values()) == {"COMPLETED"}
    assert seen["relaunched_same_key"] is True
    assert seen["parent"] == "train"
    # nothing of the deploying machine: module entrypoints, no pull step, no path
    stored = seen["deployments"]
    assert {n: d["entrypoint"] for n, d in stored.items()} == {
        "train": "flows.train.train", "region-a": "flows.worker.worker",
        "region-b": "flows.worker.worker", "aggregator": "flows.aggregator.aggregator"}
    for d in stored.values():
        assert d["path"] is None and not d["pull_steps"], d
        assert str(ROOT) not in d["stored"] and str(tmp) not in d["stored"]
    status = {n: json.loads((run_dir / "members" / n / "status.json").read_text())
              for n in ("region-a", "region-b", "aggregator")}
    assert all(s["state"] == "finished" for s in status.values()), status
    assert status["region-a"]["step"] == 16
    assert status["aggregator"]["rounds"] == status["aggregator"]["total_rounds"]


@pytest.mark.slow
def test_deployment_runs_are_named_and_log_their_rounds(trained):
    """A scheduled run's train flow run (no run_url) takes the run's id as its name
    once it has chosen it; its children, in the work pools, are <run id>/<job>."""
    train, run_dir, seen = trained
    assert train.state.type.value == "COMPLETED", train.state
    assert train.name == run_dir.name and run_dir.name.startswith("tiny-"), train.name
    logs = seen["logs"]
    assert set(logs) == {f"{run_dir.name}/{n}" for n in ("region-a", "region-b",
                                                        "aggregator")}, logs
    worker = logs[f"{run_dir.name}/region-b"]
    assert any("sent" in m and "loss" in m for m in worker), worker
    assert any("eval loss" in m for m in worker), worker
    assert any("applied" in m for m in logs[f"{run_dir.name}/aggregator"])


def _job_processes(flow_run_ids: list[str]) -> list[int]:
    """PIDs of live processes running one of these flow runs (the process worker
    gives each its PREFECT__FLOW_RUN_ID)."""
    wanted = {f"PREFECT__FLOW_RUN_ID={i}".encode() for i in flow_run_ids}
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = set((proc / "environ").read_bytes().split(b"\0"))
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if environ & wanted and stat.split(") ", 1)[1][0] != "Z":
            found.append(int(proc.name))
    return found


FINAL = {"CANCELLED", "COMPLETED", "FAILED", "CRASHED"}


@pytest.mark.slow
def test_cancelling_train_cancels_its_jobs(deployed):
    """Prefect does not cancel run_deployment children of a cancelled flow run: the
    train flow's on_cancellation hook does, and the jobs checkpoint and stop."""
    server, tmp, _ = deployed
    store = tmp / "cancelled"
    run_url = (store / "d2").as_uri()
    status = store / "d2" / "members" / "region-b" / "status.json"
    params = train_params(store, run_url, "train.eval_every=0", "train.steps=2000",
                          "train.checkpoint_every=10")
    # start train, wait for the workers, cancel train as `prefect flow-run cancel`
    # does (Cancelling), wait until everything has ended
    with server.api(), get_client(sync_client=True) as client:
        train_id = run_deployment("train/train", parameters=params, timeout=0).id
        deadline = time.monotonic() + 240
        while not (status.exists() and json.loads(status.read_text()).get("step", 0) >= 10):
            assert time.monotonic() < deadline, "the workers never got going\n" + \
                worker_logs(server)
            time.sleep(0.5)
        client.set_flow_run_state(train_id, Cancelling(message="test"))
        deadline = time.monotonic() + 200
        while True:
            record = read_launcher(ObjectStore(run_url)) or {"jobs": {}}
            jobs = {n: client.read_flow_run(j["flow_run"]).state.type.value
                    for n, j in record["jobs"].items()}
            train = client.read_flow_run(train_id).state.type.value
            if train in FINAL and jobs and set(jobs.values()) <= FINAL:
                break
            assert time.monotonic() < deadline, \
                f"not cancelled: train {train}, jobs {jobs}\n" + worker_logs(server)
            time.sleep(1)
    assert train == "CANCELLED"
    assert set(jobs.values()) <= {"CANCELLED", "COMPLETED"}, jobs
    assert "CANCELLED" in jobs.values()
    assert (store / "d2" / "control" / "cancel.json").exists()  # the hook's request
    ids = [j["flow_run"] for j in record["jobs"].values()]
    assert len(ids) == 3
    deadline = time.monotonic() + 60
    while _job_processes(ids) and time.monotonic() < deadline:
        time.sleep(1)
    assert not _job_processes(ids), "a job process survived"
    step = json.loads(status.read_text())["step"]
    assert 10 <= step < 2000
    assert json.loads(status.read_text())["state"] in ("cancelled", "interrupted")
