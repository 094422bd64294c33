"""``diloco deploy``: the deployments of infra/prefect.yaml on a Prefect server
(`flows.deploy` does it; this module prints)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.console import console, fail, user_errors
from flows import deploy as deploying


def deploy(
    prefect_file: Annotated[Path, typer.Option(
        "--file", help="the deployments file")] = Path("infra/prefect.yaml"),
    names: Annotated[list[str] | None, typer.Option(
        "--name", help="deploy only these deployments (repeatable)")] = None,
    create_pools: Annotated[bool, typer.Option(
        help="create the work pools the file names when missing")] = True,
    pool_type: Annotated[str, typer.Option(
        help="type of the pools it creates (process, docker, kubernetes...)")] = "process",
) -> None:
    """Create the deployments of infra/prefect.yaml (train, a worker per region,
    aggregator) on the Prefect server at $PREFECT_API_URL."""
    path = prefect_file
    if not path.exists() and not path.is_absolute():
        path = deploying.PREFECT_FILE
    try:
        with console.status(f"deploying {path} ..."):
            done = deploying.deploy(path, names=names, create_pools=create_pools, pool_type=pool_type)
    except user_errors() as exc:
        raise fail(str(exc)) from None
    if done["created_pools"]:
        console.print(f"created work pools: {', '.join(done['created_pools'])}")
    console.print(f"deployments: {', '.join(done['deployments'])} (pools: "
                  f"{', '.join(done['pools'])})")
    console.print("start a worker per pool: " + "; ".join(
        f"prefect worker start --pool {p}" for p in done["pools"]))
