"""MLflow tracking of a training run: the `Hooks` seam implemented with MLflow.

One parent run per training run (the whole resolved config as params; tags for
the store URL, regions, code version, mode and strategy), a child run per worker
(named after it) and one for the aggregator. Every job of a run is its own
process, possibly in another region, so the parent is found through the run's
store: the train job's hooks create the parent and write ``tracking.json`` there
(create-only, like every object of the protocol)::

    {"version": 1,
     "tracking_uri": "http://mlflow.internal:5000",   # credentials stripped
     "experiment_id": "3", "experiment_name": "diloco-flows",
     "parent_run_id": "4c1d...", "run_name": "run-42", "created": "2026-...",
     "strategy": "diloco", "mode": "streaming", "workers": ["region-a", "region-b"],
     "schedule": {"sync_every": 30, "fragments": 2, "overlap": 1,
                  "total_steps": 300, "tokens_per_step": 2048}}

Worker and aggregator hooks read it and create their child run (tag
``mlflow.parentRunId``), or continue the one a previous attempt of the same job
created (found by the ``diloco.child`` tag). They use ``MLFLOW_TRACKING_URI`` when
set in their own environment (a region may reach the server by another address,
and credentials come from the environment), else the URI in ``tracking.json``.

Logging never stops or slows training (DESIGN.md, principle 1). A hook call only
appends to a bounded in-memory buffer and returns; one background thread per
hooks object creates the runs and sends metrics with ``log_batch`` (at most every
``flush_every`` seconds or ``batch_size`` metrics), retrying with backoff while
the server is unreachable. Past ``max_buffer`` metrics the oldest are dropped;
`close()` waits a bounded time (``DILOCO_TRACKING_CLOSE_TIMEOUT``, 15 s) and logs a
warning saying how many metrics, params, tags, artifacts (and runs) were not logged;
it returns the counts, ``not_logged`` keeps them, and the train job writes its own
into the summary artifact. A job whose ``close()`` runs while an exception
propagates ends its run FAILED.

Settings (environment): ``MLFLOW_TRACKING_URI`` (default: ``sqlite:///<cwd>/mlflow.db``,
the embedded default), ``MLFLOW_EXPERIMENT_NAME`` (default ``diloco-flows``),
``DILOCO_TRACKING=off`` (no tracking at all), ``DILOCO_SYSTEM_METRICS=off``
(no CPU/memory/network metrics; they also need psutil).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tracking.hooks import Hooks
from tracking.plots import RUN_PLOTS

log = logging.getLogger(__name__)

TRACKING_KEY = "tracking.json"
DEFAULT_EXPERIMENT = "diloco-flows"
PARAM_MAX_CHARS = 6000
TAG_MAX_CHARS = 8000
PARAMS_PER_BATCH = 100

# The MLflow client retries an unreachable server for minutes by default; the
# background thread has its own backoff, so each request gives up quickly.
SHORT_HTTP_SETTINGS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}

# MLflow error codes that a retry cannot fix.
_PERMANENT_CODES = frozenset({
    "INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS",
    "INVALID_STATE", "BAD_REQUEST", "PERMISSION_DENIED", "UNAUTHENTICATED",
    "ENDPOINT_NOT_FOUND",
})

_STATUS = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED",
           "cancelled": "KILLED", "crashed": "FAILED"}


# -- settings ---------------------------------------------------------------------

def tracking_enabled() -> bool:
    return os.environ.get("DILOCO_TRACKING", "on").strip().lower() not in {
        "off", "0", "false", "no", "disabled"}


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI``, else the embedded default: SQLite in the cwd."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    return uri or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def experiment_name() -> str:
    return os.environ.get("MLFLOW_EXPERIMENT_NAME", "").strip() or DEFAULT_EXPERIMENT


def strip_credentials(url: str) -> str:
    """``https://user:token@host/x`` -> ``https://host/x`` (never log a secret)."""
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@", r"\1", url)


class _QuietMlflowRetries(logging.Filter):
    """urllib3 warns on every retry of every MLflow request while the server is
    away; the hooks say it once (and again when it is back)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING
                    and "/api/2.0/mlflow" in record.getMessage()
                    and record.getMessage().startswith("Retrying"))


_QUIET = _QuietMlflowRetries()


def short_http_retries() -> None:
    """Make this process's MLflow HTTP requests give up within seconds (unless the
    user chose otherwise), and keep urllib3 from logging each retry."""
    for key, value in SHORT_HTTP_SETTINGS.items():
        os.environ.setdefault(key, value)
    pool_log = logging.getLogger("urllib3.connectionpool")
    if _QUIET not in pool_log.filters:
        pool_log.addFilter(_QUIET)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> ``{"sync.sync_every": "30", "workers": '["a", "b"]', ...}``."""
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
    return {k: _clip(v, PARAM_MAX_CHARS) for k, v in out.items()}


def without_credentials(tree: Any) -> Any:
    """A copy of a config with credentials stripped from every URL in it."""
    if isinstance(tree, dict):
        return {k: without_credentials(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [without_credentials(v) for v in tree]
    return strip_credentials(tree) if isinstance(tree, str) else tree


def artifact_location(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside the SQLite file for the
    embedded default (else MLflow's default: the server's, or ./mlruns)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
    return None


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


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


def model_parameters(config: dict[str, Any]) -> int | None:
    """Number of model parameters of a resolved config (built on the meta device:
    no memory, no init cost)."""
    try:
        import torch  # noqa: PLC0415

        from workers.config import RunConfig  # noqa: PLC0415
        from workers.model import Transformer  # noqa: PLC0415

        cfg = RunConfig.model_validate(config)
        with torch.device("meta"):
            model = Transformer(cfg.model_config_resolved)
        return int(sum(p.numel() for p in model.parameters()))
    except Exception as exc:  # noqa: BLE001 - a missing count only loses a param
        log.debug("could not count the model's parameters: %s", exc)
        return None


def schedule_of(config: dict[str, Any]) -> dict[str, int] | None:
    """What the aggregator's hooks need to place a round on the inner-step axis."""
    try:
        from diloco.config import SyncConfig  # noqa: PLC0415

        sync = SyncConfig(**(config.get("sync") or {}))
        data, optim = config.get("data") or {}, config.get("optim") or {}
        return {
            "sync_every": sync.sync_every, "fragments": sync.fragments,
            "overlap": sync.send_offset,
            "total_steps": int((config.get("train") or {}).get("steps", 0)),
            "tokens_per_step": int(data.get("batch_size", 0)) * int(data.get("seq_len", 0))
            * int(optim.get("grad_accum", 1)),
        }
    except Exception as exc:  # noqa: BLE001
        log.debug("no schedule from the config: %s", exc)
        return None


def hooks_for(run_url: str, *, role: str, storage_options: dict | None = None) -> Hooks:
    """The hooks a job of ``role`` ("train", "worker:<name>", "aggregator") uses:
    `MlflowHooks` when tracking is on, else no-op `Hooks`. Never touches the network."""
    if not tracking_enabled():
        return Hooks()
    return MlflowHooks(run_url, role=role, storage_options=storage_options)


# -- errors -------------------------------------------------------------------------

class _NotReady(Exception):
    """Something another job writes (tracking.json) is not there yet."""


class _Permanent(Exception):
    """A failure a retry cannot fix."""


def _is_permanent(exc: BaseException) -> bool:
    if isinstance(exc, _Permanent):
        return True
    code = getattr(exc, "error_code", None)
    return isinstance(code, str) and code in _PERMANENT_CODES


@dataclass
class _Task:
    """Work for the background thread, done in order; ``lost`` is what is not
    logged if it is given up."""

    name: str
    fn: Callable[[], None]
    lost: dict[str, int] = field(default_factory=dict)
    flush_first: bool = False


# -- the hooks ------------------------------------------------------------------------

class MlflowHooks(Hooks):
    """Hooks that log to MLflow from a background thread (see the module docstring).

    ``role``: "train" (creates the parent run and writes tracking.json),
    "worker:<name>" or "aggregator" (create or continue their child run).
    """

    def __init__(
        self,
        run_url: str,
        *,
        role: str,
        storage_options: dict | None = None,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        flush_every: float = 2.0,
        batch_size: int = 1000,
        max_buffer: int = 100_000,
        close_timeout: float | None = None,
        system_metrics: bool | None = None,
    ) -> None:
        if role != "train" and role != "aggregator" and not role.startswith("worker:"):
            raise ValueError(
                f"hooks role {role!r}: expected 'train', 'worker:<name>' or 'aggregator'")
        short_http_retries()
        self.run_url = run_url
        self.role = role
        self.storage_options = storage_options
        self.run_name = run_url.rstrip("/").rsplit("/", 1)[-1] or "run"
        self.experiment = experiment or experiment_name()
        explicit = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "").strip() or None
        # the train job decides the URI; the others follow tracking.json unless told
        self._uri: str | None = explicit or (default_tracking_uri() if role == "train" else None)
        self.flush_every = flush_every
        self.batch_size = min(batch_size, 1000)
        self.close_timeout = (
            close_timeout if close_timeout is not None
            else float(os.environ.get("DILOCO_TRACKING_CLOSE_TIMEOUT", "15")))
        if system_metrics is None:
            off = {"off", "0", "false", "no"}
            system_metrics = (
                os.environ.get("DILOCO_SYSTEM_METRICS", "on").lower() not in off
                and os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "on").lower()
                not in off)
        self.system_metrics = system_metrics

        self._lock = threading.Lock()
        self._buffer: deque[tuple] = deque()
        self._max_buffer = max_buffer
        self._tasks: deque[_Task] = deque()
        self._inflight: dict[str, list[tuple]] = {}
        self._dropped: Counter[str] = Counter()
        self._wanted: set[str] = set()
        self._runs: dict[str, str] = {}  # run key ("parent", "worker:a", ...) -> run id
        self._dead_keys: dict[str, str] = {}  # run key -> why it cannot be logged to
        self._opened: dict[str, bool] = {}  # runs this process started -> ended?
        self._monitors: dict[str, Any] = {}
        self._info: dict[str, Any] | None = None
        self._client_obj: Any = None
        self._store_obj: Any = None
        self._config: dict[str, Any] | None = None
        self._round_counter = 0
        self._started_ms: int | None = None
        self._n_params: int | None = None
        self._created_parent: Any = None
        self._last_error = ""
        self._outage_since: float | None = None
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._abandoned = threading.Event()  # close() stopped waiting: stop trying
        self._closed = False
        self.not_logged: dict[str, int] = {}
        self._thread = threading.Thread(target=self._loop, name=f"mlflow-{role}", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # -- the Hooks API: each call appends and returns --------------------------------

    def run_started(self, config: dict[str, Any], run_url: str, *, resumed: bool) -> None:
        try:
            self._config = dict(config)
            self._started_ms = int(time.time() * 1000)
            self._want("parent")
            self._task(_Task("start the parent run",
                             lambda: self._start_parent(dict(config), resumed),
                             lost={"runs": 1}))
            self._task(_Task("log the config as params",
                             lambda: self._log_config(dict(config)),
                             lost={"params": len(flatten(config)) + 1}))
        except Exception:  # noqa: BLE001 - a hook never raises
            log.debug("run_started not tracked", exc_info=True)

    def worker_started(self, worker: str, info: dict[str, Any]) -> None:
        try:
            key = f"worker:{worker}"
            tags = {f"diloco.info.{k}": _clip(str(v), TAG_MAX_CHARS) for k, v in info.items()}
            self._want(key)
            self._task(_Task(f"tag {key}", lambda: self._set_tags(key, tags),
                             lost={"tags": len(tags)}))
        except Exception:  # noqa: BLE001
            log.debug("worker_started not tracked", exc_info=True)

    def worker_metrics(self, worker: str, metrics: dict[str, Any]) -> None:
        try:
            key = f"worker:{worker}"
            step = int(metrics.get("step", 0))
            ts = int(time.time() * 1000)
            items = [(key, name, float(value), ts, step, 1)
                     for name, value in metrics.items()
                     if name not in ("worker", "step", "final") and _is_number(value)]
            self._want(key)
            self._append(items)
        except Exception:  # noqa: BLE001
            log.debug("worker_metrics not tracked", exc_info=True)

    def worker_finished(self, worker: str, result: dict[str, Any], state: str) -> None:
        try:
            key = f"worker:{worker}"
            ts = int(time.time() * 1000)
            step = int(result.get("steps") or 0)
            items = [(key, f"result/{name}", float(value), ts, step, 1)
                     for name, value in result.items() if _is_number(value)]
            self._want(key)
            self._append(items)
            status = _STATUS.get(state, "FINISHED")
            self._task(_Task(f"end {key}", lambda: self._end_run(key, status, state),
                             flush_first=True))
        except Exception:  # noqa: BLE001
            log.debug("worker_finished not tracked", exc_info=True)

    def aggregator_round(self, report: dict[str, Any]) -> None:
        try:
            ts = int(time.time() * 1000)
            size = 5 + len(report.get("weights") or {}) + sum(
                1 for k in ("eval_loss", "perplexity", "bytes_up", "bytes_down")
                if _is_number(report.get(k)))
            self._want("aggregator")
            report = dict(report, weights=dict(report.get("weights") or {}))
            self._append([("aggregator", "__round__", report, ts, None, size)])
        except Exception:  # noqa: BLE001
            log.debug("aggregator_round not tracked", exc_info=True)

    def aggregator_eval(self, report: dict[str, Any]) -> None:
        """The final evaluation of the canonical model, at the index of the last
        round applied (where a round report's eval would sit)."""
        try:
            ts = int(time.time() * 1000)
            values = {k: float(report[k]) for k in ("eval_loss", "perplexity")
                      if _is_number(report.get(k))}
            if values:
                values["rounds"] = int(report.get("rounds", 1))
                self._want("aggregator")
                self._append([("aggregator", "__eval__", values, ts, None, len(values))])
        except Exception:  # noqa: BLE001
            log.debug("aggregator_eval not tracked", exc_info=True)

    def run_finished(self, summary: dict[str, Any]) -> None:
        try:
            self._want("parent")
            self._task(_Task("log the summary, config and plots",
                             lambda: self._finish_parent(dict(summary)),
                             lost={"artifacts": 2 + len(RUN_PLOTS)}, flush_first=True))
        except Exception:  # noqa: BLE001
            log.debug("run_finished not tracked", exc_info=True)

    def close(self, timeout: float | None = None) -> dict[str, int]:
        """Flush (at most ``timeout`` seconds), end the runs this process opened, and
        say what was not logged. Returns the counts (metrics, params, tags, artifacts)."""
        if self._closed:
            return self.not_logged
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        timeout = self.close_timeout if timeout is None else timeout
        # called from a `finally` while an exception propagates: the job failed
        failed = sys.exc_info()[0] is not None
        self._task(_Task("end the open runs", lambda: self._end_open_runs(failed),
                         flush_first=True))
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout)
        self._abandoned.set()
        with self._lock:
            lost = Counter(self._dropped)
            lost["metrics"] += sum(n for *_, n in self._buffer)
            lost["metrics"] += sum(n for items in self._inflight.values() for *_, n in items)
            for task in self._tasks:
                lost.update(task.lost)
        self.not_logged = {k: int(v) for k, v in lost.items() if v}
        self._stop_monitors(wait=2.0)
        if self.not_logged:
            what = ", ".join(f"{v} {k}" for k, v in sorted(self.not_logged.items()))
            log.warning(
                "MLflow tracking of run %s (%s, %s): not logged: %s%s", self.run_name,
                self.role, strip_credentials(self._uri or "no tracking URI yet"), what,
                f" (last error: {self._last_error})" if self._last_error else "")
        return self.not_logged

    # -- queueing (hook side; microseconds) ------------------------------------------

    def _append(self, items: list[tuple]) -> None:
        with self._lock:
            for item in items:
                if len(self._buffer) >= self._max_buffer:
                    self._dropped["metrics"] += self._buffer.popleft()[-1]
                self._buffer.append(item)
            full = len(self._buffer) >= self.batch_size
        if full and self._outage_since is None:
            self._wake.set()

    def _task(self, task: _Task) -> None:
        with self._lock:
            self._tasks.append(task)
        if self._outage_since is None:
            self._wake.set()

    def _want(self, key: str) -> None:
        if key not in self._wanted:
            with self._lock:
                self._wanted.add(key)

    # -- the background thread ---------------------------------------------------------

    def _loop(self) -> None:
        delay = 0.0
        while not self._abandoned.is_set():
            if delay:
                self._closing.wait(delay)  # backoff: only close() cuts it short
            else:
                self._wake.wait(self.flush_every)
            self._wake.clear()
            if self._abandoned.is_set():
                break
            closing = self._closing.is_set()
            try:
                self._work()
            except _NotReady as exc:  # poll; close() decides how long to wait
                self._last_error = str(exc)
                delay = 0.25 if closing else min(max(0.5, delay * 2), 5.0)
            except Exception as exc:  # noqa: BLE001 - transient: retry with backoff
                self._note_outage(exc)
                if closing:  # one last attempt was made: give up, close() counts
                    break
                delay = min(max(1.0, delay * 2), 30.0)
            else:
                if self._outage_since is not None:
                    log.info("MLflow tracking (%s): the server answers again after %.0f s",
                             self.role, time.monotonic() - self._outage_since)
                    self._outage_since = None
                delay = 0.0
                if closing and self._idle():
                    break

    def _note_outage(self, exc: BaseException) -> None:
        self._last_error = f"{type(exc).__name__}: {_clip(str(exc), 300)}"
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            log.warning("MLflow tracking (%s, %s) unreachable, buffering and retrying: %s",
                        self.role, strip_credentials(self._uri or "?"), self._last_error)

    def _idle(self) -> bool:
        with self._lock:
            return not self._tasks and not self._buffer and not self._inflight

    def _work(self) -> None:
        while True:
            with self._lock:
                task = self._tasks[0] if self._tasks else None
            if task is None:
                break
            if task.flush_first:
                self._flush()
            try:
                task.fn()
            except (_NotReady, _Permanent) as exc:
                if isinstance(exc, _NotReady):
                    raise
                self._give_up(task, exc)
            except Exception as exc:
                if not _is_permanent(exc):
                    raise
                self._give_up(task, exc)
            with self._lock:
                self._tasks.popleft()
        self._flush()

    def _give_up(self, task: _Task, exc: BaseException) -> None:
        with self._lock:
            self._dropped.update(task.lost)
        log.warning("MLflow tracking (%s): could not %s: %s", self.role, task.name,
                    _clip(str(exc), 500))

    def _flush(self) -> None:
        """Send the buffered metrics of resolved runs, ``batch_size`` at a time."""
        from mlflow.entities import Metric  # noqa: PLC0415

        with self._lock:
            wanted = set(self._wanted)
        for key in sorted(wanted - set(self._runs) - set(self._dead_keys)):
            if key != "parent":  # the parent comes from the train job's start task only
                self._resolve_child(key)
        while True:
            with self._lock:
                if not self._inflight:
                    self._inflight = self._take_batch()
                batch = {k: list(v) for k, v in self._inflight.items()}
            if not batch:
                return
            for key, items in batch.items():
                metrics = [Metric(name, value, ts, step)
                           for name, value, ts, step in self._expand(key, items)]
                run_id = self._runs.get(key)
                if run_id is None:  # a run that cannot be logged to
                    self._drop(key, items, self._dead_keys.get(key, "no run"))
                    continue
                try:
                    for i in range(0, len(metrics), 1000):
                        self._client().log_batch(run_id, metrics=metrics[i : i + 1000],
                                                 synchronous=True)
                except Exception as exc:
                    if not _is_permanent(exc):
                        raise
                    self._drop(key, items, str(exc))
                    continue
                with self._lock:
                    self._inflight.pop(key, None)

    def _drop(self, key: str, items: list[tuple], why: str) -> None:
        with self._lock:
            self._dropped["metrics"] += sum(n for *_, n in items)
            self._inflight.pop(key, None)
        log.warning("MLflow tracking (%s): %d metrics of %s not logged: %s", self.role,
                    sum(n for *_, n in items), key, _clip(why, 300))

    def _take_batch(self) -> dict[str, list[tuple]]:
        """Under the lock: up to batch_size items of runs that are resolved (or dead)."""
        out: dict[str, list[tuple]] = {}
        count = 0
        while self._buffer and count < self.batch_size:
            key = self._buffer[0][0]
            if key not in self._runs and key not in self._dead_keys:
                break  # keep order; its run is not there yet
            item = self._buffer.popleft()
            out.setdefault(key, []).append(item)
            count += item[-1]
        return out

    def _expand(self, key: str, items: list[tuple]) -> list[tuple[str, float, int, int]]:
        """(name, value, timestamp, step) of each buffered item; a round report
        becomes the aggregator's metrics at its global round index."""
        out = []
        for _key, name, value, ts, step, _n in items:
            if name == "__round__":
                out.extend(self._round_metrics(value, ts))
            elif name == "__eval__":
                out.extend(self._eval_metrics(value, ts))
            else:
                out.append((name, value, ts, step))
        return out

    def _eval_metrics(self, values: dict[str, Any], ts: int) -> list[tuple]:
        """The final evaluation, at the last round's index (whose report already
        placed ``inner_step`` there)."""
        k = max(0, int(values.pop("rounds")) - 1)
        return [(name, v, ts, k) for name, v in values.items()]

    def _round_metrics(self, report: dict[str, Any], ts: int) -> list[tuple]:
        """Step = the round's merge point in the whole schedule, r * P + p (unique and
        the same after a restart); ``inner_step`` places it on the workers' axis."""
        p, r = int(report.get("fragment", 0)), int(report.get("round", 0))
        sched = (self._info or {}).get("schedule") or {}
        frags = int(sched.get("fragments") or 0)
        if frags > 0:
            k = r * frags + p
        else:
            k, self._round_counter = self._round_counter, self._round_counter + 1
        weights = report.get("weights") or {}
        out = [(f"grad_norm/frag{p}", float(report.get("grad_norm", math.nan)), ts, k),
               ("participation", float(len(weights)), ts, k),
               ("rejected", float(len(report.get("rejected") or {})), ts, k),
               ("round_seconds", float(report.get("seconds", math.nan)), ts, k)]
        out += [(f"weight/{w}", float(v), ts, k) for w, v in weights.items()]
        for name in ("eval_loss", "perplexity", "bytes_up", "bytes_down"):
            if _is_number(report.get(name)):
                out.append((name, float(report[name]), ts, k))
        if frags > 0 and sched.get("sync_every"):
            stride = int(sched["sync_every"]) // frags
            inner = (k + 1) * stride
            if sched.get("total_steps"):
                inner = min(inner, int(sched["total_steps"]))
            out.append(("inner_step", float(inner), ts, k))
        return out

    # -- MLflow and the store (background thread only) ---------------------------------

    def _client(self) -> Any:
        if self._client_obj is None:
            from mlflow import MlflowClient  # noqa: PLC0415

            if self._uri is None:
                self._uri = (self._tracking_info().get("tracking_uri")
                             or default_tracking_uri())
            self._client_obj = MlflowClient(tracking_uri=self._uri)
        return self._client_obj

    def _store(self) -> Any:
        if self._store_obj is None:
            from storage.objectstore import ObjectStore, RetryPolicy  # noqa: PLC0415

            self._store_obj = ObjectStore(
                self.run_url, storage_options=self.storage_options, name="tracking",
                retry=RetryPolicy(attempts=3, base_delay=0.2, max_delay=2.0))
        return self._store_obj

    def _tracking_info(self) -> dict[str, Any]:
        if self._info is None:
            from storage.errors import ObjectMissing  # noqa: PLC0415

            try:
                self._info = json.loads(self._store().get(TRACKING_KEY))
            except ObjectMissing:
                raise _NotReady(
                    f"{TRACKING_KEY} is not in {self._store().url} yet (the train job "
                    "writes it when it creates the MLflow run; is tracking on there?)"
                ) from None
        return self._info

    def _experiment_id(self) -> str:
        client = self._client()
        found = client.get_experiment_by_name(self.experiment)
        if found is not None:
            if found.lifecycle_stage == "deleted":
                client.restore_experiment(found.experiment_id)
            return found.experiment_id
        try:
            return client.create_experiment(self.experiment,
                                            artifact_location=artifact_location(self._uri))
        except Exception as exc:
            if getattr(exc, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                raise
            return client.get_experiment_by_name(self.experiment).experiment_id

    def _start_parent(self, config: dict[str, Any], resumed: bool) -> None:
        from storage.errors import ObjectMissing  # noqa: PLC0415

        client = self._client()
        try:
            self._info = json.loads(self._store().get(TRACKING_KEY))
        except ObjectMissing:
            self._info = None
        if self._info is not None:  # this run is tracked already: continue its parent
            parent = self._info["parent_run_id"]
            client.update_run(parent, status="RUNNING")
            log.info("MLflow: run %s continues parent run %s", self.run_name, parent)
        else:
            exp = self._experiment_id()
            workers = [str(w) for w in config.get("workers") or []]
            train, sync = config.get("train") or {}, config.get("sync") or {}
            tags = {
                "diloco.role": "train",
                "diloco.run_id": self.run_name,
                "diloco.store": strip_credentials(self._store().url),
                "diloco.regions": ",".join(workers),
                "diloco.code_version": code_version(),
                "diloco.mode": str(sync.get("mode", "")),
                "diloco.strategy": str(train.get("strategy", "diloco")),
                "diloco.config_name": str(config.get("name", "")),
            }
            if self._created_parent is None:  # a retry must not create a second one
                self._created_parent = client.create_run(
                    exp, run_name=self.run_name, tags=tags, start_time=self._started_ms)
            run = self._created_parent
            info = {
                "version": 1,
                "tracking_uri": strip_credentials(self._uri or ""),
                "experiment_id": exp,
                "experiment_name": self.experiment,
                "parent_run_id": run.info.run_id,
                "run_name": self.run_name,
                "created": datetime.now(UTC).isoformat(),
                "strategy": tags["diloco.strategy"],
                "mode": tags["diloco.mode"],
                "workers": workers,
                "schedule": schedule_of(config),
            }
            body = json.dumps(info, indent=1).encode()
            if self._store().put_if_absent(TRACKING_KEY, body):
                self._info = info
            else:  # another train job won the race: use its parent
                client.delete_run(run.info.run_id)
                self._info = json.loads(self._store().get(TRACKING_KEY))
        self._runs["parent"] = self._info["parent_run_id"]
        self._opened["parent"] = False
        self._start_monitor("parent", resumed=resumed)

    def _log_config(self, config: dict[str, Any]) -> None:
        """The resolved config, flattened, as the parent's params (same values again
        on a resumed run, which MLflow accepts), plus the model's parameter count."""
        parent = self._require("parent")
        params = flatten(config)
        if self._n_params is None:
            self._n_params = model_parameters(config) or 0
        if self._n_params:
            params["model.parameters"] = str(self._n_params)
        self._log_params(parent, params)

    def _log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param  # noqa: PLC0415

        items = [Param(k, v) for k, v in sorted(params.items())]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            chunk = items[i : i + PARAMS_PER_BATCH]
            try:
                self._client().log_batch(run_id, params=chunk, synchronous=True)
            except Exception as exc:
                if not _is_permanent(exc):
                    raise
                with self._lock:
                    self._dropped["params"] += len(chunk)
                log.warning("MLflow tracking (%s): %d params not logged: %s",
                            self.role, len(chunk), _clip(str(exc), 300))

    def _resolve_child(self, key: str) -> None:
        """Find (after a restart) or create the child run ``key`` under the parent."""
        info = self._tracking_info()
        client = self._client()
        parent = info["parent_run_id"]
        role, _, name = key.partition(":")
        try:
            found = client.search_runs(
                [info["experiment_id"]],
                filter_string=(f"tags.`mlflow.parentRunId` = '{parent}' "
                               f"and tags.`diloco.child` = '{key}'"),
                max_results=1,
            )
            if found:
                run_id = found[0].info.run_id
                client.update_run(run_id, status="RUNNING")
                log.info("MLflow: %s continues child run %s", key, run_id)
            else:
                tags = {
                    "mlflow.parentRunId": parent,
                    "diloco.role": role,
                    "diloco.child": key,
                    "diloco.run_id": info.get("run_name", self.run_name),
                    "diloco.strategy": str(info.get("strategy", "")),
                    "diloco.mode": str(info.get("mode", "")),
                }
                if name:
                    tags["diloco.worker"] = name
                run_id = client.create_run(info["experiment_id"], run_name=name or role,
                                           tags=tags).info.run_id
        except Exception as exc:
            if not _is_permanent(exc):
                raise
            self._dead_keys[key] = (
                f"parent run {parent} of {self.run_name} not usable at "
                f"{strip_credentials(self._uri or '?')}: {_clip(str(exc), 200)}")
            log.warning("MLflow tracking (%s): %s", self.role, self._dead_keys[key])
            return
        self._runs[key] = run_id
        if self._owns(key):
            self._opened[key] = False
            self._start_monitor(key, resumed=bool(found))

    def _owns(self, key: str) -> bool:
        """The run this process's job is about (it starts and ends it)."""
        return key == self.role or (key == "parent" and self.role == "train")

    def _set_tags(self, key: str, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag  # noqa: PLC0415

        run_id = self._require(key)
        items = [RunTag(k, v) for k, v in tags.items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self._client().log_batch(run_id, tags=items[i : i + PARAMS_PER_BATCH],
                                     synchronous=True)

    def _require(self, key: str) -> str:
        if key in self._dead_keys:
            raise _Permanent(self._dead_keys[key])
        if key not in self._runs:
            if key == "parent":
                raise _Permanent("the parent run was never started (no run_started call)")
            self._resolve_child(key)
            if key not in self._runs:
                raise _Permanent(self._dead_keys.get(key, f"no run for {key}"))
        return self._runs[key]

    def _end_run(self, key: str, status: str, state: str) -> None:
        run_id = self._require(key)
        self._stop_monitor(key)
        client = self._client()
        client.set_tag(run_id, "diloco.state", state)
        client.set_terminated(run_id, status=status)
        self._opened[key] = True

    def _end_open_runs(self, failed: bool) -> None:
        """At close: a run this process started and did not end. FAILED when close()
        ran while an exception propagated; else the aggregator (which has no end
        hook) ends FINISHED, and a job that never reported its end KILLED."""
        for key, ended in list(self._opened.items()):
            if ended:
                continue
            if failed:
                self._end_run(key, "FAILED", "failed")
            elif key == "aggregator":
                self._end_run(key, "FINISHED", "finished")
            else:
                self._end_run(key, "KILLED", "ended without reporting its end")

    def _finish_parent(self, summary: dict[str, Any]) -> None:
        """The end of the train job: summary, config and plots on the parent run."""
        from tracking import plots  # noqa: PLC0415 - matplotlib only when needed

        parent = self._require("parent")
        client = self._client()
        curves = plots.load_run_curves(client, client.get_run(parent))
        with self._lock:
            so_far = {k: int(v) for k, v in self._dropped.items() if v}
        full = dict(summary)
        full["tracking"] = {"parent_run_id": parent,
                            "tracking_uri": strip_credentials(self._uri or ""),
                            "not_logged_by_train_job": so_far,
                            "results": curves.results()}
        with tempfile.TemporaryDirectory(prefix="diloco-mlflow-") as tmp:
            out = Path(tmp)
            (out / "summary.json").write_text(json.dumps(full, indent=2, default=str))
            if self._config is not None:
                import yaml  # noqa: PLC0415

                (out / "config.yaml").write_text(
                    yaml.safe_dump(without_credentials(self._config), sort_keys=False))
            plots.plot_run(curves, out / "plots")
            client.log_artifacts(parent, str(out))
        from mlflow.entities import Metric  # noqa: PLC0415

        ts = int(time.time() * 1000)
        metrics = [Metric(k, float(v), ts, 0) for k, v in curves.results().items()
                   if _is_number(v)]
        if metrics:
            client.log_batch(parent, metrics=metrics, synchronous=True)
        state = str(summary.get("state", "finished"))
        self._end_run("parent", _STATUS.get(state, "FINISHED"), state)

    # -- system metrics -------------------------------------------------------------------

    def _start_monitor(self, key: str, *, resumed: bool) -> None:
        if not self.system_metrics or key in self._monitors:
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import (  # noqa: PLC0415
                SystemMetricsMonitor,
            )
        except ImportError as exc:
            log.info("MLflow system metrics off: %s (install psutil to have them)", exc)
            self.system_metrics = False
            return
        try:
            monitor = SystemMetricsMonitor(self._runs[key], resume_logging=resumed,
                                           tracking_uri=self._uri)
            monitor.start()
            self._monitors[key] = monitor
        except Exception as exc:  # noqa: BLE001 - never stop tracking for it
            log.info("MLflow system metrics not started for %s: %s", key, exc)

    def _stop_monitor(self, key: str, wait: float = 2.0) -> None:
        monitor = self._monitors.pop(key, None)
        if monitor is None:
            return
        # finish() joins the sampling thread, which may be in a request: bounded
        stopper = threading.Thread(target=monitor.finish, daemon=True)
        stopper.start()
        stopper.join(wait)

    def _stop_monitors(self, wait: float) -> None:
        for key in list(self._monitors):
            self._stop_monitor(key, wait)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
