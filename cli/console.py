"""What the command prints and how it fails: the consoles, exit statuses, one-line
errors, and the hints at the end of a run.

Errors a user can act on are one line on stderr and exit status 2; nothing is
launched. A run that fails exits 1, a cancelled one 3, Ctrl-C 130.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from tracking.settings import tracking_enabled
from workers.data.errors import DataError

#: The width of what is printed to a pipe or a file when COLUMNS does not say.
PIPED_WIDTH = 160


def width_for(stream: object) -> int | None:
    """The console width for ``stream``: a terminal's own (None: rich asks it);
    piped (CI, tests, logs), COLUMNS when it says 80 or more, else PIPED_WIDTH.
    The tables fit any width from 80 up (they drop columns, never cut a figure)."""
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return None
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    return columns if columns >= 80 else PIPED_WIDTH


console = Console(width=width_for(sys.stdout))
errors = Console(stderr=True, width=width_for(sys.stderr))


def _one_line_deprecations(show: Any) -> Any:
    """``warnings.showwarning`` that prints a recipe's deprecated key as one line
    (``warning: tiny.yaml: sync.sync_every is deprecated; use ...``), not Python's
    file, line and source; every other warning as before."""
    def showwarning(message: Warning | str, category: type[Warning], *args: Any,
                    **kwargs: Any) -> None:
        if category.__name__ == "DeprecatedKey":
            errors.print(f"[yellow]warning:[/] {escape(str(message))}", highlight=False,
                         soft_wrap=True)
        else:
            show(message, category, *args, **kwargs)
    return showwarning


warnings.showwarning = _one_line_deprecations(warnings.showwarning)

EXIT_FAILED, EXIT_USAGE, EXIT_CANCELLED, EXIT_INTERRUPTED = 1, 2, 3, 130


class Backend(StrEnum):
    local = "local"
    deployments = "deployments"


def backend_named(value: str) -> Backend:
    """The ``--backend`` a user named; one line naming the allowed values if none."""
    try:
        return Backend(value.strip().lower())
    except ValueError:
        raise fail(f"--backend {value}: no such backend; use one of: "
                   f"{', '.join(b.value for b in Backend)}") from None


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    """Print ``message`` as one error line; the caller raises what this returns.

    The message is plain text, never markup: errors quote user input and
    commands such as ``pip install 'diloco-flows[cloud]'``, whose brackets rich
    would otherwise swallow."""
    errors.print(f"[bold red]error:[/] {escape(message)}", highlight=False, markup=True,
                 soft_wrap=True)
    return typer.Exit(code)


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors that are the user's to fix: one message, exit 2.

    Imported when first needed: `workers.config` brings torch (see the package
    docstring for what that costs every command)."""
    from flows.deploy import DeployError  # noqa: PLC0415
    from flows.launchers import LaunchError  # noqa: PLC0415
    from storage.backends import CredentialsInURL  # noqa: PLC0415
    from storage.errors import (  # noqa: PLC0415
        ManifestInvalid,
        RunExists,
        RunNotFound,  # noqa: PLC0415
    )
    from storage.reach import StoreUnreachable  # noqa: PLC0415
    from workers.config import ConfigError  # noqa: PLC0415 - torch

    return (ConfigError, RunNotFound, StoreUnreachable, RunExists, ManifestInvalid, DataError,
            DeployError, LaunchError, CredentialsInURL)


def quiet_logs(verbose: bool) -> None:
    """Before Prefect and MLflow are imported: their INFO lines would tear through
    the progress bars. The temporary server of the embedded default sends no
    telemetry (it would only print errors on machines without internet access)."""
    # Prefect's loggers pass INFO, so the flow runs' logs reach its API (the UI shows
    # them); its console handler shows only errors here, unless --verbose.
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL",
                          "INFO" if verbose else "ERROR")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    if not os.environ.get("PREFECT_API_URL"):
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        # The temporary server needs more than Prefect's default 20 s to start on a
        # busy two-core machine; a slow start must not fail the run.
        os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def shown(url: str) -> str:
    """A local run path relative to the working directory when it is under it."""
    if "://" in url:
        return url
    try:
        return str(Path(url).relative_to(Path.cwd()))
    except ValueError:
        return url


def runnable(hint: str) -> str:
    """``hint`` with its program (``diloco``, ``mlflow``, ``prefect``) written so it
    runs as printed: the bare name when this shell finds the same program on PATH,
    else its path (``.venv/bin/diloco`` from the checkout), so a user who never
    activated the virtualenv can paste it."""
    program, sep, rest = hint.partition(" ")
    if program not in ("diloco", "mlflow", "prefect"):
        return hint
    here = Path(sys.executable).parent / program
    found = shutil.which(program)
    if not here.exists() or (found and Path(found).resolve() == here.resolve()):
        return hint
    return f"{shown(str(here))}{sep}{rest}"


def mlflow_hint() -> str:
    if not tracking_enabled():
        return "tracking off (DILOCO_TRACKING=off)"
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri and not uri.startswith("sqlite:"):
        return uri
    return f"mlflow ui --backend-store-uri {uri or 'sqlite:///mlflow.db'}"


def prefect_hint(ended: bool = False) -> str:
    """Where the flow runs can be seen. A temporary server ends with the command, so
    after it there is nothing to open: say so, and how to keep them next time."""
    url = os.environ.get("PREFECT_API_URL")
    if url:
        return url.removesuffix("/api")
    if ended:
        return ("none kept: the temporary server stopped with this command (to keep "
                "flow runs, `prefect server start` and set PREFECT_API_URL)")
    return "temporary local server"
