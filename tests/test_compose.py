"""The local stack's compose file (infra/minio/), which cannot run here (no Docker
engine) but can be read and checked."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

INFRA = Path(__file__).resolve().parents[1] / "infra" / "minio"


# -- infra/minio/docker-compose.yml --------------------------------------------------------

_VARIABLE = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


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


def test_compose_services_ports_and_health():
    services = _compose()["services"]
    assert set(services) == {"minio", "create-buckets", "mlflow", "prefect"}

    def container_ports(service: str) -> set[int]:
        return {int(str(p).rsplit(":", 1)[1]) for p in services[service]["ports"]}

    assert container_ports("minio") == {9000, 9001}
    assert container_ports("mlflow") == {5000}
    assert container_ports("prefect") == {4200}
    for name in ("minio", "mlflow", "prefect"):
        assert services[name]["healthcheck"]["test"], name
    assert "/data" in services["minio"]["command"]
    assert any(v.endswith(":/data") for v in services["minio"]["volumes"])
    assert services["create-buckets"]["depends_on"]["minio"]["condition"] == "service_healthy"
    assert services["create-buckets"]["restart"] == "no"
    assert "mc mb --ignore-existing" in services["create-buckets"]["command"][0]
    mlflow = services["mlflow"]
    assert mlflow["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert mlflow["environment"]["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert any(a.startswith("--backend-store-uri=sqlite:///") for a in mlflow["command"])
    assert any(a.startswith("--artifacts-destination=s3://") for a in mlflow["command"])
    assert "server" in services["prefect"]["command"]


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
        used[name] = kind
    assert set(env) <= set(used), f"unused in compose: {set(env) - set(used)}"
    # credentials have no default: compose refuses to start without them
    assert used["MINIO_ROOT_PASSWORD"] == ":?" and used["MINIO_ROOT_USER"] == ":?"
    assert len(env["MINIO_ROOT_PASSWORD"]) >= 8  # MinIO refuses shorter ones
