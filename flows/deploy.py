"""``diloco deploy``: the deployments of infra/prefect.yaml on a Prefect server.

Creates the work pools the file names (process pools unless told otherwise) when
they do not exist yet, then runs ``prefect deploy --all`` on the file. The flows'
code is found on the machines of each pool through ``DILOCO_WORKDIR`` (the
repository, or /app in the image), which defaults to the current directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
PREFECT_FILE = ROOT / "infra" / "prefect.yaml"


class DeployError(Exception):
    """The deployments could not be created; the message says why."""


def read_deployments(path: Path = PREFECT_FILE) -> list[dict[str, Any]]:
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


def _prefect() -> str:
    exe = Path(sys.executable).parent / "prefect"
    return str(exe) if exe.exists() else "prefect"


def _run(args: list[str], env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([_prefect(), *args], env=env, cwd=env.get("DILOCO_WORKDIR", ROOT),
                         text=True, capture_output=True)
    if check and out.returncode != 0:
        detail = (out.stderr or out.stdout).strip().splitlines()[-12:]
        raise DeployError(f"prefect {' '.join(args)} failed:\n  " + "\n  ".join(detail))
    return out


def ensure_pools(pools: list[str], pool_type: str = "process") -> list[str]:
    """Create the missing work pools (with the default job template of their type);
    returns those it created."""
    from prefect import get_client  # noqa: PLC0415
    from prefect.client.schemas.actions import WorkPoolCreate  # noqa: PLC0415
    from prefect.exceptions import ObjectNotFound  # noqa: PLC0415
    from prefect.workers.base import BaseWorker  # noqa: PLC0415

    created = []
    try:
        with get_client(sync_client=True) as client:
            for pool in pools:
                try:
                    client.read_work_pool(pool)
                    continue
                except ObjectNotFound:
                    pass
                worker_cls = BaseWorker.get_worker_class_from_type(pool_type)
                if worker_cls is None:
                    raise DeployError(f"unknown work pool type {pool_type!r} (is its Prefect "
                                      "integration installed?)")
                client.create_work_pool(WorkPoolCreate(
                    name=pool, type=pool_type,
                    base_job_template=worker_cls.get_default_base_job_template()))
                created.append(pool)
    except DeployError:
        raise
    except Exception as exc:  # noqa: BLE001 - unreachable API, refused...
        raise DeployError(f"cannot create the work pools on {os.environ.get('PREFECT_API_URL')}"
                          f": {type(exc).__name__}: {exc}") from exc
    return created


def deploy(path: Path = PREFECT_FILE, *, names: list[str] | None = None,
           create_pools: bool = True, pool_type: str = "process",
           workdir: Path | None = None) -> dict[str, Any]:
    """Create (or update) the deployments of ``path``; returns what was done."""
    if not os.environ.get("PREFECT_API_URL"):
        raise DeployError(
            "PREFECT_API_URL is not set: deployments live on a Prefect server (start one "
            "with `prefect server start`, or the stack in infra/minio/) and PREFECT_API_URL "
            "must point at it, e.g. http://127.0.0.1:4200/api")
    path = path.resolve()
    deployments = read_deployments(path)
    env = {**os.environ, "DILOCO_WORKDIR": str(
        workdir or os.environ.get("DILOCO_WORKDIR") or ROOT)}
    pools = work_pools(deployments)
    created = ensure_pools(pools, pool_type) if create_pools else []
    args = ["--no-prompt", "deploy", "--prefect-file", str(path)]
    if names:
        for name in names:
            args += ["--name", name]
    else:
        args.append("--all")
    out = _run(args, env)
    return {"file": str(path), "pools": pools, "created_pools": created,
            "deployments": [f"{d.get('entrypoint', '').rsplit(':', 1)[-1]}/{d['name']}"
                            for d in deployments
                            if not names or d["name"] in names],
            "output": out.stdout}
