"""One worker job: train one worker (one island in one region) to the end.

    python -m flows.worker --run URL --worker region-a [--nproc 2]
    python -m flows.worker --run URL --worker region-c --join [--claim ID]   # joins mid-run

`run_worker_job` is plain Python, and this module imports no Prefect, so the local
launcher starts it as ``python -m flows.worker_job`` (the same job without the
second of CPU Prefect's import costs each process) and a Prefect work pool runs it
through the `worker` flow of flows/worker.py. With one
process it runs `workers.loop.WorkerLoop` here; an island of several processes
runs under torchrun (``-m workers -- --run URL --worker W``). Either way the
worker writes its progress to ``members/<worker>/status.json``, its metrics go to
the tracking hooks, and it stops after a checkpoint on SIGTERM/SIGINT, on the
run's cancel request, or (``--exit-with-parent``) when its launcher dies. Started
again with the same arguments, it resumes from ``workers/<worker>/ckpt``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from diloco.run import open_run
from flows import launcher_gone
from flows.control import cancel_request, watching
from flows.jobs import (
    EXIT_CODES,
    EXIT_USAGE,
    close_hooks,
    flow_log,
    job_hooks,
    print_result,
    record_not_logged,
    set_state,
    stop_on_signals,
    usage_errors,
)
from storage.objectstore import ObjectStore
from storage.reach import JOB_START_PATIENCE_S, REACH_POLICY
from tracking.exit_threads import record_threads_at_exit
from tracking.hooks import Hooks
from workers.status import read_status

log = logging.getLogger(__name__)
progress_log = logging.getLogger("workers.progress")

#: After a stop request, how long an island under torchrun gets before SIGKILL.
TORCHRUN_GRACE_S = 60.0
#: After a stop request, how long a worker may stay blocked waiting for a mean
#: before it gives up on a last checkpoint (``Synchronizer(stop_patience_s=...)``).
BLOCKED_PATIENCE_S = 10.0
#: After a stop request, how long ``python -m flows.worker`` waits for a step
#: boundary before it exits without a checkpoint (a worker blocked waiting for the
#: mean of a round another worker will never send). It resumes from its last one.
STOP_GRACE_S = 90.0


def run_worker_job(
    run_url: str,
    worker: str,
    storage_options: dict | None = None,
    nproc: int = 1,
    *,
    stop: threading.Event | None = None,
    hooks: Hooks | None = None,
    exit_with_parent: bool = False,
    cancel_poll_s: float = 2.0,
    join: bool = False,
    claim: str | None = None,
) -> dict[str, Any]:
    """Train ``worker`` of the run at ``run_url``; returns ``{"worker", "state", ...}``
    where state is finished, left (it left the run on request), interrupted (stopped
    by a signal) or cancelled (the run's cancel request). Raises if training fails
    (the status says ``failed``). ``join``: the worker joins the running run (a name
    not in its manifest; ``claim``: the id of its membership record)."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if (join or claim) and nproc != 1:
        raise ValueError("a joining worker runs as one process (nproc 1)")
    exchange = open_run(run_url, storage_options, patience_s=JOB_START_PATIENCE_S,
                        retry=REACH_POLICY, what="run_url")  # before anything is written
    if worker != "auto" and worker not in exchange.manifest.workers and not (
            join or joined_member(exchange.store, worker)):
        raise ValueError(f"worker {worker!r} is not one of the run's workers: "
                         f"{', '.join(exchange.manifest.workers)} (to add it: diloco join "
                         f"RUN --worker {worker})")
    stop = stop or threading.Event()
    hooks = hooks or job_hooks(run_url, f"worker:{worker}", storage_options)
    control = ObjectStore(run_url, storage_options=storage_options, name=f"{worker}-control")
    cancelled = threading.Event()

    def on_cancel(_request: dict) -> None:
        cancelled.set()
        stop.set()

    try:
        with watching(control, on_cancel, stop, interval=cancel_poll_s,
                      exit_with_parent=exit_with_parent), stop_on_signals(stop):
            if nproc == 1:
                out = _in_process(run_url, worker, storage_options, stop, cancelled, hooks,
                                  join=join, claim=claim)
            else:
                out = _island(run_url, worker, storage_options, nproc, stop, cancelled, hooks)
    finally:
        not_logged = close_hooks(hooks)
    if out["state"] == "interrupted" and cancel_request(control) is not None:
        out["state"] = "cancelled"  # the launcher's SIGTERM came before our own poll
    if out["state"] == "cancelled":
        set_state(control, worker, "cancelled")
    record_not_logged(control, worker, not_logged)
    if not_logged:
        out["not_logged"] = not_logged
    return out


def joined_member(store: ObjectStore, worker: str) -> bool:
    """Whether ``worker`` joined the run mid-run (its ``members/{worker}.json`` says
    ``join``): relaunched, it continues as that member."""
    from diloco.membership import read_json  # noqa: PLC0415
    from storage import layout  # noqa: PLC0415

    try:
        layout.check_name("worker", worker)
    except ValueError:
        return False
    return bool((read_json(store, layout.member(worker)) or {}).get("join"))


class FlowRunLog:
    """What a worker's flow run logs: a line per round sent or mean received (round,
    step, loss, bytes, time waited) and per evaluation, not per step. ``stats`` is
    the synchroniser's (rounds_sent, rounds_merged, wait_seconds), once known."""

    def __init__(self, worker: str):
        self.worker = worker
        self.stats: Any = None
        self.seen = (0, 0)

    def __call__(self, m: dict[str, Any]) -> None:
        if "eval_loss" in m:
            flow_log("%s step %d: eval loss %.4f%s", self.worker, m["step"], m["eval_loss"],
                     " (final)" if m.get("final") else "")
            return
        if "loss" not in m or self.stats is None:
            return
        now = (self.stats.rounds_sent, self.stats.rounds_merged)
        if now == self.seen:
            return
        self.seen = now
        flow_log("%s step %d: round %d sent, %d received; loss %.4f; up %s, down %s; "
                 "waited %.1f s", self.worker, m["step"], now[0], now[1], m["loss"],
                 _mb(m.get("bytes_up", 0)), _mb(m.get("bytes_down", 0)),
                 m.get("wait_s", 0.0))


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def _emit(worker: str, hooks: Hooks, flow_run_log: FlowRunLog | None = None):
    def emit(m: dict[str, Any]) -> None:
        if "loss" in m:
            progress_log.info(
                "%s step %d loss %.4f lr %.2e %.0f tok/s wait %.2fs up %d B down %d B",
                worker, m["step"], m["loss"], m["lr"], m["tokens_per_s"],
                m.get("wait_s", 0.0), m["bytes_up"], m["bytes_down"])
        elif "eval_loss" in m:
            progress_log.info("%s step %d eval loss %.4f", worker, m["step"], m["eval_loss"])
        if flow_run_log is not None:
            try:
                flow_run_log(m)
            except Exception as exc:  # noqa: BLE001 - logging never stops training
                log.debug("flow run log: %s", exc)
        hooks.worker_metrics(worker, m)

    return emit


def _in_process(run_url: str, worker: str, storage_options: dict | None,
                stop: threading.Event, cancelled: threading.Event,
                hooks: Hooks, *, join: bool = False, claim: str | None = None) -> dict[str, Any]:
    from workers.loop import Interrupted, WorkerLoop  # noqa: PLC0415 - torch is slow to import

    flow_run_log = FlowRunLog(worker)
    try:
        loop = WorkerLoop.open(run_url, worker, storage_options=storage_options, stop=stop,
                          metrics=_emit(worker, hooks, flow_run_log),
                          stop_patience_s=BLOCKED_PATIENCE_S, join=join, claim=claim)
    except Exception as exc:
        from diloco.membership import MembershipError  # noqa: PLC0415

        if isinstance(exc, MembershipError):  # a name not ours: its status is not ours
            raise
        status = ObjectStore(run_url, storage_options=storage_options, name=f"{worker}-status")
        set_state(status, worker, "failed", error=f"{type(exc).__name__}: {exc}")
        hooks.worker_finished(worker, {"error": str(exc)}, "failed")
        raise
    hooks.worker_started(worker, {"host": socket.gethostname(), "pid": os.getpid(),
                                  "island": 1, "resumed_from": loop.resumed_from})
    if loop.sync is not None:
        flow_run_log.stats = loop.sync.stats
        flow_run_log.seen = (loop.sync.stats.rounds_sent, loop.sync.stats.rounds_merged)
    flow_log("%s: training from step %d of %d", worker, loop.step, loop.cfg.train.steps)
    try:
        result = loop.run().to_dict()
        state = result.get("state") or "finished"  # or "left": it left the run
    except Interrupted as exc:
        # exc.saved is False when it was stopped while blocked on a mean: no new
        # checkpoint, it resumes from its last periodic one (the loop says so in its
        # status)
        state = "cancelled" if cancelled.is_set() else "interrupted"
        result = {"worker": worker, "steps": exc.step, "tokens": loop.tokens}
    except Exception as exc:
        hooks.worker_finished(worker, {"steps": loop.step, "error": str(exc)}, "failed")
        raise
    finally:
        loop.close()
    hooks.worker_finished(worker, result, state)
    return {**result, "worker": worker, "state": state}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(run_url: str, worker: str, nproc: int) -> list[str]:
    """torchrun for an island of ``nproc`` processes on this machine (the ``--``
    keeps torchrun from reading ``--run`` as its own ``--run-path``). The storage
    options go by environment (``DILOCO_STORAGE_OPTIONS``), never on the command
    line, where ``ps`` shows them."""
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun) if torchrun.exists() else "torchrun", "--nnodes", "1",
           "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "workers", "--",
           "--run", run_url, "--worker", worker]
    return cmd


def _island(run_url: str, worker: str, storage_options: dict | None, nproc: int,
            stop: threading.Event, cancelled: threading.Event,
            hooks: Hooks) -> dict[str, Any]:
    """An island under torchrun; its progress is read back from the status board
    and forwarded to the hooks."""
    store = ObjectStore(run_url, storage_options=storage_options, name=f"{worker}-status")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("DILOCO_STORAGE_OPTIONS", None)
    if storage_options:
        env["DILOCO_STORAGE_OPTIONS"] = json.dumps(storage_options)
    proc = subprocess.Popen(torchrun_command(run_url, worker, nproc), env=env,
                            start_new_session=True, stdout=subprocess.PIPE, text=True)
    said = ResultLine(proc.stdout)
    hooks.worker_started(worker, {"host": socket.gethostname(), "pid": proc.pid,
                                  "island": nproc})
    last_step, stopping_since = -1, None
    while proc.poll() is None:
        time.sleep(1.0)
        status = read_status(store, worker) or {}
        if status.get("step", -1) != last_step and "loss" in status:
            last_step = status["step"]
            hooks.worker_metrics(worker, {k: status[k] for k in (
                "step", "loss", "tokens", "bytes_up", "bytes_down", "wait_s") if k in status})
        if stop.is_set() and stopping_since is None:
            stopping_since = time.monotonic()
            proc.send_signal(signal.SIGTERM)
        elif stopping_since is not None and time.monotonic() - stopping_since > TORCHRUN_GRACE_S:
            log.warning("worker %s: island did not stop in %.0f s; killing it", worker,
                        TORCHRUN_GRACE_S)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    said.join()
    status = read_status(store, worker) or {}
    result = {"worker": worker, **{k: status[k] for k in (
        "step", "tokens", "bytes_up", "bytes_down", "wait_s", "loss", "eval_loss")
        if k in status}}
    line = said.result or {}
    if "interrupted_after" in line:  # the island stopped together, checkpoint saved
        # (torchrun's own status is not 0 then, whoever sent the SIGTERM)
        state = "cancelled" if cancelled.is_set() else "interrupted"
        result["steps"] = line["interrupted_after"]
    elif proc.returncode == 0:
        result.update({k: v for k, v in line.items() if k != "state"})
        state = line.get("state") or "finished"  # or "left": it left the run
    elif stop.is_set():  # killed after TORCHRUN_GRACE_S: it resumes from its last one
        state = "cancelled" if cancelled.is_set() else "interrupted"
    else:
        hooks.worker_finished(worker, result, "failed")
        raise RuntimeError(f"worker {worker}: torchrun exited with status {proc.returncode}")
    hooks.worker_finished(worker, result, state)
    return {**result, "state": state}


class ResultLine(threading.Thread):
    """Reads an island's stdout: rank 0's result line (JSON: a finished or left
    worker's result, or ``interrupted_after``) is kept, anything else passed on.
    torchrun's exit status cannot tell a clean stop from a crash (any rank's
    non-zero status makes it fail), the result line can."""

    def __init__(self, stream: Any):
        super().__init__(daemon=True, name="island-stdout")
        self.stream, self.result = stream, None
        self.start()

    def run(self) -> None:
        for line in self.stream:
            try:
                said = json.loads(line)
            except ValueError:
                said = None
            if isinstance(said, dict) and "worker" in said:
                self.result = said
            else:
                sys.stdout.write(line)
                sys.stdout.flush()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flows.worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="the run's URL")
    p.add_argument("--worker", required=True, help="the worker's name (one of the run's)")
    p.add_argument("--nproc", type=int, default=1, help="processes in the island (torchrun)")
    p.add_argument("--join", action="store_true",
                   help="join the running run as a new worker (a name not in its manifest)")
    p.add_argument("--claim", default=None,
                   help="the id of the join's membership record (diloco join makes one)")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop (after a checkpoint) if the launching process dies")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def exit_if_stuck(stop: threading.Event, grace: float, name: str) -> None:
    """Once ``stop`` is set, give the job ``grace`` seconds, then end the process."""
    stop.wait()
    time.sleep(grace)
    log.error("%s: no step boundary within %.0f s of the stop request (blocked waiting "
              "for a mean); exiting without a new checkpoint, it resumes from its last one",
              name, grace)
    logging.shutdown()
    os._exit(EXIT_CODES["interrupted"])


def main(argv: list[str] | None = None) -> int:
    """Storage options come from ``DILOCO_STORAGE_OPTIONS`` (JSON), never argv."""
    args = parser().parse_args(argv)
    record_threads_at_exit()  # with DILOCO_THREADS_AT_EXIT set (tests)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    if args.exit_with_parent and launcher_gone():
        log.warning("worker %s: the launcher died while this job started; exiting",
                    args.worker)
        return EXIT_CODES["interrupted"]
    options = json.loads(os.environ.get("DILOCO_STORAGE_OPTIONS") or "null")
    stop = threading.Event()
    threading.Thread(target=exit_if_stuck, args=(stop, STOP_GRACE_S, args.worker),
                     daemon=True).start()
    try:
        out = run_worker_job(args.run, args.worker, options, args.nproc, stop=stop,
                             exit_with_parent=args.exit_with_parent, join=args.join,
                             claim=args.claim)
    except (ValueError, *usage_errors()) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - one line a user can act on
        if args.log_level == "DEBUG":
            raise
        log.error("worker %s failed: %s: %s", args.worker, type(exc).__name__, exc)
        return EXIT_CODES["failed"]
    print_result(out)
    return EXIT_CODES[out["state"]]


if __name__ == "__main__":
    sys.exit(main())
