"""``diloco deploy``: the deployments of a prefect.yaml (the package's
infra/prefect.yaml) on a Prefect server.

Creates the work pools the file names when they do not exist yet, then runs
``prefect deploy`` on the file. Process pools get Prefect's default job template;
docker and kubernetes pools the template the caller passes for each region
(infra/pools/, through `infra.deployments`). Nothing of the deploying machine goes
into a deployment: the entrypoints are module paths the pools' machines import from
their own installed copy of diloco-flows (the image, or a pip install), with no
pull step, so a worker started in any directory runs them.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

#: Pool types whose workers come from an integration, and the module it installs.
INTEGRATIONS = {"docker": "prefect_docker", "kubernetes": "prefect_kubernetes"}

#: A region's pool name -> its base job template (None: the type's default).
TemplateFor = Callable[[str], "dict[str, Any] | None"]


class DeployError(Exception):
    """The deployments could not be created; the message says why."""


def read_deployments(path: Path) -> list[dict[str, Any]]:
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise DeployError(f"cannot read {path}: {exc}") from exc
    deployments = (doc or {}).get("deployments") or []
    if not deployments:
        raise DeployError(f"{path} declares no deployments")
    return deployments


def work_pools(deployments: list[dict[str, Any]]) -> list[str]:
    """The work pools the deployments use, in order of first use."""
    pools: list[str] = []
    for d in deployments:
        name = ((d.get("work_pool") or {}).get("name") or "").strip()
        if name and name not in pools:
            pools.append(name)
    return pools


def flow_name(entrypoint: str) -> str:
    """The flow function's name in ``pkg.module.flow`` or ``path.py:flow``."""
    return entrypoint.replace(":", ".").rsplit(".", 1)[-1]


def require_integration(pool_type: str) -> None:
    """Docker and kubernetes workers come with Prefect's integrations: say how to
    get them before anything is created (their workers need them on the pools'
    machines too)."""
    module = INTEGRATIONS.get(pool_type)
    if module is None:
        return
    try:
        importlib.import_module(module)
    except ImportError:
        raise DeployError(
            f"{pool_type} work pools need {module.replace('_', '-')}: pip install "
            "'diloco-flows[cloud]'") from None


def _prefect() -> str:
    exe = Path(sys.executable).parent / "prefect"
    return str(exe) if exe.exists() else "prefect"


def _run(args: list[str]) -> subprocess.CompletedProcess:
    out = subprocess.run([_prefect(), *args], text=True, capture_output=True)
    if out.returncode != 0:
        detail = (out.stderr or out.stdout).strip().splitlines()[-12:]
        raise DeployError(f"prefect {' '.join(args)} failed:\n  " + "\n  ".join(detail))
    return out


def _server_says(exc: Exception) -> str:
    """The reason in a Prefect API error response (a template it refused), else
    the exception itself."""
    response = getattr(exc, "response", None)
    try:
        body = response.json()
    except Exception:  # noqa: BLE001 - no response, or not JSON
        return f"{type(exc).__name__}: {exc}"
    details = body.get("exception_detail") or []
    if details and isinstance(details, list):
        return "; ".join(str(d.get("msg", d)) for d in details)
    return str(body.get("detail") or body)


def ensure_pools(pools: list[str], pool_type: str | None = None,
                 template_for: TemplateFor | None = None) -> list[str]:
    """Create the missing work pools; returns those it created.

    ``pool_type`` (default: process) is the type of the pools it creates; when
    given, an existing pool of another type is an error, since its workers would
    not run what the caller expects. ``template_for(pool)`` gives a pool's base job
    template (None: the type's default). Prefect's server validates each template
    and refuses a broken one, with its reason in the error.
    """
    from prefect import get_client  # noqa: PLC0415
    from prefect.client.schemas.actions import WorkPoolCreate  # noqa: PLC0415
    from prefect.exceptions import ObjectNotFound  # noqa: PLC0415
    from prefect.workers.base import BaseWorker  # noqa: PLC0415

    kind = pool_type or "process"
    require_integration(kind)
    created: list[str] = []
    url = os.environ.get("PREFECT_API_URL")
    try:
        with get_client(sync_client=True) as client:
            missing = []
            for pool in pools:  # every check first: nothing is created on a mismatch
                try:
                    found = client.read_work_pool(pool)
                except ObjectNotFound:
                    missing.append(pool)
                    continue
                if pool_type and found.type != pool_type:
                    raise DeployError(
                        f"work pool {pool!r} exists with type {found.type!r}, not "
                        f"{pool_type!r}: deploy with --pool-type {found.type}, or delete it "
                        f"first (prefect work-pool delete {pool})")
            for pool in missing:
                template = template_for(pool) if template_for else None
                if template is None:
                    worker_cls = BaseWorker.get_worker_class_from_type(kind)
                    if worker_cls is None:
                        raise DeployError(f"no Prefect worker for pool type {kind!r}")
                    template = worker_cls.get_default_base_job_template()
                try:
                    client.create_work_pool(WorkPoolCreate(
                        name=pool, type=kind, base_job_template=template))
                except Exception as exc:  # noqa: BLE001 - refused by the server
                    if getattr(exc, "response", None) is None:
                        raise
                    raise DeployError(f"Prefect refused the {kind} work pool {pool!r}: "
                                      f"{_server_says(exc)}") from exc
                created.append(pool)
    except DeployError:
        raise
    except Exception as exc:  # noqa: BLE001 - unreachable API, refused...
        raise DeployError(f"cannot create the work pools on {url}: "
                          f"{type(exc).__name__}: {exc}") from exc
    return created


def deploy(path: Path, *, names: list[str] | None = None, create_pools: bool = True,
           pool_type: str | None = None, template_for: TemplateFor | None = None
           ) -> dict[str, Any]:
    """Create (or update) the deployments of ``path``; returns what was done.

    Checks everything it can before it creates anything: the API URL, the file,
    the deployment names, the integration of ``pool_type``."""
    if not os.environ.get("PREFECT_API_URL"):
        raise DeployError(
            "PREFECT_API_URL is not set: deployments live on a Prefect server (start one "
            "with `prefect server start`, or the stack in infra/minio/) and PREFECT_API_URL "
            "must point at it, e.g. http://127.0.0.1:4200/api")
    path = path.resolve()
    deployments = read_deployments(path)
    declared = [d.get("name") for d in deployments]
    unknown = [n for n in names or [] if n not in declared]
    if unknown:
        raise DeployError(f"--name {unknown[0]!r}: {path} declares {', '.join(declared)}")
    require_integration(pool_type or "process")
    chosen = [d for d in deployments if not names or d.get("name") in names]
    pools = work_pools(chosen)
    created = ensure_pools(pools, pool_type, template_for) if create_pools else []
    args = ["--no-prompt", "deploy", "--prefect-file", str(path)]
    if names:
        for name in names:
            args += ["--name", name]
    else:
        args.append("--all")
    out = _run(args)
    return {"file": str(path), "pools": pools, "created_pools": created,
            "deployments": [f"{flow_name(d.get('entrypoint', ''))}/{d['name']}"
                            for d in chosen],
            "output": out.stdout}
