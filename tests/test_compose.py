"""The local stack (infra/minio/), which cannot run here (no Docker engine) but can
be read and checked: what it publishes and where, that it ships no password, that
every role of the bucket gets a MinIO user with its own policy, and that each
region's Prefect worker holds that region's credentials only. Its setup script runs
for real against a stand-in `mc` that records what it was asked to do."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.deploy import read_deployments, work_pools
from infra.deployments import PREFECT_FILE

INFRA = Path(__file__).resolve().parents[1] / "infra" / "minio"

_VARIABLE = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
_REQUIRED = re.compile(r"^\$\{([A-Z_]+):\?[^}]+\}$")

#: The roles of the bucket (infra.bucket's policy files) besides one per worker,
#: and the tracking server's user.
ROLES = ("viewer", "launcher", "aggregator")


def _env_example() -> dict[str, str]:
    values = {}
    for line in (INFRA / ".env.example").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name] = value
    return values


def _compose() -> dict[str, Any]:
    return yaml.safe_load((INFRA / "docker-compose.yml").read_text())


def _default(value: str) -> str:
    """The default of ``${NAME:-default}``, as compose would substitute it."""
    match = _VARIABLE.fullmatch(value)
    assert match and match.group(2) == ":-", value
    return match.group(3)


def _workers() -> list[str]:
    return _default(_compose()["services"]["setup"]["environment"]["DILOCO_WORKERS"]).split(",")


def _password_variable(user: str) -> str:
    return user.upper().replace("-", "_") + "_PASSWORD"


def _prefect_workers() -> dict[str, dict[str, Any]]:
    """The services that run `prefect worker start`, by name."""
    return {name: s for name, s in _compose()["services"].items()
            if s.get("command", [])[:3] == ["prefect", "worker", "start"]}


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


# -- infra/minio/docker-compose.yml --------------------------------------------------------


def test_compose_services_ports_and_health():
    services = _compose()["services"]
    assert set(services) == {"minio", "policies", "setup", "mlflow", "prefect", "deploy",
                             "worker-region-a", "worker-region-b", "launcher", "aggregator"}

    def container_ports(service: str) -> set[int]:
        return {int(str(p).rsplit(":", 1)[1]) for p in services[service]["ports"]}

    assert container_ports("minio") == {9000, 9001}
    assert container_ports("mlflow") == {5000}
    assert container_ports("prefect") == {4200}
    for name in ("minio", "mlflow", "prefect"):
        assert services[name]["healthcheck"]["test"], name
    assert "/data" in services["minio"]["command"]
    assert any(v.endswith(":/data") for v in services["minio"]["volumes"])
    setup = services["setup"]
    assert setup["depends_on"]["minio"]["condition"] == "service_healthy"
    assert setup["depends_on"]["policies"]["condition"] == "service_completed_successfully"
    assert setup["restart"] == "no" and services["policies"]["restart"] == "no"
    assert setup["entrypoint"] == ["/bin/sh", "/setup.sh"]
    assert "./setup.sh:/setup.sh:ro" in setup["volumes"]
    mlflow = services["mlflow"]
    assert mlflow["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert mlflow["environment"]["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert any(a.startswith("--backend-store-uri=sqlite:///") for a in mlflow["command"])
    assert any(a.startswith("--artifacts-destination=s3://") for a in mlflow["command"])
    assert "server" in services["prefect"]["command"]


def test_ports_are_published_on_loopback_unless_told_otherwise():
    services = _compose()["services"]
    published = [(name, str(p)) for name, s in services.items() for p in s.get("ports", [])]
    assert len(published) == 4
    for name, port in published:
        assert port.startswith("${BIND_ADDRESS:-127.0.0.1}:"), (name, port)
    assert _env_example()["BIND_ADDRESS"] == "127.0.0.1"


def test_compose_images_are_pinned():
    env = _env_example()
    for name in ("MINIO_IMAGE", "MC_IMAGE"):
        image = env[name]
        assert ":" in image and not image.endswith(":latest"), image
    for dockerfile, arg in (
        ("mlflow.Dockerfile", "MLFLOW_VERSION"),
        ("prefect.Dockerfile", "PREFECT_VERSION"),
    ):
        text = (INFRA / dockerfile).read_text()
        assert f"ARG {arg}={env[arg]}" in text, dockerfile
        assert re.fullmatch(r"\d+\.\d+\.\d+", env[arg]), env[arg]


def test_compose_variables_are_defined_in_env_example():
    text = (INFRA / "docker-compose.yml").read_text()
    env = _env_example()
    used = {}
    for match in _VARIABLE.finditer(text):
        name, kind, default = match.groups()
        assert name in env, f"${{{name}}} is used in docker-compose.yml but not in .env.example"
        if kind and kind.endswith("-"):
            assert default == env[name], f"default of {name} differs from .env.example"
        used.setdefault(name, set()).add(kind)
    assert set(env) <= set(used), f"unused in compose: {set(env) - set(used)}"


def test_no_password_ships_and_compose_refuses_to_start_without_one():
    """Every credential is required (``${VAR:?}``: compose stops with the message)
    and empty in .env.example, so a copied .env without passwords does not start."""
    text = (INFRA / "docker-compose.yml").read_text()
    env = _env_example()
    secrets = {n for n in env if n.endswith("_PASSWORD")} | {"MINIO_ROOT_USER"}
    assert secrets >= {"MINIO_ROOT_PASSWORD", *(_password_variable(r) for r in ROLES),
                       *(_password_variable(w) for w in _workers()), "MLFLOW_PASSWORD"}
    for name in secrets:
        assert env[name] == "", f"{name} has a value in .env.example"
        kinds = {m.group(2) for m in _VARIABLE.finditer(text) if m.group(1) == name}
        assert kinds == {":?"}, f"{name} is used with {kinds}, not only ${{{name}:?...}}"
    # and no literal secret anywhere in a service's environment
    for name, service in _compose()["services"].items():
        for key, value in (service.get("environment") or {}).items():
            if "PASSWORD" in key or "SECRET" in key:
                assert _REQUIRED.match(str(value)), f"{name}: {key}={value}"


def test_the_root_user_serves_only_minio_and_its_setup():
    for name, service in _compose()["services"].items():
        text = yaml.safe_dump(service)
        if name not in ("minio", "setup"):
            assert "MINIO_ROOT" not in text, name


def test_every_role_gets_a_user_with_its_policy():
    """The policies service writes a document per role and per worker, the setup
    service is given every user's password, and both take the same workers, which
    are the regions of infra/prefect.yaml."""
    services = _compose()["services"]
    workers = _workers()
    assert workers == work_pools(read_deployments(PREFECT_FILE))
    command = services["policies"]["command"]
    assert command[:4] == ["python", "-m", "infra.bucket", "policies"]
    options = dict(a.removeprefix("--").split("=", 1) for a in command[4:])
    setup = services["setup"]["environment"]
    assert _default(options["workers"]) == ",".join(workers)
    assert _default(options["bucket"]) == _default(setup["DILOCO_BUCKET"])
    assert _default(options["prefix"]) == _default(setup["DILOCO_PREFIX"])
    assert options["out"] == setup["POLICIES_DIR"] == "/policies"
    for user in (*ROLES, *workers, "mlflow"):
        variable = _password_variable(user)
        assert _REQUIRED.match(setup[variable]).group(1) == variable


def test_each_region_and_role_has_a_worker_with_its_own_credentials():
    """A Prefect worker per region (its pool's default queue) and per role queue of
    infra/prefect.yaml, each with its role's MinIO user and nothing else."""
    deployments = read_deployments(PREFECT_FILE)
    queues = {(d["work_pool"]["name"], d["work_pool"].get("work_queue_name", "default"))
              for d in deployments}
    served = {}
    for name, service in _prefect_workers().items():
        command = service["command"]
        pool, queue = _flag(command, "--pool"), _flag(command, "--work-queue")
        assert _flag(command, "--type") == "process", name
        user = pool if queue == "default" else queue  # a region's worker, or a role's
        env = service["environment"]
        assert env["AWS_ACCESS_KEY_ID"] == user, name
        assert _REQUIRED.match(env["AWS_SECRET_ACCESS_KEY"]).group(1) == \
            _password_variable(user), name
        assert env["PREFECT_API_URL"] == "http://prefect:4200/api"
        assert env["AWS_ENDPOINT_URL_S3"] == "http://minio:9000"
        assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
        assert service["image"] == "${DILOCO_IMAGE:-diloco-flows:latest}"
        assert service["depends_on"]["setup"]["condition"] == "service_completed_successfully"
        assert service["depends_on"]["deploy"]["condition"] == "service_completed_successfully"
        served[(pool, queue)] = user
    assert set(served) == queues  # every queue a deployment uses has its worker
    assert len(set(served.values())) == len(served)  # and no two share credentials
    assert {u for (_, q), u in served.items() if q == "default"} == set(_workers())
    deploy = _compose()["services"]["deploy"]
    assert deploy["command"] == ["diloco", "deploy"]
    assert "AWS_SECRET_ACCESS_KEY" not in deploy["environment"]  # deploying needs no keys


# -- infra/minio/setup.sh, against a stand-in mc -------------------------------------------


_FAKE_MC = """#!/bin/sh
echo "$*" >> "$MC_LOG"
case "$*" in
    "ilm rule import"*) cat >> "$MC_LOG" ;;
    "admin user info"*) [ -n "$MC_ATTACHED" ] && echo "PolicyName: $MC_ATTACHED" ;;
esac
exit 0
"""


@pytest.fixture
def setup_env(tmp_path):
    """What compose gives the setup service (with passwords set), the policy
    documents of the real `python -m infra.bucket policies`, and a stand-in mc."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mc").write_text(_FAKE_MC)
    (bin_dir / "mc").chmod(0o755)
    policies = tmp_path / "policies"
    made = subprocess.run([sys.executable, "-m", "infra.bucket", "policies", "--bucket",
                           "diloco", "--prefix", "runs", "--workers", "region-a,region-b",
                           "--out", str(policies)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    compose = _compose()["services"]["setup"]["environment"]
    env = {k: _default(v) for k, v in compose.items() if str(v).startswith("${")
           and _VARIABLE.fullmatch(v).group(2) == ":-"}
    env.update({k: v for k, v in compose.items() if not str(v).startswith("${")})
    env.update({_password_variable(u): f"{u}-Pw-0123" for u in (*ROLES, *_workers(), "mlflow")})
    env.update({"MINIO_ROOT_USER": "root", "MINIO_ROOT_PASSWORD": "root-Pw-0123",
                "POLICIES_DIR": str(policies), "MC_LOG": str(tmp_path / "mc.log"),
                "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    return env, tmp_path / "mc.log", policies


def _setup(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(INFRA / "setup.sh")], env=env, capture_output=True,
                          text=True, timeout=60)


def test_setup_creates_buckets_lifecycle_and_a_user_per_role(setup_env):
    env, log, policies = setup_env
    out = _setup({**env, "DILOCO_EXPIRE_DAYS": "30"})
    assert out.returncode == 0, out.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "alias set local http://minio:9000 root root-Pw-0123"
    assert "mb --ignore-existing local/diloco local/mlflow" in calls
    assert "admin config set local api stale_uploads_expiry=24h" in calls
    rule = calls[calls.index("ilm rule import local/diloco") + 1]
    assert '"Prefix": "runs/"' in rule and '"Days": 30' in rule
    for user, policy, document in (
            ("viewer", "diloco-viewer", policies / "viewer.json"),
            ("launcher", "diloco-launcher", policies / "launcher.json"),
            ("aggregator", "diloco-aggregator", policies / "aggregator.json"),
            ("region-a", "diloco-worker-region-a", policies / "worker-region-a.json"),
            ("region-b", "diloco-worker-region-b", policies / "worker-region-b.json")):
        assert f"admin policy create local {policy} {document}" in calls
        assert f"admin user add local {user} {user}-Pw-0123" in calls
        assert f"admin policy attach local {policy} --user {user}" in calls
    assert "admin user add local mlflow mlflow-Pw-0123" in calls
    assert "admin policy attach local diloco-mlflow --user mlflow" in calls
    # the root user is the alias's only: no user is made with its password
    assert sum("root-Pw-0123" in c for c in calls) == 1
    assert "user region-b: policy diloco-worker-region-b" in out.stdout


def test_setup_runs_again_without_attaching_twice_or_expiring_by_default(setup_env):
    env, log, _ = setup_env
    out = _setup({**env, "MC_ATTACHED": "diloco-viewer"})  # as a second `up` finds it
    assert out.returncode == 0, out.stderr
    calls = log.read_text().splitlines()
    assert "admin policy attach local diloco-viewer --user viewer" not in calls
    assert "admin policy attach local diloco-launcher --user launcher" in calls
    assert not any(c.startswith("ilm") for c in calls)  # DILOCO_EXPIRE_DAYS empty: kept


@pytest.mark.parametrize("change, says", [
    ({"REGION_B_PASSWORD": "short"}, "REGION_B_PASSWORD, the password of MinIO user region-b"),
    ({"AGGREGATOR_PASSWORD": ""}, "AGGREGATOR_PASSWORD, the password of MinIO user aggregator"),
    ({"DILOCO_WORKERS": "region-a,region-c"}, "no policy document"),
])
def test_setup_refuses_before_touching_minio(setup_env, change, says):
    env, log, _ = setup_env
    out = _setup({**env, **change})
    assert out.returncode == 2
    assert says in out.stderr
    assert not log.exists()  # not even the alias: MinIO is left as it was
