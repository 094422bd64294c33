"""MLflow tracking of a training run: the `Hooks` seam implemented with MLflow.

The parent run, the child run of each worker and of the aggregator, and
``tracking.json``, which links the jobs through the run's store, are in
`tracking.runs`; what the parent run holds besides metrics (params, the dataset,
the summary and plots) in `tracking.parent_run`; settings in `tracking.settings`.

Logging never stops or slows training (docs/design.md, principle 1). Metrics go through
MLflow's asynchronous logging (``log_batch(synchronous=False)``) with a bounded outage
buffer beside it (`tracking.sender`). Everything else a hook asks for (create or
continue a run, params, tags, end a run, the summary and plots) is a task for one
background thread per hooks object, done in order, retried with backoff while the server
is unreachable. `close()` waits a bounded time (``DILOCO_TRACKING_CLOSE_TIMEOUT``, 15 s)
and logs a warning saying how many metrics, params, tags, artifacts (and runs) were not
logged; it returns the counts, ``not_logged`` keeps them, and the train job writes its
own into the summary artifact. The thread then starts nothing more, and exit waits
for what it is doing (a thread left in native code as the interpreter finalizes aborts
the process: `tracking.exit_threads`). A job whose ``close()`` runs while an exception
propagates ends its run FAILED.

What a worker step pays does not depend on the server: the call hands its batch to
MLflow's thread pool and returns, whether the server is slow or down (the hooks'
thread, which sends the buffer, holds the GIL while it makes a request's JSON, so
the slowest calls are slower while the server is slow). The price of MLflow's queue
over a thread of our own: a process's exit waits for the requests MLflow's threads
still have in flight (at most `MetricSender`'s window of batches, sent before an
outage was noticed), up to the HTTP timeout and retries when the server's port
accepts and never answers; none once they have failed. The figures, and the command
that measures them: docs/results.md, "Tracking: what a worker step pays".
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_exponential

from tracking import parent_run
from tracking.exit_threads import join_before_exit, join_thread
from tracking.hooks import Hooks
from tracking.metrics import (
    eval_metrics,
    is_number,
    numbers,
    round_index,
    round_metrics,
    round_size,
    stall_metrics,
)
from tracking.plots import RUN_PLOTS
from tracking.runs import NotReady, Permanent, RunLinks, is_permanent
from tracking.sender import MetricSender
from tracking.settings import (
    TAG_MAX_CHARS,
    clip,
    default_close_timeout,
    default_tracking_uri,
    experiment_name,
    flatten,
    short_http_retries,
    strip_credentials,
    system_metrics_enabled,
    tracking_enabled,
)
from tracking.system_metrics import SystemMonitors

log = logging.getLogger(__name__)

CONFIRM_EVERY = 0.05  # seconds; see `MetricSender.window`
#: The thread's pauses between tries: polling for tracking.json, backing off a server away.
NOT_READY_WAIT = wait_exponential(multiplier=0.5, max=5.0)
OUTAGE_WAIT = wait_exponential(multiplier=1.0, max=30.0)

_STATUS = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED",
           "cancelled": "KILLED", "crashed": "FAILED"}


def hooks_for(run_url: str, *, role: str, storage_options: dict | None = None) -> Hooks:
    """The hooks a job of ``role`` ("train", "worker:<name>", "aggregator") uses:
    `MlflowHooks` when tracking is on, else no-op `Hooks`. Never touches the network."""
    if not tracking_enabled():
        return Hooks()
    return MlflowHooks(run_url, role=role, storage_options=storage_options)


@dataclass
class _Task:
    """Work for the background thread, done in order; ``lost`` is what is not
    logged if it is given up; ``flush_first``: send the metrics before it."""

    name: str
    fn: Callable[[], None]
    lost: dict[str, int] = field(default_factory=dict)
    flush_first: bool = False


class MlflowHooks(Hooks):
    """Hooks that log to MLflow without waiting for it (see the module docstring).

    ``role``: "train" (creates the parent run and writes tracking.json),
    "worker:<name>" or "aggregator" (create or continue their child run).
    ``flush_every``: seconds between two looks of the thread at the metrics;
    ``max_buffer``: metrics the outage buffer keeps (the oldest go first)."""

    def __init__(
        self,
        run_url: str,
        *,
        role: str,
        storage_options: dict | None = None,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        flush_every: float = 2.0,
        max_buffer: int = 100_000,
        close_timeout: float | None = None,
        system_metrics: bool | None = None,
    ) -> None:
        if role != "train" and role != "aggregator" and not role.startswith("worker:"):
            raise ValueError(
                f"hooks role {role!r}: expected 'train', 'worker:<name>' or 'aggregator'")
        import mlflow  # noqa: F401, PLC0415 - here, not half-imported by two threads at once

        short_http_retries()
        self.role = role
        self.run_name = run_url.rstrip("/").rsplit("/", 1)[-1] or "run"
        explicit = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "").strip() or None
        # the train job decides the URI; the others follow tracking.json unless told
        self.links = RunLinks(
            run_url, uri=explicit or (default_tracking_uri() if role == "train" else None),
            experiment=experiment or experiment_name(), storage_options=storage_options)
        self.sender = MetricSender(max_buffer)
        self.flush_every = flush_every
        self.close_timeout = (close_timeout if close_timeout is not None
                              else default_close_timeout())
        self.monitors = SystemMonitors(system_metrics_enabled() if system_metrics is None
                                       else system_metrics)

        self._lock = threading.Lock()
        self._tasks: deque[_Task] = deque()
        self._dropped: Counter[str] = Counter()  # params, tags, artifacts, runs
        self._runs: dict[str, str] = {}  # run key ("parent", "worker:a", ...) -> run id
        self._dead_keys: dict[str, str] = {}  # run key -> why it cannot be logged to
        self._opened: dict[str, bool] = {}  # runs this process started -> ended?
        self._config: dict[str, Any] | None = None
        self._n_params: int | None = None
        self._round_counter = 0
        self._last_step = 0  # of the aggregator's last round: where a stall's metric sits
        self._started_ms: int | None = None
        self._last_error = ""
        self._outage_since: float | None = None
        self._attempt_closing = False  # the thread's current try began while closing
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._abandoned = threading.Event()  # close() stopped waiting: stop trying
        self._closed = False
        self.not_logged: dict[str, int] = {}
        self._thread = threading.Thread(target=self._loop, name=f"mlflow-{role}", daemon=True)
        self._thread.start()
        atexit.register(self._close_at_exit)

    # -- the Hooks API: each call hands over its data and returns -------------------

    def run_started(self, config: dict[str, Any], run_url: str, *, resumed: bool,
                    n_params: int | None = None) -> None:
        try:
            self._config = dict(config)
            self._n_params = n_params
            self._started_ms = int(time.time() * 1000)
            self._task(_Task("start the parent run",
                             lambda: self._start_parent(resumed), lost={"runs": 1}))
            self._task(_Task("log the config as params",
                             lambda: self._log_config(dict(config)),
                             lost={"params": len(flatten(config)) + bool(n_params)}))
            self._task(_Task("log the dataset as the run's input",
                             lambda: self._log_dataset(dict(config)), lost={"inputs": 1}))
        except Exception:  # noqa: BLE001 - a hook never raises
            log.debug("run_started not tracked", exc_info=True)

    def worker_started(self, worker: str, info: dict[str, Any]) -> None:
        try:
            key = f"worker:{worker}"
            tags = {f"diloco.info.{k}": clip(str(v), TAG_MAX_CHARS) for k, v in info.items()}
            self._task(_Task(f"tag {key}", lambda: self._set_tags(key, tags),
                             lost={"tags": len(tags)}))
        except Exception:  # noqa: BLE001
            log.debug("worker_started not tracked", exc_info=True)

    def worker_metrics(self, worker: str, metrics: dict[str, Any]) -> None:
        try:
            ts = int(time.time() * 1000)
            found = numbers(metrics, ts, int(metrics.get("step", 0)),
                            skip=("worker", "step", "final"))
            self.sender.log(f"worker:{worker}", lambda: found, len(found))
        except Exception:  # noqa: BLE001
            log.debug("worker_metrics not tracked", exc_info=True)

    def worker_finished(self, worker: str, result: dict[str, Any], state: str) -> None:
        try:
            key = f"worker:{worker}"
            ts = int(time.time() * 1000)
            found = numbers(result, ts, int(result.get("steps") or 0), prefix="result/")
            self.sender.log(key, lambda: found, len(found))
            status = _STATUS.get(state, "FINISHED")
            self._task(_Task(f"end {key}", lambda: self._end_run(key, status, state),
                             flush_first=True))
        except Exception:  # noqa: BLE001
            log.debug("worker_finished not tracked", exc_info=True)

    def aggregator_round(self, report: dict[str, Any]) -> None:
        try:
            ts = int(time.time() * 1000)
            report = dict(report, weights=dict(report.get("weights") or {}))

            def build() -> list[Any]:  # the step needs the schedule (tracking.json)
                k = round_index(report, self.links.schedule)
                if k is None:
                    k, self._round_counter = self._round_counter, self._round_counter + 1
                found = round_metrics(report, self.links.schedule, ts, k)
                self._last_step = max(self._last_step, int(found[0].step))
                return found

            self.sender.log("aggregator", build, round_size(report))
        except Exception:  # noqa: BLE001
            log.debug("aggregator_round not tracked", exc_info=True)

    def aggregator_eval(self, report: dict[str, Any]) -> None:
        """The final evaluation of the canonical model, at the inner step of the last
        round applied (where a round report's eval would sit)."""
        try:
            ts = int(time.time() * 1000)
            values = {k: float(report[k]) for k in ("eval_loss", "perplexity")
                      if is_number(report.get(k))}
            if values:
                rounds = int(report.get("rounds", 1))
                self.sender.log(
                    "aggregator",
                    lambda: eval_metrics(values, rounds, ts, self.links.schedule),
                    len(values))
        except Exception:  # noqa: BLE001
            log.debug("aggregator_eval not tracked", exc_info=True)

    def aggregator_stalled(self, stalls: list[dict[str, Any]]) -> None:
        """Tag ``diloco.stalled`` (who is missing since when; "" once rounds are applied
        again) and metric ``stalled_s`` on the aggregator's run."""
        try:
            text, ts = "; ".join(s["text"] for s in stalls), int(time.time() * 1000)
            self._task(_Task("tag diloco.stalled", lost={"tags": 1}, fn=lambda: self._set_tags(
                "aggregator", {"diloco.stalled": text})))
            waited = max((float(s["waited_s"]) for s in stalls), default=0.0)
            self.sender.log("aggregator",
                            lambda: stall_metrics(waited, ts, self._last_step), 1)
        except Exception:  # noqa: BLE001
            log.debug("aggregator_stalled not tracked", exc_info=True)

    def run_finished(self, summary: dict[str, Any]) -> None:
        try:
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
            atexit.unregister(self._close_at_exit)
        timeout = self.close_timeout if timeout is None else timeout
        # called from a `finally` while an exception propagates: the job failed
        failed = sys.exc_info()[0] is not None
        self._task(_Task("end the open runs", lambda: self._end_open_runs(failed),
                         flush_first=True))
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout)
        self._abandoned.set()  # the thread starts nothing more: no task, no request
        join_before_exit(self._thread)  # what it is doing ends before the interpreter
        with self._lock:
            lost = Counter(self._dropped)
            for task in self._tasks:
                lost.update(task.lost)
        lost["metrics"] += self.sender.not_logged()
        self.not_logged = {k: int(v) for k, v in lost.items() if v}
        self.monitors.stop_all(wait=2.0)
        if self.not_logged:
            what = ", ".join(f"{v} {k}" for k, v in sorted(self.not_logged.items()))
            log.warning(
                "MLflow tracking of run %s (%s, %s): not logged: %s%s", self.run_name,
                self.role, strip_credentials(self.links.uri or "no tracking URI yet"), what,
                f" (last error: {self._last_error})" if self._last_error else "")
        return self.not_logged

    def _close_at_exit(self) -> None:
        """``atexit``: close, then wait for the thread (a hook registered here never runs)."""
        self.close()
        join_thread(self._thread)
        self.monitors.join_all()

    def _task(self, task: _Task) -> None:
        with self._lock:
            self._tasks.append(task)
        self._wake.set()

    # -- the background thread ---------------------------------------------------------

    def _loop(self) -> None:
        """The thread: wait for work, do it until it gets through, stop after close().
        Any error is retried (`_work` drops a permanent one's task), without limit while
        the job runs: logging waits for the server, never training for logging. Once
        closing, only `NotReady` is, until close() stops waiting."""

        def not_ready(state: RetryCallState) -> bool:
            return isinstance(state.outcome and state.outcome.exception(), NotReady)

        def wait(state: RetryCallState) -> float:
            if not_ready(state):
                return 0.25 if self._attempt_closing else NOT_READY_WAIT(state)
            return OUTAGE_WAIT(state)

        def pause(seconds: float) -> None:  # once closing, only close() giving up cuts it
            (self._abandoned if self._closing.is_set() else self._closing).wait(seconds)
            if self._abandoned.is_set():  # ends the tries (tenacity lets it through)
                raise InterruptedError("close() stopped waiting")

        def attempt() -> bool:  # one try of the work: True if it began while closing
            self._wake.clear()
            self._attempt_closing = self._closing.is_set()
            self._work()
            return self._attempt_closing

        retrying = Retrying(retry=retry_if_exception_type(Exception), wait=wait, sleep=pause,
                            stop=lambda state: self._attempt_closing and not not_ready(state),
                            after=self._note_outage, reraise=True)
        closing = False
        while not (closing and self._idle()):
            # batches in MLflow's queue: confirm them soon, to free the window
            self._wake.wait(CONFIRM_EVERY if self.sender.queued() else self.flush_every)
            if self._abandoned.is_set():
                break
            try:
                closing = retrying(attempt)
            except Exception:  # noqa: BLE001 - abandoned, or it failed while closing
                break  # close() counts what was not logged
            if self._outage_since is not None:
                log.info("MLflow tracking (%s): the server answers again after %.0f s",
                         self.role, time.monotonic() - self._outage_since)
                self._outage_since = None
            self.sender.outage = False

    def _note_outage(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, NotReady):  # not an outage: tracking.json is not there yet
            self._last_error = str(exc)
            return
        self.sender.outage = True
        self._last_error = f"{type(exc).__name__}: {clip(str(exc), 300)}"
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            log.warning("MLflow tracking (%s, %s) unreachable, buffering and retrying: %s",
                        self.role, strip_credentials(self.links.uri or "?"), self._last_error)

    def _idle(self) -> bool:
        with self._lock:
            return not self._tasks and self.sender.idle()

    def _work(self) -> None:
        while True:
            if self._abandoned.is_set():  # close() gave up on what is left
                return
            with self._lock:
                task = self._tasks[0] if self._tasks else None
            if task is None:
                break
            if task.flush_first:
                self._send()
            try:
                task.fn()
            except NotReady:
                raise
            except Exception as exc:
                if not is_permanent(exc):
                    raise
                with self._lock:
                    self._dropped.update(task.lost)
                log.warning("MLflow tracking (%s): could not %s: %s", self.role, task.name,
                            clip(str(exc), 500))
            with self._lock:
                self._tasks.popleft()
        self._send()

    def _send(self) -> None:
        """Resolve the runs metrics wait for, confirm what MLflow's queue took, and
        send the buffer (raises while the server is away)."""
        for key in self.sender.unrouted():
            with contextlib.suppress(Permanent):  # its metrics are dropped and counted
                self._require(key)
        self.sender.confirm()
        self.sender.resend(stop=self._abandoned.is_set)

    # -- runs ---------------------------------------------------------------------------

    def _require(self, key: str) -> str:
        """The run id of ``key``, resolving a child run the first time."""
        if key in self._dead_keys:
            raise Permanent(self._dead_keys[key])
        if key not in self._runs:
            if key == "parent":
                raise Permanent("the parent run was never started (no run_started call)")
            try:
                run_id, found = self.links.child(key)
            except Permanent as exc:
                self._dead_keys[key] = str(exc)
                self.sender.dead(key, str(exc))
                log.warning("MLflow tracking (%s): %s", self.role, exc)
                raise
            self._opened_run(key, run_id, resumed=found)
        return self._runs[key]

    def _opened_run(self, key: str, run_id: str, *, resumed: bool) -> None:
        self._runs[key] = run_id
        self.sender.client = self.links.client()
        self.sender.route(key, run_id)
        if key == self.role or (key == "parent" and self.role == "train"):
            self._opened[key] = False  # this process's job: it starts and ends the run
            self.monitors.start(key, run_id, tracking_uri=self.links.uri, resumed=resumed)

    def _start_parent(self, resumed: bool) -> None:
        run_id = self.links.start_parent(self._config or {}, start_ms=self._started_ms)
        self._opened_run("parent", run_id, resumed=resumed)

    def _log_config(self, config: dict[str, Any]) -> None:
        dropped = parent_run.log_config(self.links.client(), self._require("parent"), config,
                                        self._n_params)
        with self._lock:
            self._dropped["params"] += dropped

    def _log_dataset(self, config: dict[str, Any]) -> None:
        parent_run.log_dataset(self.links.client(), self._require("parent"), config,
                               self.links.run_url, self.links.storage_options)

    def _set_tags(self, key: str, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag  # noqa: PLC0415

        self.links.client().log_batch(self._require(key), synchronous=True,
                                      tags=[RunTag(k, v) for k, v in tags.items()])

    def _end_run(self, key: str, status: str, state: str) -> None:
        run_id = self._require(key)
        self.monitors.stop(key)
        self.links.end(run_id, status, state)
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
        with self._lock:
            so_far = {k: int(v) for k, v in self._dropped.items() if v}
        if self.sender.dropped:
            so_far["metrics"] = self.sender.dropped
        parent_run.finish(self.links.client(), self.links.uri, self._require("parent"),
                          summary, self._config, so_far)
        state = str(summary.get("state", "finished"))
        train = (self._config or {}).get("train") or {}
        if state == "finished" and train.get("log_model", True):
            try:
                parent_run.log_model(self.links.client(), self.links.uri,
                                     self._require("parent"), self.links.run_url,
                                     self.links.storage_options)
            except Exception as exc:  # noqa: BLE001 - the model stays in the store
                with self._lock:
                    self._dropped["artifacts"] += 1
                log.warning("MLflow: the model was not logged (%s); `diloco export` "
                            "writes it from the store", exc)
        self._end_run("parent", _STATUS.get(state, "FINISHED"), state)
