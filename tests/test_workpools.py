"""The docker and kubernetes work pools of infra/pools/, checked by Prefect itself.

No Docker engine or cluster runs here, so what is checked is everything short of
starting a container: a Prefect server (on loopback) accepts the pools that
`diloco deploy --pool-type docker|kubernetes` creates from the templates and the
deployments of infra/prefect.yaml with their job variables (its own validation of
base job templates and of job variables against the pool's schema); a flow run of
a region's worker deployment is rendered by the integration's job configuration
class exactly as its worker does before it starts the job (`resolve_for_flow_run`),
and the image, the credentials and the GPU request land where Docker and
Kubernetes read them. A template Prefect refuses is refused by `diloco deploy`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from contextlib import suppress
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli.app import app
from flows.deploy import DeployError, ensure_pools
from infra.deployments import POOLS, PREFECT_FILE, credentials_secret, pool_template

try:
    from cli_runs import shared_server
    from prefect_server import PrefectServer
except ImportError:  # tests imported as a package
    from tests.cli_runs import shared_server
    from tests.prefect_server import PrefectServer

CREDENTIALS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
               "AWS_ENDPOINT_URL_S3", "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME",
               "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"}


def _shared_env() -> dict[str, str]:
    """The environment every deployment of infra/prefect.yaml sets."""
    doc = yaml.safe_load(PREFECT_FILE.read_text())
    return doc["definitions"]["job_variables"]["env"]


# -- the templates, read ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["docker", "kubernetes"])
def test_templates_start_from_the_integrations_defaults(kind):
    """Every field the integration's worker configures is still templated (a field
    dropped by accident would silently lose, e.g., the Prefect command)."""
    if kind == "docker":
        from prefect_docker.worker import DockerWorker as Worker
    else:
        from prefect_kubernetes.worker import KubernetesWorker as Worker
    default = Worker.get_default_base_job_template()
    ours = json.loads((POOLS / f"{kind}.json").read_text())
    assert set(ours["job_configuration"]) == set(default["job_configuration"])
    assert set(default["variables"]["properties"]) <= set(ours["variables"]["properties"])
    props = ours["variables"]["properties"]
    assert props["image"]["default"] == "diloco-flows:latest"
    assert props["image_pull_policy"]["default"] == "IfNotPresent"  # a local build is used as is
    env = props["env"]["default"]
    assert {k: env[k] for k in _shared_env()} == _shared_env()


def test_docker_containers_take_credentials_from_the_workers_environment():
    env = json.loads((POOLS / "docker.json").read_text())["variables"]["properties"]["env"]
    placeholders = {k: v for k, v in env["default"].items() if k not in _shared_env()}
    assert placeholders == {k: f"{{{{ ${k} }}}}" for k in CREDENTIALS}


def test_kubernetes_jobs_take_credentials_from_their_regions_secret():
    template = pool_template("kubernetes", "region-b")
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"][
        "containers"][0]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert set(refs) == CREDENTIALS
    assert all(r["name"] == "{{ credentials_secret }}" and r["key"] == n
               for n, r in refs.items())
    # the key pair is required (a job without it fails at once); the rest optional
    assert {n for n, r in refs.items() if not r.get("optional")} == {
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    variables = template["variables"]["properties"]
    assert variables["credentials_secret"]["default"] == "diloco-region-b"
    assert pool_template("kubernetes", "region-a")["variables"]["properties"][
        "credentials_secret"]["default"] == credentials_secret("region-a") == "diloco-region-a"
    assert variables["gpu_count"]["default"] == 0 and variables["gpu_count"]["minimum"] == 0
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpu_count }}"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "{{ gpu_count }}"
    assert pool_template("process", "region-a") is None  # Prefect's default template


def test_deploy_image_sets_the_pools_default_image():
    """`diloco deploy --image TAG`: the default image of the docker and kubernetes pools
    it creates (a local build's tag, localhost/diloco-flows:latest); nothing else."""
    for kind in ("docker", "kubernetes"):
        props = pool_template(kind, "region-a", image="localhost/diloco-flows:latest")[
            "variables"]["properties"]
        assert props["image"]["default"] == "localhost/diloco-flows:latest"
        assert pool_template(kind, "region-a")["variables"]["properties"]["image"][
            "default"] == "diloco-flows:latest"


# -- the command's errors, before anything is created -------------------------------------


def test_a_missing_integration_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "prefect_kubernetes", None)  # as if not installed
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # never reached
    result = CliRunner().invoke(app, ["deploy", "--pool-type", "kubernetes"])
    assert result.exit_code == 2, result.output
    assert "kubernetes work pools need prefect-kubernetes: pip install " \
           "'diloco-flows[cloud]'" in result.output
    assert "Traceback" not in result.output


def test_an_unknown_pool_type_or_deployment_is_refused(monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # never reached
    result = CliRunner().invoke(app, ["deploy", "--pool-type", "ecs"])
    assert result.exit_code == 2
    assert "'ecs' is not one of 'process', 'docker', 'kubernetes'" in result.output
    result = CliRunner().invoke(app, ["deploy", "--image", "localhost/diloco-flows:latest"])
    assert result.exit_code == 2
    assert "--image is for docker and kubernetes pools" in result.output
    result = CliRunner().invoke(app, ["deploy", "--name", "region-c"])
    assert result.exit_code == 2
    assert "--name 'region-c'" in result.output and "region-a, region-b" in result.output


# -- the templates, validated and rendered by Prefect -------------------------------------


MARKER = {"AWS_ACCESS_KEY_ID": "AKIAWORKERMARKER", "AWS_SECRET_ACCESS_KEY": "worker-secret-marker"}


async def _render(kind: str, deployment_name: str, pool_name: str) -> dict:
    """A flow run of a worker deployment rendered as the pool's worker renders it
    (with the environment of the calling process: the worker's), and job variables
    the pool's schema forbids, tried."""
    from prefect import get_client  # noqa: PLC0415

    if kind == "docker":
        from prefect_docker.worker import DockerWorkerJobConfiguration as Config  # noqa: PLC0415
    else:
        from prefect_kubernetes.worker import (  # noqa: PLC0415
            KubernetesWorkerJobConfiguration as Config,
        )
    async with get_client() as client:
        deployment = await client.read_deployment_by_name(deployment_name)
        pool = await client.read_work_pool(pool_name)
        params = {"run_url": "s3://diloco/runs/r1", "worker": "region-b"}
        run = await client.create_flow_run_from_deployment(
            deployment.id, parameters=params,
            job_variables={"gpu_count": 2} if kind == "kubernetes" else {})
        config = await Config.resolve_for_flow_run(run, client=client, work_pool=pool,
                                                   worker_name="test-worker")
        out = {"type": pool.type, "stored": pool.base_job_template,
               "job_variables": deployment.job_variables, "flow_run": str(run.id)}
        if kind == "docker":
            out["container"] = {"image": config.image, "env": config.env,
                                "pull": config.image_pull_policy, "command": config.command}
        else:
            out["manifest"] = config.job_manifest
        refused = {}
        bad = {"gpu_count": -1} if kind == "kubernetes" else {"image_pull_policy": "Sometimes"}
        try:
            await client.create_flow_run_from_deployment(deployment.id, parameters=params,
                                                         job_variables=bad)
        except Exception as exc:  # noqa: BLE001 - what the server said is checked
            refused["flow_run"] = str(getattr(exc, "response", None) and exc.response.text)
        out["refused"] = refused
    return json.loads(json.dumps(out))


def _delete_pools(server: PrefectServer, pools: list[str]) -> None:
    """Delete these work pools where they exist."""
    from prefect import get_client  # noqa: PLC0415
    from prefect.exceptions import ObjectNotFound  # noqa: PLC0415

    with server.api(), get_client(sync_client=True) as client:
        for pool in pools:
            with suppress(ObjectNotFound):
                client.delete_work_pool(pool)


@pytest.fixture(scope="module")
def server():
    """The Prefect server this test process keeps (tests/cli_runs.py): the pools and
    deployments these tests make are all a server holds for them, and the commands
    that other tests run on it use no work pool."""
    return shared_server()


def _deploy_and_render(kind: str, server: PrefectServer, tmp: Path):
    """`diloco deploy --pool-type KIND` from an unrelated directory, and a flow run
    of worker/region-b rendered as a worker of the pool with a marker key pair, and
    no AWS_SESSION_TOKEN, in its environment would render it. The pools of another
    kind deployed to this server before are deleted first (their names are the
    same)."""
    _delete_pools(server, ["region-a", "region-b"])
    output = server.deploy(tmp, "--pool-type", kind)
    with server.api(**MARKER):  # the worker's environment: no other AWS_ variable
        for key in [k for k in os.environ if k.startswith("AWS_") and k not in MARKER]:
            del os.environ[key]
        seen = asyncio.run(_render(kind, "worker/region-b", "region-b"))
    return kind, server, output, seen


@pytest.fixture(scope="module")
def kubernetes_pools(server, tmp_path_factory):
    return _deploy_and_render("kubernetes", server, tmp_path_factory.mktemp("kubernetes"))


@pytest.fixture(scope="module")
def docker_pools(server, tmp_path_factory):
    return _deploy_and_render("docker", server, tmp_path_factory.mktemp("docker"))


@pytest.fixture(params=["kubernetes", "docker"])
def cloud_pools(request):
    return request.getfixturevalue(f"{request.param}_pools")


@pytest.mark.slow
def test_prefect_accepts_the_pools_and_the_deployments(cloud_pools):
    kind, _server, output, seen = cloud_pools
    assert f"created {kind} work pools: region-a, region-b" in output
    assert "worker/region-b" in output and "train/train" in output
    assert seen["type"] == kind
    assert seen["job_variables"]["env"] == _shared_env()
    # a value the pool's schema forbids is refused by the server, naming the field
    field = "gpu_count" if kind == "kubernetes" else "image_pull_policy"
    assert field in seen["refused"]["flow_run"], seen["refused"]


@pytest.mark.slow
def test_a_kubernetes_job_gets_the_image_its_regions_secret_and_gpus(kubernetes_pools):
    _kind, _server, _output, seen = kubernetes_pools
    pod = seen["manifest"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "diloco-flows:latest"
    assert container["args"] == ["prefect", "flow-run", "execute"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 2}
    assert container["resources"]["requests"] == {"nvidia.com/gpu": 2}
    env = {e["name"]: e for e in container["env"]}
    for name in CREDENTIALS:
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "diloco-region-b", env[name]
        assert "value" not in env[name]
    assert env["PREFECT__FLOW_RUN_ID"]["value"] == seen["flow_run"]
    assert env["PREFECT_LOGGING_EXTRA_LOGGERS"]["value"] == _shared_env()[
        "PREFECT_LOGGING_EXTRA_LOGGERS"]
    # the worker's own keys never reach a manifest that a Secret serves
    assert not set(MARKER.values()) & {e.get("value") for e in env.values()}


@pytest.mark.slow
def test_a_docker_container_gets_the_image_and_the_workers_credentials(docker_pools):
    _kind, _server, _output, seen = docker_pools
    container = seen["container"]
    assert container["image"] == "diloco-flows:latest" and container["pull"] == "IfNotPresent"
    env = container["env"]
    assert {k: env[k] for k in MARKER} == MARKER  # resolved on the worker's machine
    assert env["AWS_SESSION_TOKEN"] == ""  # unset there: empty, which boto3 ignores
    assert env["PREFECT__FLOW_RUN_ID"] == seen["flow_run"]
    assert env["PYTHONUNBUFFERED"] == "1"
    # and stored nowhere in Prefect: the pool keeps the placeholders only
    stored = json.dumps(seen["stored"])
    assert "{{ $AWS_SECRET_ACCESS_KEY }}" in stored
    assert not any(v in stored for v in MARKER.values())


@pytest.mark.slow
def test_a_template_prefect_refuses_is_refused_with_its_reason(cloud_pools):
    kind, server, _output, _seen = cloud_pools
    broken = pool_template(kind, "region-c")
    del broken["variables"]["properties"]["image"]  # still used by the job configuration
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.url}), \
            pytest.raises(DeployError) as refused:
        ensure_pools(["region-c"], kind, lambda pool: broken)
    assert f"Prefect refused the {kind} work pool 'region-c'" in str(refused.value)
    assert "undeclared variable(s): image" in str(refused.value)
    with temporary_settings({PREFECT_API_URL: server.url}), \
            pytest.raises(DeployError, match="exists with type"):
        ensure_pools(["region-a"], "process")  # a kubernetes/docker pool is not a process one
