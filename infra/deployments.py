"""The deployment files that ship with the package: ``prefect.yaml`` (a work pool
per region) and the base job templates of docker and kubernetes work pools in
``pools/``.

They sit beside this module in a checkout and in an installed wheel alike (package
data), so ``diloco deploy`` finds them from any directory, on any machine. The
command (cli/deploy.py) reads them here and hands them to flows/deploy.py, which
talks to Prefect.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PREFECT_FILE = HERE / "prefect.yaml"
POOLS = HERE / "pools"

#: The work pool types `diloco deploy` creates. Process pools get Prefect's default
#: job template; the others a template of ours, from the integration's default.
POOL_TYPES = ("process", "docker", "kubernetes")

#: The variable of a template that names the region's credentials (kubernetes: the
#: Secret its jobs take AWS_* from); each region's pool gets its own default.
CREDENTIALS_VARIABLE = "credentials_secret"


class TemplateError(ValueError):
    """A pool type without a template, or a template file that cannot be read."""


def credentials_secret(pool: str) -> str:
    """The Kubernetes Secret that holds region ``pool``'s bucket credentials."""
    return f"diloco-{pool}"


def pool_template(pool_type: str, pool: str, image: str | None = None) -> dict[str, Any] | None:
    """The base job template of region ``pool``'s work pool of ``pool_type``, or
    None for a process pool (Prefect's default template serves it).

    One file per type serves every region: the default of the credentials variable
    is made the region's own here, so two regions never share a Secret by accident.
    ``image``, when given, is the default image of the pool's jobs (a local build's
    tag, ``localhost/diloco-flows:latest``, or a registry's).
    """
    if pool_type not in POOL_TYPES:
        raise TemplateError(f"pool type {pool_type!r} is not one of: {', '.join(POOL_TYPES)}")
    if pool_type == "process":
        return None
    path = POOLS / f"{pool_type}.json"
    try:
        template = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TemplateError(f"cannot read the {pool_type} pool template {path}: {exc}") from exc
    variable = template.get("variables", {}).get("properties", {}).get(CREDENTIALS_VARIABLE)
    if variable is not None:
        variable["default"] = credentials_secret(pool)
    if image:
        template["variables"]["properties"]["image"]["default"] = image
    return template
