"""Tracking settings from the environment, and what is safe to show of a config.

Settings: ``MLFLOW_TRACKING_URI`` (default: ``sqlite:///<cwd>/mlflow.db``, the
embedded default), ``MLFLOW_EXPERIMENT_NAME`` (default ``diloco-flows``),
``DILOCO_TRACKING=off`` (no tracking at all), ``DILOCO_SYSTEM_METRICS=off`` (no
CPU/memory/network metrics; they also need psutil), ``DILOCO_TRACKING_CLOSE_TIMEOUT``
(seconds a job's end waits for its tracking, 15).

Nothing here imports MLflow: the jobs read these settings whether tracking is on
or not, and importing MLflow takes seconds (docs/results.md, "The diloco
command's start-up").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

DEFAULT_EXPERIMENT = "diloco-flows"
PARAM_MAX_CHARS = 6000
TAG_MAX_CHARS = 8000

# The MLflow client retries an unreachable server for minutes by default; the
# hooks buffer and retry themselves, so each request gives up quickly.
SHORT_HTTP_SETTINGS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}

_OFF = {"off", "0", "false", "no", "disabled"}


def tracking_enabled() -> bool:
    return os.environ.get("DILOCO_TRACKING", "on").strip().lower() not in _OFF


def system_metrics_enabled() -> bool:
    """CPU, memory and network metrics of each job (MLflow's SystemMetricsMonitor)."""
    return (os.environ.get("DILOCO_SYSTEM_METRICS", "on").lower() not in _OFF
            and os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "on").lower() not in _OFF)


def default_close_timeout() -> float:
    """Seconds a job's end waits for its tracking to be sent."""
    return float(os.environ.get("DILOCO_TRACKING_CLOSE_TIMEOUT", "15"))


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI``, else the embedded default: SQLite in the cwd."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    return uri or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def experiment_name() -> str:
    return os.environ.get("MLFLOW_EXPERIMENT_NAME", "").strip() or DEFAULT_EXPERIMENT


RELATIVE_ARTIFACTS = "mlartifacts"


def relative_artifacts_db(uri: str) -> str | None:
    """The SQLite file of ``uri`` when it is in the working directory (the embedded
    default): its experiments keep their artifacts at the relative location
    ``mlartifacts``, which survives moving the directory. None otherwise."""
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri.removeprefix("sqlite:///"))
    with contextlib.suppress(OSError):
        if db.resolve().parent == Path.cwd().resolve():
            return str(db)
    return None


def artifact_location(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: ``mlartifacts`` beside the SQLite
    file for the embedded default. When that file is in the working directory the
    location becomes the relative ``mlartifacts`` (`tracking.runs.create_experiment`;
    ``mlflow ui`` is then opened from that directory, as its hint says, wherever the
    directory has moved); a SQLite file elsewhere gets the absolute path. Else
    MLflow's default: the server's, or ./mlruns."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / RELATIVE_ARTIFACTS).as_uri()
    return None


def strip_credentials(url: str) -> str:
    """``https://user:token@host/x`` -> ``https://host/x`` (never log a secret)."""
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@", r"\1", url)


class _QuietMlflowRetries(logging.Filter):
    """While the server is away, urllib3 warns on every retry of every MLflow
    request and MLflow's asynchronous queue logs an error for every batch it could
    not send; the hooks say it once (and again when the server is back), and count."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == "urllib3.connectionpool":
            return not (record.levelno == logging.WARNING and "/api/2.0/mlflow" in message
                        and message.startswith("Retrying"))
        return "Failed to log run data" not in message


_QUIET = _QuietMlflowRetries()
_NOISY_LOGGERS = ("urllib3.connectionpool", "mlflow.utils.async_logging.async_logging_queue")


def short_http_retries() -> None:
    """Make this process's MLflow HTTP requests give up within seconds (unless the
    user chose otherwise), and keep urllib3 and MLflow's queue from logging each
    failed request."""
    for key, value in SHORT_HTTP_SETTINGS.items():
        os.environ.setdefault(key, value)
    for name in _NOISY_LOGGERS:
        logger = logging.getLogger(name)
        if _QUIET not in logger.filters:
            logger.addFilter(_QUIET)


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> ``{"sync.schedule.sync_every": "30", "workers": '["a", "b"]', ...}``."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        elif isinstance(value, str):
            out[name] = strip_credentials(value)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = str(value)
        else:
            out[name] = json.dumps(value, default=str)
    return {k: clip(v, PARAM_MAX_CHARS) for k, v in out.items()}


def without_credentials(tree: Any) -> Any:
    """A copy of a config with credentials stripped from every URL in it."""
    if isinstance(tree, dict):
        return {k: without_credentials(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [without_credentials(v) for v in tree]
    return strip_credentials(tree) if isinstance(tree, str) else tree


def code_version() -> str:
    """``git describe`` of this checkout when there is one, else the package version."""
    repo = Path(__file__).resolve().parent.parent
    if (repo / ".git").exists():
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                ["git", "-C", str(repo), "describe", "--tags", "--always", "--dirty"],
                capture_output=True, text=True, timeout=5, check=False,
            )
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
    try:
        from importlib.metadata import version  # noqa: PLC0415

        return version("diloco-flows")
    except Exception:  # noqa: BLE001 - not installed: say so
        return "unknown"


def git_commit() -> str | None:
    """The full commit hash of this checkout (``mlflow.source.git.commit``), or None
    when the code does not run from a git checkout (an installed wheel, an image)."""
    repo = Path(__file__).resolve().parent.parent
    if not (repo / ".git").exists():
        return None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=5, check=False)
        if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", out.stdout.strip()):
            return out.stdout.strip()
    return None


def source_tags(name: str) -> dict[str, str]:
    """MLflow's standard source tags of a job's run: ``mlflow.source.type`` (JOB),
    ``mlflow.source.name`` (the job) and ``mlflow.source.git.commit`` when known."""
    tags = {"mlflow.source.type": "JOB", "mlflow.source.name": name}
    commit = git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags


def schedule_of(config: dict[str, Any]) -> dict[str, int] | None:
    """What the aggregator's hooks need to place a round on the inner-step axis."""
    try:
        from diloco.config import SyncConfig  # noqa: PLC0415

        sync = SyncConfig(**(config.get("sync") or {}))
        data, optim = config.get("data") or {}, config.get("optim") or {}
        return {
            "sync_every": sync.schedule.sync_every, "fragments": sync.schedule.fragments,
            "overlap": sync.schedule.send_offset,
            "total_steps": int((config.get("train") or {}).get("steps", 0)),
            "tokens_per_step": int(data.get("batch_size", 0)) * int(data.get("seq_len", 0))
            * int(optim.get("grad_accum", 1)),
        }
    except Exception as exc:  # noqa: BLE001
        logging.getLogger(__name__).debug("no schedule from the config: %s", exc)
        return None


def unanswered(base_url: str, timeout: float = 5.0) -> str | None:
    """Why nothing answers ``GET base_url/health`` (a refused connection, a timeout,
    a bad URL), or None if something does: any HTTP answer counts, a server is
    there. MLflow and Prefect servers both serve ``/health``; the command checks
    each before it writes anything (`tracking_unreachable`, and flows.server's
    ``api_unreachable``)."""
    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/health", timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as exc:
        reason = exc.reason
    except (OSError, ValueError) as exc:
        reason = exc
    return (reason.strerror if isinstance(reason, OSError) and reason.strerror else
            str(reason)) or type(reason).__name__


def tracking_unreachable(uri: str, timeout: float = 5.0) -> str | None:
    """Why no MLflow server answers at an ``http(s)`` tracking ``uri``, or None (any
    HTTP answer counts: a server is there; other schemes are not probed)."""
    if not uri.startswith(("http://", "https://")):
        return None
    return unanswered(uri, timeout)
