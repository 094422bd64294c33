"""``diloco deploy``: the deployments of infra/prefect.yaml on a Prefect server
(`flows.deploy` does it; the files come from `infra.deployments`; this module
prints)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from cli.console import console, fail, user_errors
from flows import deploy as deploying
from infra import deployments as shipped


class PoolType(StrEnum):
    process = "process"
    docker = "docker"
    kubernetes = "kubernetes"


def deploy(
    prefect_file: Annotated[Path | None, typer.Option(
        "--file", help="a deployments file of yours (default: the package's "
        "infra/prefect.yaml)")] = None,
    names: Annotated[list[str] | None, typer.Option(
        "--name", help="deploy only these deployments (repeatable)")] = None,
    create_pools: Annotated[bool, typer.Option(
        help="create the work pools the file names when missing")] = True,
    pool_type: Annotated[PoolType | None, typer.Option(
        help="type of the pools it creates (default process); docker and kubernetes "
        "pools get the templates of infra/pools/, one pool per region")] = None,
    image: Annotated[str | None, typer.Option(
        help="the image of the docker or kubernetes pools it creates (default "
        "diloco-flows:latest; scripts/docker-image tags localhost/diloco-flows:latest)")] = None,
) -> None:
    """Create the deployments of infra/prefect.yaml (train, a worker per region,
    aggregator) on the Prefect server at $PREFECT_API_URL."""
    path = prefect_file or shipped.PREFECT_FILE
    if prefect_file is not None and not prefect_file.is_file():
        raise fail(f"--file {prefect_file}: no such file")
    kind = pool_type.value if pool_type else None
    if image is not None and kind in (None, "process"):
        raise fail("--image is for docker and kubernetes pools (--pool-type docker)")

    def template_for(pool: str) -> dict | None:
        return shipped.pool_template(kind or "process", pool, image=image)

    try:
        with console.status(f"deploying {path} ..."):
            done = deploying.deploy(path, names=names, create_pools=create_pools,
                                    pool_type=kind, template_for=template_for)
    except (*user_errors(), shipped.TemplateError) as exc:
        raise fail(str(exc)) from None  # [cloud] is not markup
    if done["created_pools"]:
        console.print(f"created {kind or 'process'} work pools: "
                      f"{', '.join(done['created_pools'])}")
    console.print(f"deployments: {', '.join(done['deployments'])} (pools: "
                  f"{', '.join(done['pools'])})")
    console.print("start a worker per pool: " + "; ".join(
        f"prefect worker start --pool {p}" for p in done["pools"]))
