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
run's containers after a checkpoint, its flow runs Cancelled.
"""

from __future__ import annotations

import json
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
    from docker_engine import DockerEngine, say
    from iam_server import SeaweedIAMServer
    from prefect_server import PrefectServer
except ImportError:  # tests imported as a package
    from tests.docker_engine import DockerEngine, say
    from tests.iam_server import SeaweedIAMServer
    from tests.prefect_server import PrefectServer

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
MICRO = [
    "model.overrides={d_model: 64, n_layers: 2, n_heads: 2, max_seq_len: 64}",
    "data.seq_len=32", "data.batch_size=8", "optim.warmup_steps=2", "train.steps=16",
    "train.eval_every=0", "train.eval_batches=2", "train.log_every=4", "train.threads=1",
    "train.checkpoint_every=8", "sync.schedule.sync_every=8", "sync.schedule.fragments=2",
    "sync.schedule.overlap=1", 'data.sources=["builtin:shakespeare/tragedies/*"]',
    f"store=s3://{BUCKET}/{PREFIX}", f"workers={WORKERS}",
]
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
    """The Docker workers of DOCKER_WORKERS, each in a directory of its own."""
    workers = ExitStack()
    for pool, queue, role in DOCKER_WORKERS:
        cwd = stack.tmp / f"{pool}-{queue}"
        cwd.mkdir()
        workers.enter_context(stack.server.worker(pool, cwd=cwd, kind="docker", queue=queue,
                                                  env={**stack.env(role), **engine_env}))
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
