"""The local stack (infra/minio/): read and checked (what listens where, that it
ships no password, that every role of the bucket gets a user with its own policy,
that each region's Prefect worker holds that region's credentials only), its setup
script run against a stand-in `mc` (MinIO, which cannot be pulled here), and, with
the marker ``containers`` (a Docker engine, as root: tests/docker_engine.py), the
stack brought up for real with `docker-compose` on its default profile (SeaweedFS),
trained on from the host, and taken down leaving nothing."""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.deploy import read_deployments, work_pools

try:  # tests/ is on sys.path under pytest's default import mode
    from docker_engine import SHORT_RUN, build, say
except ImportError:  # tests imported as a package
    from tests.docker_engine import SHORT_RUN, build, say
from infra.deployments import PREFECT_FILE

INFRA = Path(__file__).resolve().parents[1] / "infra" / "minio"

_VARIABLE = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
_REQUIRED = re.compile(r"^\$\{([A-Z0-9_]+):\?[^}]+\}$")

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


def _substitute(value: str) -> str:
    """VALUE with every ``${NAME:-default}`` replaced by its default, as compose does
    with nothing set."""
    return _VARIABLE.sub(lambda m: m.group(3) if m.group(2) == ":-" else m.group(0), value)


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


#: the S3 service and its setup of each profile
PROFILES = {"seaweedfs": ("seaweedfs", "setup-seaweedfs"), "minio": ("minio", "setup")}
SERVERS = {"seaweedfs", "minio", "mlflow", "prefect"}


# -- infra/minio/docker-compose.yml --------------------------------------------------------


def test_compose_services_profiles_and_health():
    services = _compose()["services"]
    assert set(services) == {"seaweedfs", "minio", "policies", "setup-seaweedfs", "setup",
                             "mlflow", "prefect", "deploy", "worker-region-a",
                             "worker-region-b", "launcher", "aggregator"}
    for profile, (store, setup) in PROFILES.items():
        assert services[store]["profiles"] == [profile]
        assert services[setup]["profiles"] == [profile]
        assert services[setup]["depends_on"][store]["condition"] == "service_healthy"
        assert services[setup]["depends_on"]["policies"]["condition"] == \
            "service_completed_successfully"
        assert services[setup]["entrypoint"] == ["/bin/sh", "/setup.sh"]
        assert "./setup.sh:/setup.sh:ro" in services[setup]["volumes"]
        assert services[setup]["environment"]["S3_SERVICE"] == profile
        assert services[setup]["restart"] == "no"
    # the rest runs whatever the profile, and needs neither profile's services
    for name, service in services.items():
        if not service.get("profiles"):
            assert not set(service.get("depends_on", {})) & {*services} - {
                n for n, s in services.items() if not s.get("profiles")}, name
    assert _env_example()["COMPOSE_PROFILES"] == "seaweedfs"  # the default here
    for name in SERVERS:
        assert services[name]["healthcheck"]["test"], name
    assert services["policies"]["restart"] == "no"
    mlflow = services["mlflow"]
    assert mlflow["environment"]["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert any(a.startswith("--backend-store-uri=sqlite:///") for a in mlflow["command"])
    assert any(a.startswith("--artifacts-destination=s3://") for a in mlflow["command"])
    assert "server" in services["prefect"]["command"]
    assert "-s3.iam.readOnly=false" in services["seaweedfs"]["command"]


def test_every_service_is_on_the_host_network_and_listens_on_bind_address():
    """No bridge (the engine of scripts/docker-engine has none): host networking, no
    published ports, each server bound to BIND_ADDRESS, loopback by default."""
    services = _compose()["services"]
    for name, service in services.items():
        assert service["network_mode"] == "host", name
        assert "ports" not in service, name
    listen = {
        "seaweedfs": "-ip.bind=${BIND_ADDRESS:-127.0.0.1}",
        "mlflow": "--host=${BIND_ADDRESS:-127.0.0.1}",
    }
    for name, flag in listen.items():
        assert flag in services[name]["command"], name
    assert _flag(services["prefect"]["command"], "--host") == "${BIND_ADDRESS:-127.0.0.1}"
    assert any(a.startswith("${BIND_ADDRESS:-127.0.0.1}:") for a in services["minio"]["command"])
    assert _env_example()["BIND_ADDRESS"] == "127.0.0.1"


def test_compose_images_are_the_projects_or_pinned():
    env = _env_example()
    for name in ("MINIO_IMAGE", "MC_IMAGE"):
        image = env[name]
        assert ":" in image and not image.endswith(":latest"), image
    services = _compose()["services"]
    ours = {n for n, s in services.items() if s.get("image") == "${DILOCO_IMAGE:-localhost/diloco-flows:latest}"}
    assert ours == {"policies", "setup-seaweedfs", "mlflow", "prefect", "deploy",
                    *_prefect_workers()}
    assert services["seaweedfs"]["build"]["dockerfile"] == "infra/minio/seaweedfs.Dockerfile"
    assert re.search(r"^ARG SEAWEEDFS_VERSION=\d+\.\d+$",
                     (INFRA / "seaweedfs.Dockerfile").read_text(), re.M)


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
    compose_own = {n for n in env if n.startswith("COMPOSE_")}  # compose's settings
    assert set(env) - compose_own <= set(used), f"unused in compose: {set(env) - set(used)}"


def test_no_password_ships_and_compose_refuses_to_start_without_one():
    """Every credential is required (``${VAR:?}``: compose stops with the message)
    and empty in .env.example, so a copied .env without passwords does not start."""
    text = (INFRA / "docker-compose.yml").read_text()
    env = _env_example()
    secrets = {n for n in env if n.endswith("_PASSWORD")} | {"S3_ROOT_USER"}
    assert secrets >= {"S3_ROOT_PASSWORD", *(_password_variable(r) for r in ROLES),
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


def test_the_root_user_serves_only_the_s3_service_and_its_setup():
    for name, service in _compose()["services"].items():
        text = yaml.safe_dump(service)
        if name not in ("minio", "seaweedfs", "setup", "setup-seaweedfs"):
            assert "S3_ROOT" not in text, name


def test_every_role_gets_a_user_with_its_policy():
    """The policies service writes a document per role and per worker, the setup
    services are given every user's password, and both take the same workers, which
    are the regions of infra/prefect.yaml."""
    services = _compose()["services"]
    workers = _workers()
    assert workers == work_pools(read_deployments(PREFECT_FILE))
    command = services["policies"]["command"]
    assert command[:4] == ["python", "-m", "infra.bucket", "policies"]
    options = dict(a.removeprefix("--").split("=", 1) for a in command[4:])
    for _, name in PROFILES.values():
        setup = services[name]["environment"]
        assert _default(options["workers"]) == ",".join(workers)
        assert _default(options["bucket"]) == _default(setup["DILOCO_BUCKET"])
        assert _default(options["prefix"]) == _default(setup["DILOCO_PREFIX"])
        assert options["out"] == setup["POLICIES_DIR"] == "/policies"
        for user in (*ROLES, *workers, "mlflow"):
            variable = _password_variable(user)
            assert _REQUIRED.match(setup[variable]).group(1) == variable
            # and writes the user's keys into the user's own volume
            assert f"credentials-{user}:/credentials/{user}" in services[name]["volumes"]


def test_each_region_and_role_has_a_worker_with_its_own_credentials():
    """A Prefect worker per region (its pool's default queue) and per role queue of
    infra/prefect.yaml, each with its role's credentials volume and no other, read
    through the with-credentials entrypoint; no key in any environment."""
    deployments = read_deployments(PREFECT_FILE)
    queues = {(d["work_pool"]["name"], d["work_pool"].get("work_queue_name", "default"))
              for d in deployments}
    compose = _compose()
    served = {}
    for name, service in _prefect_workers().items():
        command = service["command"]
        pool, queue = _flag(command, "--pool"), _flag(command, "--work-queue")
        assert _flag(command, "--type") == "process", name
        user = pool if queue == "default" else queue  # a region's worker, or a role's
        assert service["volumes"] == [f"credentials-{user}:/credentials:ro"], name
        assert service["entrypoint"] == compose["x-with-credentials"], name
        env = service["environment"]
        assert not [k for k in env if k.startswith("AWS_")], name
        assert env["PREFECT_API_URL"] == "http://127.0.0.1:${PREFECT_PORT:-4200}/api"
        assert env["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:${MLFLOW_PORT:-5000}"
        assert service["depends_on"]["deploy"]["condition"] == "service_completed_successfully"
        served[(pool, queue)] = user
    assert set(served) == queues  # every queue a deployment uses has its worker
    assert len(set(served.values())) == len(served)  # and no two share credentials
    assert {u for (_, q), u in served.items() if q == "default"} == set(_workers())
    assert compose["services"]["mlflow"]["volumes"][-1] == "credentials-mlflow:/credentials:ro"
    deploy = compose["services"]["deploy"]
    assert deploy["command"] == ["diloco", "deploy"]
    assert "AWS_SECRET_ACCESS_KEY" not in deploy["environment"]  # deploying needs no keys
    wrapper = compose["x-with-credentials"]
    assert wrapper[:2] == ["/usr/bin/tini", "--"]  # the image's init stays pid 1


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
    env = {k: _substitute(str(v)) for k, v in compose.items()
           if not _REQUIRED.match(str(v))}
    env.update({_password_variable(u): f"{u}-Pw-0123" for u in (*ROLES, *_workers(), "mlflow")})
    env.update({"S3_ROOT_USER": "root", "S3_ROOT_PASSWORD": "root-Pw-0123",
                "POLICIES_DIR": str(policies), "MC_LOG": str(tmp_path / "mc.log"),
                "CREDENTIALS_DIR": str(tmp_path / "credentials"),
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
    assert calls[0] == "alias set local http://127.0.0.1:9000 root root-Pw-0123"
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
    # each user's keys in its own volume's env file, which a shell sources
    credentials = Path(env["CREDENTIALS_DIR"])
    for user in (*ROLES, *_workers(), "mlflow"):
        sourced = subprocess.run(["sh", "-c", 'set -a; . "$0"; echo "$AWS_ACCESS_KEY_ID '
                                  '$AWS_SECRET_ACCESS_KEY $AWS_ENDPOINT_URL_S3"',
                                  str(credentials / user / "env")],
                                 capture_output=True, text=True, check=True).stdout.split()
        assert sourced == [user, f"{user}-Pw-0123", "http://127.0.0.1:9000"], user


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


# -- the stack for real (marker containers: a Docker engine, as root) -------------------


def _free_port_pair(taken: set[int]) -> int:
    """A port P of 20000-29999 free on loopback, with P + 10000 free too (SeaweedFS's
    gRPC port of P) and neither in TAKEN."""
    while True:
        port = random.randrange(20000, 30000)
        if {port, port + 10000} & taken:
            continue
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        taken |= {port, port + 10000}
        return port


def _stack_env(path: Path, project: str) -> dict[str, str]:
    """.env.example with every password filled in (as README.md says), the ports moved
    to free ones (the suite's servers share this machine's loopback), and the
    project named PROJECT; written to PATH."""
    env = _env_example()
    for name in env:
        if name.endswith("_PASSWORD"):
            env[name] = secrets.token_hex(16)
    env["S3_ROOT_USER"] = f"root{secrets.token_hex(4)}"
    env["COMPOSE_PROJECT_NAME"] = project
    taken: set[int] = set()
    for name in ("PREFECT_PORT", "MLFLOW_PORT", "SEAWEEDFS_S3_PORT", "SEAWEEDFS_MASTER_PORT",
                 "SEAWEEDFS_VOLUME_PORT", "SEAWEEDFS_FILER_PORT", "SEAWEEDFS_ADMIN_PORT"):
        env[name] = str(_free_port_pair(taken))
    path.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    return env


@pytest.mark.containers
@pytest.mark.timeout(1800)
def test_the_stack_comes_up_trains_from_the_host_and_goes(docker_engine, image, tmp_path,
                                                         request):
    """`docker-compose up` with .env.example's default profile (SeaweedFS; every image
    the project's, built by scripts/docker-image --stack); a short train run from the
    host through the stack's Prefect, whose every job runs in the workers'
    containers with their users' keys; `diloco status` with the viewer's keys reads
    it finished; MLflow has it; `docker-compose down -v` leaves no container, volume
    or network of the project."""
    if shutil.which("docker-compose") is None:
        pytest.skip("no docker-compose (scripts/docker-engine install)")
    built = build(docker_engine, image, "--stack")
    assert "localhost/diloco-seaweedfs:latest" in built.output, built.output
    project = f"diloco-test-{uuid.uuid4().hex[:8]}"
    env = _stack_env(tmp_path / "stack.env", project)
    run_env = {**os.environ, **docker_engine.env()}
    run_env.pop("COMPOSE_PROFILES", None)  # the env file's default, as a user has it
    compose = ["docker-compose", "-f", str(INFRA / "docker-compose.yml"),
               "--env-file", str(tmp_path / "stack.env")]
    times: dict[str, float] = {}

    def run(*args: str, timeout: float = 900, check: bool = True,
            environ: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        got = subprocess.run(list(args), env=environ or run_env, capture_output=True,
                             text=True, timeout=timeout, cwd=tmp_path)
        if check:
            assert got.returncode == 0, (args, got.stdout[-3000:], got.stderr[-3000:])
        return got

    def leftovers() -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={project}"
        return {what: docker_engine.docker(*cmd, check=False).stdout.split() for what, cmd in (
            ("containers", ("ps", "--all", "--quiet", "--filter", label)),
            ("volumes", ("volume", "ls", "--quiet", "--filter", label)),
            ("networks", ("network", "ls", "--quiet", "--filter", label)))}

    try:
        t0 = time.monotonic()
        run(*compose, "up", "-d")
        times["docker-compose up -d (to the workers started)"] = time.monotonic() - t0
        services = set(docker_engine.docker(
            "ps", "--all", "--filter", f"label=com.docker.compose.project={project}",
            "--format", '{{.Label "com.docker.compose.service"}}').stdout.split())
        assert {"seaweedfs", "setup-seaweedfs"} <= services, services  # the default profile
        assert not services & {"minio", "setup"}, services
        prefect_env = {**run_env, "PREFECT_API_URL": f"http://127.0.0.1:{env['PREFECT_PORT']}/api"}
        params = {"config": "tiny", "run_url": f"s3://{env['DILOCO_BUCKET']}/runs/stack-1",
                  "overrides": [*SHORT_RUN, f"store=s3://{env['DILOCO_BUCKET']}/runs"]}
        t0 = time.monotonic()
        out = run(str(Path(sys.executable).parent / "prefect"), "deployment", "run",
                  "train/train", "--params", json.dumps(params), "--watch",
                  "--watch-timeout", "850", environ=prefect_env, check=False)
        times["a short train run from the host (deployment run to Completed)"] = \
            time.monotonic() - t0
        assert out.returncode == 0 and "Completed" in out.stdout, (
            out.stdout[-3000:] + out.stderr[-3000:]
            + run(*compose, "logs", "--tail", "30", check=False).stdout[-6000:])
        # the viewer's keys, from its credentials volume (never printed)
        viewer = docker_engine.docker("run", "--rm", "--network", "host", "--volume",
                                      f"{project}_credentials-viewer:/c:ro", "--entrypoint",
                                      "cat", image, "/c/env").stdout
        keys = dict(line.split("=", 1) for line in viewer.splitlines())
        status = run(str(Path(sys.executable).parent / "diloco"), "status",
                     str(params["run_url"]), "--json", environ={
                         **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
                         **{k: v.strip("'") for k, v in keys.items()}})
        seen = json.loads(status.stdout)
        assert seen["aggregator"]["state"] == "finished", seen["aggregator"]
        assert {w["state"] for w in seen["workers"].values()} == {"finished"}, seen["workers"]
        with urllib.request.urlopen(
                f"http://127.0.0.1:{env['MLFLOW_PORT']}/api/2.0/mlflow/experiments/search"
                "?max_results=10", timeout=30) as answer:
            assert json.loads(answer.read())["experiments"], "no MLflow experiment"
    finally:
        t0 = time.monotonic()
        down = run(*compose, "down", "-v", check=False)
        times["docker-compose down -v"] = time.monotonic() - t0
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]
    assert leftovers() == {"containers": [], "volumes": [], "networks": []}
    say(request.config, "compose stack: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))

