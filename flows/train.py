"""The train job: create the run, launch its jobs, follow them, report.

`run_train` is plain Python: validate, reach the store, create the run (or open
it to resume), launch the aggregator and one job per worker through a launcher
(`flows.launchers`), follow the status board until every job has ended, and
return the final report. Whatever ends it (a cancel request in the store, a job
that failed, Ctrl-C, SIGTERM from a Prefect worker), the jobs still running are
stopped, workers first so that the aggregator reduces their last rounds: SIGTERM
(or Cancelling for flow runs), a grace period to checkpoint, then SIGKILL.

The `train` flow wraps it for Prefect: parameters, the launcher of the chosen
backend with an idempotency key per flow run, a progress artifact updated as
rounds complete, the final table artifact, and an ``on_cancellation`` hook that
cancels the child flow runs (Prefect does not cancel ``run_deployment`` children
of a cancelled parent) and asks the jobs through the store to stop.

Continuing a run for more steps (``resume_run=URL``, ``extra_steps=N``), as a
schedule does, creates a NEW run whose initial parameters are the canonical model
of the old one (a run's length is fixed in its manifest); ``parent_run`` in its
config links the two. ``resume_run="latest"`` continues the newest finished run of
the same name under the store, so a cron schedule grows a chain of runs.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

from prefect import flow
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled

from diloco.run import open_run
from flows.control import cancel_request, clear_cancel, request_cancel
from flows.jobs import (
    as_task,
    close_hooks,
    flow_log,
    job_hooks,
    member_set,
    record_jobs,
    record_not_logged,
    refuse_secret_parameters,
    rename_flow_run,
    run_id_of,
    run_members,
    set_state,
    to_launch,
    with_joiners,
    with_shards,
)
from flows.launchers import AGGREGATOR, DeploymentLauncher, Launcher, LocalLauncher, shard_of
from storage.backends import refuse_credentials
from storage.exchange import Exchange
from storage.objectstore import ObjectStore
from storage.reach import REACH_POLICY, is_url, reach_store
from tracking.hooks import Hooks
from workers import gc
from workers.config import ConfigError, RunConfig, load_config
from workers.locate import absolute
from workers.report import TRAIN, build_report, fraction_done, markdown, snapshot, table_rows
from workers.runs import continuation, create_run, latest_run
from workers.status import read_status

log = logging.getLogger(__name__)

#: Seconds a job gets to checkpoint after SIGTERM / Cancelling before it is killed.
STOP_GRACE_S = 60.0
#: Once the aggregator has finished, how long the workers get to end by themselves
#: (their last mean, a final evaluation) before they are stopped.
FINISH_GRACE_S = 120.0
#: How often the train job reads the run's members (a listing) while it follows it.
MEMBERS_EVERY_S = 10.0


T = TypeVar("T", bound=Callable[..., Any])


def plain(_name: str, fn: T) -> T:
    """The stages of `run_train` as plain calls (the `train` flow makes them tasks)."""
    return fn


class JobFailed(Exception):
    """A job of the run failed; the message names it and where its output is."""

    def __init__(self, message: str, report: dict[str, Any] | None = None):
        super().__init__(message)
        self.report = report


# -- the plain job --------------------------------------------------------------------


def run_train(
    config: RunConfig | None,
    run_url: str,
    *,
    launcher: Launcher,
    resume: bool = False,
    storage_options: dict | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    hooks: Hooks | None = None,
    init_from: str | None = None,
    poll_s: float = 1.0,
    stop_grace_s: float = STOP_GRACE_S,
    restarts: int = 1,
    stage: Callable[[str, Callable[..., Any]], Callable[..., Any]] = plain,
) -> dict[str, Any]:
    """Run a training run to its end; returns the final report (``state``: finished
    or cancelled). Raises JobFailed if a job failed (after ``restarts`` relaunches
    of a failed job), ConfigError, StoreUnreachable or RunExists before launching.

    ``stage(name, fn)`` wraps each stage (``create-run`` or ``open-run``,
    ``launch-aggregator``, ``launch-workers``, ``wait``, ``gc`` when it finished,
    ``report``): the `train` flow passes one that makes them Prefect tasks, so its
    graph shows them."""
    start = time.monotonic()
    run_url = absolute(refuse_credentials(run_url, what="run_url"))
    if config is None and not resume:
        raise ConfigError("a config is needed to create a run")
    reach_store(run_url, storage_options, what="run_url")
    store = ObjectStore(run_url, storage_options=storage_options, name="train")
    if resume:
        exchange = stage("open-run", _reopen)(run_url, storage_options, store)
        config = RunConfig.stored(exchange.manifest.config)
    else:
        exchange = stage("create-run", create_run)(config, run_url,
                                                   storage_options=storage_options,
                                                   init_from=init_from)
    hooks = hooks or job_hooks(run_url, "train", storage_options)
    hooks.run_started(config.model_dump(mode="json"), run_url, resumed=resume,
                      n_params=sum(f.numel for f in exchange.manifest.fragments))

    snap = snapshot(exchange)
    todo = to_launch(exchange, snap)
    state, message = "finished", ""
    try:
        if todo:
            aggregators = [n for n in todo if n == AGGREGATOR or shard_of(n)]
            if aggregators:  # the aggregator, and its shards 1..K-1 if it is sharded
                stage("launch-aggregator", _launch)(launcher, run_url, aggregators)
            workers = [n for n in todo if n not in aggregators]
            if workers:
                stage("launch-workers", _launch)(launcher, run_url, workers)
            record_jobs(store, launcher)
            state, message = stage("wait", _follow)(
                exchange, store, launcher, run_url, on_progress, poll_s=poll_s,
                stop_grace_s=stop_grace_s, restarts=restarts)
            if state == "finished":
                stage("gc", _collect)(exchange, config.retention.after_run)
        elif on_progress:
            on_progress(snapshot(exchange))
    except BaseException as exc:  # an error, Ctrl-C, SIGTERM (Prefect's TerminationSignal)
        interrupted = (isinstance(exc, KeyboardInterrupt | TerminationSignal)
                       or not isinstance(exc, Exception))
        state = "interrupted" if interrupted else "failed"
        message = f"{type(exc).__name__}: {exc}"
        raised = True
        raise
    else:
        raised = False
    finally:  # stop whatever still runs, then report, whatever ended the run
        stop_all(launcher, stop_grace_s)
        if todo:
            record_jobs(store, launcher)
        # after an exception (a signal among them), no task: only what must be done
        report = (plain if raised else stage)("report", build_report)(
            exchange, run_url=run_url, state=state,
            wall_seconds=time.monotonic() - start, message=message)
        with_shards(with_joiners(report, exchange, run_members(exchange)), exchange)
        hooks.run_finished(report)
        lost = close_hooks(hooks)
        if lost:
            record_not_logged(store, TRAIN, lost)
            report["not_logged"] = {**report.get("not_logged", {}), TRAIN: lost}
    if state == "failed":
        raise JobFailed(message, report)
    return report


def _collect(exchange: Exchange, apply: bool) -> dict[str, Any] | None:
    """A finished run: delete what it no longer needs (``retention.after_run``) and
    measure what it holds. Never fails the run: a refused delete is logged."""
    try:
        sized = gc.after_run(exchange, apply=apply)
    except Exception as exc:  # noqa: BLE001 - the training is done and committed
        log.warning("gc after the run: %s: %s (run diloco gc to retry)",
                    type(exc).__name__, exc)
        return None
    flow_log("store: %.1f MB%s", sized["bytes"] / 1e6,
             f" after gc deleted {sized['freed_bytes'] / 1e6:.1f} MB it no longer needs"
             if sized["freed_bytes"] else "")
    try:  # where `diloco run` and any later report find it
        current = read_status(exchange.store, TRAIN) or {}
        set_state(exchange.store, TRAIN, current.get("state", "finished"), store_size=sized)
    except Exception as exc:  # noqa: BLE001 - best effort, like the not-logged counts
        log.warning("could not record the store's size: %s", exc)
    return sized


def _reopen(run_url: str, storage_options: dict | None, store: ObjectStore) -> Exchange:
    """The run to resume, its cancel request withdrawn."""
    exchange = open_run(run_url, storage_options, retry=REACH_POLICY)
    cleared = clear_cancel(store)
    if cleared:
        log.info("withdrew the cancel request of %s", cleared.get("requested"))
    return exchange


def _launch(launcher: Launcher, run_url: str, names: list[str]) -> None:
    for name in names:
        launcher.start(run_url, name)
        flow_log("launched %s (%s)", name, launcher.backend)


def stop_all(launcher: Launcher, grace: float) -> None:
    """Stop the running jobs: workers first, then the aggregator."""
    states = launcher.poll()
    running = [n for n, s in states.items() if s == "running"]
    aggregators = [n for n in running if n == AGGREGATOR or shard_of(n)]  # and its shards
    first = [n for n in running if n not in aggregators]
    if first:
        launcher.stop(first, grace)
    if aggregators:
        launcher.stop(aggregators, min(grace, 30.0))


def _follow(exchange: Exchange, store: ObjectStore, launcher: Launcher, run_url: str,
            on_progress: Callable[[dict[str, Any]], None] | None, *, poll_s: float,
            stop_grace_s: float, restarts: int) -> tuple[str, str]:
    """Follow the jobs until they have all ended, or the aggregator has finished and
    the workers had ``FINISH_GRACE_S`` to end (a worker that left or died for good
    never finishes; the run is done when its last rounds are): (state, message)."""
    left = dict.fromkeys(launcher.poll(), restarts)
    members: list[dict[str, Any]] = []
    read_at = -float("inf")
    finished_at: float | None = None
    while True:
        snap = snapshot(exchange)
        if time.monotonic() - read_at > MEMBERS_EVERY_S:
            members, read_at = run_members(exchange), time.monotonic()
        snap["members"] = members
        if on_progress is not None:
            try:
                on_progress(snap)
            except Exception as exc:  # noqa: BLE001 - reporting never stops a run
                log.warning("progress report failed: %s", exc)
        request = cancel_request(store)
        if request is not None:
            log.info("cancel requested by %s; stopping the jobs", request.get("by"))
            stop_all(launcher, stop_grace_s)
            return "cancelled", f"cancelled by {request.get('by')}: {request.get('reason')}"
        states = launcher.poll()
        if states.get(AGGREGATOR) == "finished":
            finished_at = finished_at or time.monotonic()
            running = [n for n, st in states.items() if st == "running"]
            if not running or time.monotonic() - finished_at > FINISH_GRACE_S:
                if running:
                    log.warning("the aggregator finished; stopping %s", ", ".join(running))
                if on_progress is not None:
                    on_progress({**snapshot(exchange), "members": run_members(exchange)})
                return "finished", ""
            time.sleep(poll_s)
            continue
        for name, state in states.items():
            if state not in ("failed", "stopped"):
                continue
            if cancel_request(store) is not None:
                break  # it stopped because of the request; the next pass handles it
            party = snap["aggregator"] if name == AGGREGATOR else snap["workers"].get(name, {})
            error = party.get("error") or f"its status says {party.get('state', 'nothing')!r}"
            if state == "failed" and left.get(name, 0) > 0:
                left[name] -= 1
                log.warning("%s failed (%s); relaunching it (it resumes from the store)",
                            name, error)
                launcher.start(run_url, name)
                record_jobs(store, launcher)
                continue
            how = "failed" if state == "failed" else "stopped without a cancel request"
            return "failed", (f"{name} {how}: {error}. {launcher.where(name)}\n"
                              f"Continue the run with: diloco resume {run_url}")
        else:
            if states and all(s == "finished" for s in states.values()):
                if on_progress is not None:
                    on_progress(snapshot(exchange))
                return "finished", ""
        time.sleep(poll_s)


# -- Prefect --------------------------------------------------------------------------


class Artifacts:
    """The progress artifact (updated as rounds complete) and the final table."""

    def __init__(self, run_id: str):
        self.key = re.sub(r"[^a-z0-9-]+", "-", f"diloco-{run_id}".lower()).strip("-")[:90]
        self.progress_id = None
        self.rounds = -1
        self.last = 0.0

    def progress(self, snap: dict[str, Any]) -> None:
        from prefect.artifacts import (  # noqa: PLC0415
            create_progress_artifact,
            update_progress_artifact,
        )

        rounds = snap["aggregator"].get("rounds") or 0
        if rounds == self.rounds and time.monotonic() - self.last < 15:
            return
        if rounds != self.rounds:
            flow_log("%s", progress_line(snap))
        self.rounds, self.last = rounds, time.monotonic()
        percent = 100.0 * fraction_done(snap)
        description = rounds_applied(rounds, snap["total_rounds"]) + member_set(
            snap.get("members"))
        try:
            if self.progress_id is None:
                self.progress_id = create_progress_artifact(
                    percent, key=f"{self.key}-progress", description=description)
            else:
                update_progress_artifact(self.progress_id, percent, description=description)
        except Exception as exc:  # noqa: BLE001 - artifacts never stop a run
            log.warning("progress artifact: %s", exc)

    def final(self, report: dict[str, Any]) -> None:
        from prefect.artifacts import (  # noqa: PLC0415
            create_table_artifact,
            update_progress_artifact,
        )

        g = report["global"]
        flow_log("%s: %s after %d of %d rounds%s", report["run_id"], report["state"],
                 g["rounds"], g["total_rounds"],
                 f"; canonical eval loss {g['eval_loss']:.4f}"
                 if g.get("eval_loss") is not None else "")
        try:
            if self.progress_id is not None:
                update_progress_artifact(
                    self.progress_id,
                    100.0 if report["state"] == "finished" else 100.0 * min(
                        1.0, g["rounds"] / max(1, g["total_rounds"])),
                    description=rounds_applied(g["rounds"], g["total_rounds"],
                                               report["state"]))
            create_table_artifact(table_rows(report), key=f"{self.key}-report",
                                  description=markdown(report))
        except Exception as exc:  # noqa: BLE001
            log.warning("report artifact: %s", exc)


def rounds_applied(rounds: int, total: int, state: str = "") -> str:
    """The progress artifact's description."""
    return f"rounds applied by the aggregator: {rounds}/{total}" + (
        f" ({state})" if state else "")


def progress_line(snap: dict[str, Any]) -> str:
    """A line of the train flow run's log: the rounds applied, each worker's step
    and loss, the canonical model's eval loss."""
    agg = snap["aggregator"]
    parts = [f"round {agg.get('rounds') or 0}/{snap['total_rounds']} applied"]
    for name, s in snap["workers"].items():
        loss = s.get("loss")
        parts.append(f"{name} step {s.get('step') or 0}/{snap['total_steps']}"
                     + (f" loss {loss:.4f}" if loss is not None else ""))
    if agg.get("eval_loss") is not None:
        parts.append(f"canonical eval loss {agg['eval_loss']:.4f}")
    return "; ".join(parts)


def train_run_name() -> str:
    """The train flow run's name: the run's id when the run URL is given, else
    ``train`` (renamed to the run id once the flow has chosen it)."""
    from prefect.runtime import flow_run  # noqa: PLC0415

    params = flow_run.parameters or {}
    return run_id_of(params.get("run_url")) or "train"


def _cancel_children(flow, flow_run, state) -> None:  # noqa: ANN001 - Prefect hook signature
    """on_cancellation: cancel the child flow runs and ask their jobs, through the
    run's store, to stop (local jobs get SIGTERM from this flow's process)."""
    from prefect import get_client  # noqa: PLC0415
    from prefect.client.schemas.filters import (  # noqa: PLC0415
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )

    from flows.launchers import cancel_flow_runs  # noqa: PLC0415

    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run.id])))
    urls = {c.parameters.get("run_url") for c in children} - {None}
    urls |= {flow_run.parameters.get("run_url")} - {None}
    for url in urls:
        try:
            request_cancel(ObjectStore(url, storage_options=flow_run.parameters.get(
                "storage_options")), reason=f"flow run {flow_run.name} was cancelled")
        except Exception as exc:  # noqa: BLE001
            log.warning("could not write the cancel request of %s: %s", url, exc)
    cancel_flow_runs([str(c.id) for c in children], f"parent {flow_run.name} was cancelled")


def stable_run_url(cfg: RunConfig, when: datetime) -> str:
    """The run URL of a flow run: from its scheduled start, the same on a retry."""
    return f"{absolute(cfg.store).rstrip('/')}/{cfg.name}-{when:%Y%m%d-%H%M%S}"


@flow(name="train", log_prints=True, on_cancellation=[_cancel_children],
      flow_run_name=train_run_name)
def train(
    config: str | dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    run_url: str | None = None,
    backend: Literal["local", "deployments"] = "local",
    resume: bool = False,
    resume_run: str | None = None,
    extra_steps: int | None = None,
    nproc: int = 1,
    worker_deployment: str = "worker/{worker}",
    aggregator_deployment: str = "aggregator/aggregator",
    storage_options: dict | None = None,
    evaluate: bool = True,
) -> dict[str, Any]:
    """Train a model across regions: create the run, launch a worker job per worker
    and the aggregator (``local`` processes or ``deployments`` in each region's work
    pool), follow them, and report.

    - ``config``: a shipped recipe's name (workers/recipes/), a YAML path or the
      config itself;
      ``overrides``: ``key=value`` items.
    - ``run_url``: default ``<store>/<name>-<time>``; ``resume=True`` continues it.
    - ``resume_run`` (a run URL, or ``latest``) with ``extra_steps``: a new run that
      starts from that run's canonical model (for schedules).
    """
    from prefect.runtime import flow_run  # noqa: PLC0415

    # Before anything: these are stored in Prefect's database, shown in its UI and
    # passed to every job. (The parameters of this flow run are stored already:
    # `diloco run` makes the same checks before it calls this flow.)
    for value, what in ((run_url, "run_url"), (resume_run, "resume_run")):
        if value:
            refuse_credentials(value, what=what)
    refuse_secret_parameters(storage_options)
    if resume_run:
        if resume_run == "latest":
            base = load_config(config, overrides)
            resume_run = latest_run(base.store, base.name, storage_options)
        cfg = continuation(resume_run, overrides, extra_steps, storage_options)
    elif resume:
        if not run_url:
            raise ConfigError("resume=True needs the run_url of the run to resume")
        cfg = None
    else:
        cfg = load_config(config, overrides)
    retried = (flow_run.run_count or 1) > 1
    if run_url is None:
        when = flow_run.scheduled_start_time
        run_url = stable_run_url(cfg, when.astimezone() if when else datetime.now())
    run_url = absolute(run_url)
    if backend == "deployments" and not is_url(run_url):
        log.info("deployments share the store by URL: %s", Path(run_url).as_uri())
        run_url = Path(run_url).as_uri()
    if retried and not resume:
        try:
            open_run(run_url, storage_options, retry=REACH_POLICY)
            resume = True  # attempt 1 created it; same jobs (same idempotency keys)
        except Exception:  # noqa: BLE001
            pass
    key = f"{flow_run.id or 'local'}:{run_url.rstrip('/').rsplit('/', 1)[-1]}"
    if backend == "deployments":
        launcher: Launcher = DeploymentLauncher(
            key=key, worker_deployment=worker_deployment,
            aggregator_deployment=aggregator_deployment, storage_options=storage_options,
            nproc=nproc if nproc > 1 else None, evaluate=evaluate)
    else:
        launcher = LocalLauncher(storage_options=storage_options, nproc=nproc,
                                 evaluate=evaluate)
    rename_flow_run(run_id_of(run_url))
    artifacts = Artifacts(run_id_of(run_url))
    try:
        report = run_train(cfg, run_url, launcher=launcher, resume=resume,
                           storage_options=storage_options, on_progress=artifacts.progress,
                           init_from=resume_run if cfg is not None else None, stage=as_task)
    except JobFailed as exc:
        if exc.report:
            artifacts.final(exc.report)
        raise
    artifacts.final(report)
    print(markdown(report))
    if report["state"] == "cancelled":
        return Cancelled(message=report["message"], data=report)
    return report
