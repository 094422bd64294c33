"""Prefect Docker work pools, run for real: `diloco deploy --pool-type docker` on a
Prefect server, a Prefect Docker worker per region and role (prefect-docker's,
with that role's bucket keys in its own environment only), and a `train` run on a
SeaweedFS bucket whose every job (train, both regions' workers, the aggregator) is a
container of the project's image on the engine of tests/docker_engine.py.

The engine, the image and the skip rules are the session fixtures of
tests/docker_engine.py (marker ``containers``: ``-m containers`` or ``DILOCO_TEST_CONTAINERS=1``, as root)::

    .venv/bin/python -m pytest -m containers -q tests/test_docker_pools.py

What it checks: the run finishes; each job ran in a container of the image whose
bucket key is its own role's; lines logged inside the containers are in Prefect's
flow-run logs; `diloco status` reads the run; no bucket secret is in a container's
labels, in Prefect (flow runs' parameters and job variables, deployments, work
pools, blocks, variables, logs) or in any log; and `diloco cancel` stops a second
run's containers after a checkpoint, its flow runs Cancelled. Faults: `docker
kill` of a worker's container mid-run, its flow run relaunched by the train flow,
ends bit for bit as the same run unfaulted (quorum 1.0, as tests/test_fault_campaign.py
checks process kills); a container killed for memory (a small mem_limit) is named so
in one line, in its flow run's state and in `diloco status`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

try:  # tests/ is on sys.path under pytest's default import mode
    from docker_engine import SHORT_RUN, DockerEngine, say
    from faults import applied_once, canonical_eval, differences, snapshot
    from iam_server import SeaweedIAMServer
    from prefect_server import PrefectServer, stop_process
except ImportError:  # tests imported as a package
    from tests.docker_engine import SHORT_RUN, DockerEngine, say
    from tests.faults import applied_once, canonical_eval, differences, snapshot
    from tests.iam_server import SeaweedIAMServer
    from tests.prefect_server import PrefectServer, stop_process

from flows.docker_worker import killed_for_memory
from infra.policies import policy_file_name, role_policies
from storage import layout

pytestmark = [pytest.mark.containers, pytest.mark.timeout(1800)]

BIN = Path(sys.executable).parent
DILOCO, PREFECT = str(BIN / "diloco"), str(BIN / "prefect")
BUCKET, PREFIX = "diloco-docker", "runs"
WORKERS = ["region-a", "region-b"]
#: a Docker worker per (pool, work queue), each with the keys of the role it serves
DOCKER_WORKERS = [("region-a", "launcher", layout.LAUNCHER),
                  ("region-a", "aggregator", layout.AGGREGATOR),
                  ("region-a", "default", "worker:region-a"),
                  ("region-b", "default", "worker:region-b")]
MICRO = [*SHORT_RUN, f"store=s3://{BUCKET}/{PREFIX}", f"workers={WORKERS}"]
#: the loggers of our code (PREFECT_LOGGING_EXTRA_LOGGERS): only a job logs on them
OURS = ("flows", "workers", "diloco", "storage", "tracking")


@dataclass
class Stack:
    engine: DockerEngine
    image: str
    server: PrefectServer
    bucket: SeaweedIAMServer
    envs: dict[str, dict[str, str]]  # the AWS_* environment of each role
    tmp: Path
    deploy_output: str
    times: dict[str, float] = field(default_factory=dict)

    def env(self, role: str | None = None) -> dict[str, str]:
        """The Prefect server's environment with no bucket keys but ROLE's."""
        base = {k: v for k, v in self.server.env.items()
                if not k.startswith(("AWS_", "MLFLOW_"))}
        return {**base, **(self.envs[role] if role else {})}

    def client(self) -> Any:
        from prefect import get_client

        return get_client(sync_client=True)

    def secrets(self) -> dict[str, str]:
        """Every bucket secret (and key id) of the run's parties, by what it is."""
        out = {}
        for role, env in self.envs.items():
            out[f"{role} secret"] = env["AWS_SECRET_ACCESS_KEY"]
            out[f"{role} key id"] = env["AWS_ACCESS_KEY_ID"]
        return out


def _with_api(url: str):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    return temporary_settings({PREFECT_API_URL: url})


@pytest.fixture(scope="module")
def stack(docker_engine: DockerEngine, image: str, tmp_path_factory: pytest.TempPathFactory,
          request: pytest.FixtureRequest) -> Iterator[Stack]:
    """SeaweedFS with a user per role, a Prefect server with the docker pools and the
    deployments, and a Docker worker per (pool, queue) with its role's keys."""
    tmp = tmp_path_factory.mktemp("docker-pools")
    with SeaweedIAMServer() as bucket, PrefectServer(tmp / "prefect") as server:
        bucket.client("s3", bucket.admin).create_bucket(Bucket=BUCKET)
        envs = {role: bucket.user(policy_file_name(role)[: -len(".json")], doc)
                for role, doc in role_policies(BUCKET, PREFIX, WORKERS).items()}
        stack = Stack(docker_engine, image, server, bucket, envs, tmp, "")
        deployer = tmp / "laptop"
        deployer.mkdir()
        t0 = time.monotonic()
        out = subprocess.run([DILOCO, "deploy", "--pool-type", "docker", "--image", image],
                             cwd=deployer, env=stack.env(), text=True, capture_output=True,
                             timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr
        stack.deploy_output = out.stdout
        stack.times["deploy"] = time.monotonic() - t0
        # what a pool's owner sets for the whole pool: no MLflow here (it has tests of
        # its own), and the engine's session label, so that its stop removes them
        key, value = docker_engine.label.split("=", 1)
        _update_pools(server.url, {"DILOCO_TRACKING": "off"}, {key: value})
        engine_env = docker_engine.env()
        with _workers(stack, engine_env):
            yield stack
        ids = docker_engine.docker("ps", "--all", "--quiet", "--filter",
                                   f"label={docker_engine.label}", check=False).stdout.split()
        if ids:
            docker_engine.docker("rm", "--force", *ids, check=False, timeout=120)
        say(request.config, "docker pools: " + ", ".join(
            f"{k} {v:.1f} s" for k, v in stack.times.items()))


def _workers(stack: Stack, engine_env: dict[str, str]) -> ExitStack:
    """The Docker workers of DOCKER_WORKERS, each in a directory of its own: the
    project's (python -m flows.docker_worker), prefect-docker's with the OOM line."""
    workers = ExitStack()
    for pool, queue, role in DOCKER_WORKERS:
        cwd = stack.tmp / f"{pool}-{queue}"
        cwd.mkdir()
        proc = stack.server.spawn([sys.executable, "-m", "flows.docker_worker", "--pool", pool,
                                   "--work-queue", queue, "--name", f"{pool}-{queue}"],
                                  f"worker-{pool}-{queue}.log", cwd=cwd,
                                  env={**stack.env(role), **engine_env})
        workers.callback(stop_process, proc)
    return workers


def _update_pools(url: str, env: dict[str, str], labels: dict[str, str]) -> None:
    from prefect.client.schemas.actions import WorkPoolUpdate

    with _with_api(url):
        from prefect import get_client

        with get_client(sync_client=True) as client:
            for name in WORKERS:
                template = client.read_work_pool(name).base_job_template
                props = template["variables"]["properties"]
                props["env"]["default"].update(env)
                props["labels"]["default"] = labels
                client.update_work_pool(name, WorkPoolUpdate(base_job_template=template))


def _train(stack: Stack, name: str, *extra: str, watch: bool = True) -> subprocess.CompletedProcess:
    params = {"config": "tiny", "backend": "deployments",
              "run_url": f"s3://{BUCKET}/{PREFIX}/{name}", "overrides": [*MICRO, *extra]}
    args = [PREFECT, "deployment", "run", "train/train", "--params", json.dumps(params)]
    if watch:
        args += ["--watch", "--watch-timeout", "900"]
    return subprocess.run(args, cwd=stack.tmp, env=stack.env(), text=True, capture_output=True,
                          timeout=960)


def _worker_logs(stack: Stack) -> str:
    return "\n".join(f"--- {p}/{q}\n" + stack.server.logs(f"worker-{p}-{q}.log")[-2500:]
                     for p, q, _ in DOCKER_WORKERS)


def _flow_runs(stack: Stack, run_name: str) -> dict[str, Any]:
    """The run's flow runs by job name (``train``, ``region-a``, ``aggregator``...)."""
    with _with_api(stack.server.url), stack.client() as client:
        runs = client.read_flow_runs()
    found = {}
    for run in runs:
        if run.name.startswith(f"{run_name}/"):
            found[run.name.split("/", 1)[1]] = run
        elif run.parameters.get("run_url", "").endswith(f"/{run_name}"):
            found["train"] = run
    return found


def _containers(stack: Stack) -> dict[str, dict[str, Any]]:
    """`docker inspect` of every container of the pools, by flow-run id."""
    ids = stack.engine.docker("ps", "--all", "--quiet", "--filter",
                              f"label={stack.engine.label}").stdout.split()
    if not ids:
        return {}
    infos = json.loads(stack.engine.docker("inspect", *ids).stdout)
    return {i["Config"]["Labels"].get("io.prefect.flow-run-id", i["Id"]): i for i in infos}


def _logs(stack: Stack, flow_run_ids: list[str] | None = None) -> list[Any]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    filt = LogFilter(flow_run_id=LogFilterFlowRunId(any_=flow_run_ids)) if flow_run_ids else None
    out: list[Any] = []
    with _with_api(stack.server.url), stack.client() as client:
        while True:
            page = client.read_logs(log_filter=filt, limit=200, offset=len(out))
            out += page
            if len(page) < 200:
                return out


@pytest.fixture(scope="module")
def finished(stack: Stack) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    t0 = time.monotonic()
    out = _train(stack, "dp1")
    stack.times["train run (deployment run to Completed)"] = time.monotonic() - t0
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + _worker_logs(stack)
    assert "Completed" in out.stdout, out.stdout[-3000:] + _worker_logs(stack)
    runs = _flow_runs(stack, "dp1")
    _wait_for_exit(stack, [str(r.id) for r in runs.values()])
    stack.times["train run, to its last container's exit"] = time.monotonic() - t0
    return out, runs


def _wait_for_exit(stack: Stack, flow_run_ids: list[str], timeout: float = 120) -> None:
    """Until the containers of these flow runs have exited: a flow run is Completed
    (what `--watch` waits for) a few seconds before its container's process exits."""
    deadline = time.monotonic() + timeout
    while True:
        running = [i for i, info in _containers(stack).items()
                   if i in flow_run_ids and info["State"]["Running"]]
        if not running:
            return
        assert time.monotonic() < deadline, f"containers still running: {running}"
        time.sleep(1)


def test_a_train_run_finishes_with_every_job_in_a_container(stack: Stack, finished: Any,
                                                            request: pytest.FixtureRequest
                                                            ) -> None:
    assert "created docker work pools: region-a, region-b" in stack.deploy_output
    _, runs = finished
    assert set(runs) == {"train", "region-a", "region-b", "aggregator"}, runs
    assert {n: r.state.type.value for n, r in runs.items()} == dict.fromkeys(runs, "COMPLETED")
    containers = _containers(stack)
    image_id = json.loads(stack.engine.docker("image", "inspect", stack.image).stdout)[0]["Id"]
    role = {"train": layout.LAUNCHER, "aggregator": layout.AGGREGATOR,
            "region-a": "worker:region-a", "region-b": "worker:region-b"}
    for name, run in runs.items():
        info = containers.get(str(run.id))
        assert info is not None, (name, sorted(containers))
        assert info["Image"] == image_id and info["Config"]["Image"] == stack.image
        assert info["State"]["ExitCode"] == 0 and not info["State"]["Running"]
        assert info["HostConfig"]["NetworkMode"] == "host"
        env = dict(e.split("=", 1) for e in info["Config"]["Env"])
        # the key of the role this job plays, from its Docker worker's environment
        assert env["AWS_ACCESS_KEY_ID"] == stack.envs[role[name]]["AWS_ACCESS_KEY_ID"], name
        assert env["PREFECT__FLOW_RUN_ID"] == str(run.id)
        started = _when(info["State"]["StartedAt"])
        stack.times[f"{name} container"] = _when(info["State"]["FinishedAt"]) - started
        if name in WORKERS:  # from the container's start to the flow's first step
            logs = stack.engine.docker("logs", "--timestamps", info["Id"])
            first = next(line.split(" ", 1)[0] for line in (logs.stdout + logs.stderr).splitlines()
                         if f"| Flow run 'dp1/{name}' - {name} step " in line)
            stack.times[f"{name} container start to its first step"] = _when(first) - started
    pools = {n: r.work_pool_name for n, r in runs.items()}
    assert pools == {"train": "region-a", "aggregator": "region-a", "region-a": "region-a",
                     "region-b": "region-b"}
    say(request.config, "containers: " + ", ".join(
        f"{n} {containers[str(r.id)]['Name'].lstrip('/')}" for n, r in runs.items()))


def _when(stamp: str) -> float:
    from datetime import datetime

    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(head + "+00:00").timestamp() + float(f"0.{frac or 0}")


def test_the_containers_logs_are_in_the_flow_runs_logs(stack: Stack, finished: Any) -> None:
    _, runs = finished
    logs = _logs(stack, [str(r.id) for r in runs.values()])
    for name, run in runs.items():
        mine = [rec for rec in logs if str(rec.flow_run_id) == str(run.id)]
        # written in the container: the flow's lines (the Prefect worker's own are
        # prefect.flow_runs.worker), the engine's last one among them
        inside = [rec for rec in mine if rec.name == "prefect.flow_runs"
                  or rec.name.split(".")[0] in OURS]
        assert any("Finished in state Completed" in rec.message for rec in inside), name
        if name in WORKERS:
            assert any(rec.message.startswith(f"{name} step ") for rec in inside), (
                name, [(r.name, r.message) for r in mine][-20:])


def test_diloco_status_reads_the_run(stack: Stack, finished: Any) -> None:
    out = subprocess.run([DILOCO, "status", f"s3://{BUCKET}/{PREFIX}/dp1", "--json"],
                         env=stack.env(layout.VIEWER), text=True, capture_output=True,
                         timeout=120, cwd=stack.tmp)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    seen = json.loads(out.stdout)
    text = json.dumps(seen)
    assert "finished" in text, text[:2000]


def test_no_secret_in_labels_prefect_or_logs(stack: Stack, finished: Any) -> None:
    needles = stack.secrets()
    places: dict[str, str] = {}
    for run_id, info in _containers(stack).items():
        places[f"labels of {run_id}"] = json.dumps(info["Config"]["Labels"])
        logs = stack.engine.docker("logs", info["Id"], check=False)
        places[f"docker logs of {run_id}"] = logs.stdout + logs.stderr
    with _with_api(stack.server.url), stack.client() as client:
        places["flow runs"] = json.dumps([r.model_dump(mode="json")
                                          for r in client.read_flow_runs()])
        places["deployments"] = json.dumps([d.model_dump(mode="json")
                                            for d in client.read_deployments()])
        places["work pools"] = json.dumps([p.model_dump(mode="json")
                                           for p in client.read_work_pools()])
        places["blocks"] = json.dumps([b.model_dump(mode="json") for b in
                                       client.read_block_documents(include_secrets=True)])
        places["variables"] = json.dumps([v.model_dump(mode="json")
                                          for v in client.read_variables()])
    places["flow-run logs"] = "\n".join(r.message for r in _logs(stack))
    for pool, queue, _ in DOCKER_WORKERS:
        places[f"worker log {pool}/{queue}"] = stack.server.logs(f"worker-{pool}-{queue}.log")
    places["server log"] = stack.server.logs("server.log")
    # and whatever else the server keeps (events, artifacts...): its database's files
    for path in sorted(stack.server.home.glob("prefect.db*")):
        places[path.name] = path.read_bytes().decode("latin-1")
    # (not blind: the run's URL, a flow-run parameter, is in there as plain text)
    assert any(f"s3://{BUCKET}/{PREFIX}/dp1" in text for name, text in places.items()
               if name.startswith("prefect.db")), sorted(places)
    assert places["flow-run logs"] and places["flow runs"]
    leaks = [(what, where) for where, text in places.items() for what, value in needles.items()
             if value in text]
    assert not leaks, leaks


def _status(stack: Stack, run_name: str, member: str) -> dict[str, Any]:
    s3 = stack.bucket.client("s3", stack.bucket.admin)
    try:
        body = s3.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{run_name}/members/{member}/status.json")
        return json.loads(body["Body"].read())
    except Exception:  # noqa: BLE001 - not written yet, or being written
        return {}


def test_diloco_cancel_stops_the_containers_after_a_checkpoint(stack: Stack, finished: Any,
                                                               request: pytest.FixtureRequest
                                                               ) -> None:
    """A longer run, cancelled with `diloco cancel` mid-run (as the launcher, from outside
    the containers): every job checkpoints and exits, its container with it, and the
    jobs' flow runs end Cancelled."""
    url = f"s3://{BUCKET}/{PREFIX}/dp2"
    t0 = time.monotonic()
    out = _train(stack, "dp2", "train.steps=2000", "train.checkpoint_every=10", watch=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    first = None
    deadline = time.monotonic() + 400
    while (step := _status(stack, "dp2", "region-b").get("step", 0)) < 12:
        if first is None and step >= 1:
            first = time.monotonic() - t0
        assert time.monotonic() < deadline, "the workers never got going\n" + _worker_logs(stack)
        time.sleep(0.5)
    stack.times["cancel run: deployment run to region-b's first step"] = first or 0.0
    t1 = time.monotonic()
    cancel = subprocess.run([DILOCO, "cancel", url, "--timeout", "180"],
                            env=stack.env(layout.LAUNCHER), text=True, capture_output=True,
                            timeout=240, cwd=stack.tmp)
    stack.times["diloco cancel"] = time.monotonic() - t1
    assert cancel.returncode == 0, cancel.stdout[-2000:] + cancel.stderr[-2000:]
    # those still running when it asks (a job that saw the store's request first may
    # have ended already, Cancelled by itself)
    assert re.search(r"set [0-3] flow runs to Cancelling", cancel.stdout), cancel.stdout
    runs = _flow_runs(stack, "dp2")
    jobs = {n: r for n, r in runs.items() if n != "train"}
    assert set(jobs) == {"region-a", "region-b", "aggregator"}, runs
    _wait_for_exit(stack, [str(r.id) for r in jobs.values()])
    stack.times["diloco cancel to the containers' exit"] = time.monotonic() - t1
    containers = _containers(stack)
    assert all(not containers[str(r.id)]["State"]["Running"] for r in jobs.values())
    deadline = time.monotonic() + 60
    while True:
        states = {n: r.state.type.value for n, r in _flow_runs(stack, "dp2").items()}
        if all(states.get(n) in ("CANCELLED", "COMPLETED", "FAILED", "CRASHED")
               for n in [*jobs, "train"]):
            break
        assert time.monotonic() < deadline, states
        time.sleep(1)
    # the train flow too: it sees the request, reports, and ends Cancelled
    assert states == dict.fromkeys([*jobs, "train"], "CANCELLED"), states
    for worker in WORKERS:
        status = _status(stack, "dp2", worker)
        assert status["state"] in ("cancelled", "interrupted"), status
        assert 10 <= status["step"] < 2000, status
        s3 = stack.bucket.client("s3", stack.bucket.admin)
        listed = s3.list_objects_v2(Bucket=BUCKET,
                                    Prefix=f"{PREFIX}/dp2/{layout.worker_checkpoints(worker)}/")
        assert listed.get("KeyCount", 0) > 0, worker  # its checkpoint
    say(request.config, f"cancelled: flow runs {states}; containers exit codes " + ", ".join(
        f"{n} {containers[str(r.id)]['State']['ExitCode']}" for n, r in jobs.items()))


# -- faults in containers --------------------------------------------------------------

#: the fault trials' settings (tests/test_fault_campaign.py): quorum 1.0, so that a
#: killed worker changes nobody's rounds, and membership deadlines longer than its
#: relaunch (the flow run Crashed, the train flow's relaunch, a Docker worker's poll,
#: a container's start: a minute or more on a loaded machine)
FAULTS = ["train.steps=32", "train.checkpoint_every=4", "train.keep_checkpoints=0",
          "sync.schedule.sync_every=4", "sync.membership.quorum=1.0",
          "sync.membership.deadline_s=600", "sync.membership.absent_deadline_s=600"]


def _admin_options(stack: Stack) -> dict[str, Any]:
    admin = stack.bucket.admin
    return {"key": admin["AWS_ACCESS_KEY_ID"], "secret": admin["AWS_SECRET_ACCESS_KEY"],
            "endpoint_url": stack.bucket.endpoint_url}


def _all_flow_runs(stack: Stack, flow_run_name: str) -> list[Any]:
    """Every flow run of that name (a relaunched job has several), oldest first."""
    with _with_api(stack.server.url), stack.client() as client:
        runs = [r for r in client.read_flow_runs() if r.name == flow_run_name]
    return sorted(runs, key=lambda r: r.created)


def _wait_for_train(stack: Stack, run_name: str, timeout: float = 900) -> Any:
    """The run's train flow run, once it has ended."""
    deadline = time.monotonic() + timeout
    while True:
        train = _flow_runs(stack, run_name).get("train")
        if train is not None and train.state is not None and train.state.is_final():
            return train
        assert time.monotonic() < deadline, ("the train flow did not end\n"
                                             + _worker_logs(stack))
        time.sleep(2)


@pytest.fixture(scope="module")
def unfaulted(stack: Stack) -> str:
    """The fault trials' run without a fault: its URL."""
    t0 = time.monotonic()
    out = _train(stack, "dpref", *FAULTS)
    assert out.returncode == 0 and "Completed" in out.stdout, (
        out.stdout[-3000:] + out.stderr[-3000:] + _worker_logs(stack))
    stack.times["fault trials' reference run"] = time.monotonic() - t0
    _wait_for_exit(stack, [str(r.id) for r in _flow_runs(stack, "dpref").values()])
    return f"s3://{BUCKET}/{PREFIX}/dpref"


def test_docker_kill_of_a_worker_then_its_relaunch_is_bit_identical(
        stack: Stack, unfaulted: str, request: pytest.FixtureRequest) -> None:
    """`docker kill` (SIGKILL, no checkpoint) of region-b's container mid-run: Prefect
    says Crashed, the train flow relaunches region-b's flow run, the new container
    resumes from the store, and the run ends with the unfaulted run's canonical state
    (every fragment's model, every mean, bit for bit) and eval loss."""
    out = _train(stack, "dpkill", *FAULTS, watch=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    deadline = time.monotonic() + 600
    while _status(stack, "dpkill", "region-b").get("step", 0) < 10:
        assert time.monotonic() < deadline, "region-b never got going\n" + _worker_logs(stack)
        time.sleep(0.5)
    (first, *_) = _all_flow_runs(stack, "dpkill/region-b")
    container = _containers(stack)[str(first.id)]
    t0 = time.monotonic()
    stack.engine.docker("kill", container["Id"])
    killed_at = _status(stack, "dpkill", "region-b").get("step")
    train = _wait_for_train(stack, "dpkill")
    stack.times["docker kill to the run's end"] = time.monotonic() - t0
    assert train.state.type.value == "COMPLETED", (train.state, _worker_logs(stack))
    runs = _all_flow_runs(stack, "dpkill/region-b")
    assert [r.state.type.value for r in runs] == ["CRASHED", "COMPLETED"], runs
    ended = _containers(stack)[str(first.id)]["State"]
    assert ended["ExitCode"] == 137 and not ended["OOMKilled"], ended
    _wait_for_exit(stack, [str(r.id) for r in _flow_runs(stack, "dpkill").values()])

    options = _admin_options(stack)
    url = f"s3://{BUCKET}/{PREFIX}/dpkill"
    got, want = snapshot(url, options), snapshot(unfaulted, options)
    problems = differences(got, want) + applied_once(got)
    assert not problems, "\n".join(problems)
    loss, reference_loss = canonical_eval(url, options), canonical_eval(unfaulted, options)
    assert loss == reference_loss, (loss, reference_loss)
    say(request.config, f"docker kill of region-b at step {killed_at}: relaunched, "
                        f"canonical eval loss {loss!r} = the unfaulted run's, "
                        f"{len(got.means)} means bit-identical")


def _pool_memory(stack: Stack, pool: str, limit: str | None) -> None:
    """The docker pool's mem_limit (and memswap_limit: no swap beyond it), or none."""
    from prefect.client.schemas.actions import WorkPoolUpdate

    with _with_api(stack.server.url), stack.client() as client:
        template = client.read_work_pool(pool).base_job_template
        props = template["variables"]["properties"]
        for name in ("mem_limit", "memswap_limit"):
            if limit is None:
                props[name].pop("default", None)
            else:
                props[name]["default"] = limit
        client.update_work_pool(pool, WorkPoolUpdate(base_job_template=template))


def test_a_container_killed_for_memory_says_so_in_one_line(
        stack: Stack, request: pytest.FixtureRequest) -> None:
    """region-b's pool with a 150 MB memory limit (the job's imports alone take more):
    the engine OOM-kills its container, twice (the train flow relaunches it once),
    and each flow run ends Crashed with the one line of flows/docker_worker.py (in
    place of Prefect's "status code -9 ... or by manual cancellation"); `diloco
    status` shows it, in one line, and the train flow fails naming it."""
    limit = "150m"
    _pool_memory(stack, "region-b", limit)
    try:
        t0 = time.monotonic()
        # quorum 1.0 (FAULTS): the aggregator waits for region-b, so the run cannot
        # finish without it and ends when region-b has failed twice
        _train(stack, "dpoom", *FAULTS, watch=False)
        train = _wait_for_train(stack, "dpoom")
        stack.times["mem_limit run: deployment run to Failed"] = time.monotonic() - t0
    finally:
        _pool_memory(stack, "region-b", None)
    _wait_for_exit(stack, [str(r.id) for r in _flow_runs(stack, "dpoom").values()])
    line = killed_for_memory(limit)
    runs = _all_flow_runs(stack, "dpoom/region-b")
    assert [(r.state.type.value, r.state.message) for r in runs] == [("CRASHED", line)] * 2
    for run in runs:
        assert _containers(stack)[str(run.id)]["State"]["OOMKilled"] is True
    assert train.state.type.value == "FAILED", train.state
    assert f"region-b failed: {line}" in (train.state.message or ""), train.state.message
    out = subprocess.run([DILOCO, "status", f"s3://{BUCKET}/{PREFIX}/dpoom"],
                         env=stack.env(layout.VIEWER), text=True,
                         capture_output=True, timeout=120, cwd=stack.tmp)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    said = [s for s in out.stdout.splitlines() if "killed for memory" in s]
    assert said == [f"region-b failed: {line}"], out.stdout
    say(request.config, f"killed for memory: {said[0]}")


# -- the cross-region rehearsal on Docker pools ------------------------------------------


def test_the_rehearsal_on_docker_pools_matches_the_process_pools(
        docker_engine: DockerEngine, image: str, request: pytest.FixtureRequest) -> None:
    """`scripts/rehearse-regions --pools docker` (make rehearse POOLS=docker): both
    regions as Docker pools on this engine, an IAM user per role, region B's keys
    refused region A's key; it passes, both regions ran the image's interpreter, and
    its canonical eval loss is the process-pool rehearsal's, to the last bit (both
    at quorum 1.0)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "rehearse-regions"
    said, took = {}, {}
    for pools in ("docker", "process"):
        t0 = time.monotonic()
        out = subprocess.run([str(script), "--pools", pools, "--no-image"], text=True,
                             capture_output=True, timeout=1200,
                             env={**{k: v for k, v in os.environ.items()
                                     if not k.startswith("AWS_")}, **docker_engine.env()})
        took[pools] = time.monotonic() - t0
        assert out.returncode == 0 and "rehearse: PASS" in out.stdout, (
            pools, out.stdout[-4000:], out.stderr[-2000:])
        said[pools] = out.stdout
    losses = {p: re.search(r"canonical eval loss (\S+)", text).group(1)  # type: ignore[union-attr]
              for p, text in said.items()}
    assert losses["docker"] == losses["process"] != "None", losses
    assert "region B's keys may not write region A's" in said["docker"]
    assert said["docker"].count("ran /opt/diloco/bin/python") == 2, said["docker"][-2000:]
    say(request.config, f"rehearsal: canonical eval loss {losses} (docker pools "
                        f"{took['docker']:.0f} s, process pools {took['process']:.0f} s)")
