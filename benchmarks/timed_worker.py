"""One worker as a process, with its time split into computing and communicating.

    python -m benchmarks.timed_worker --run URL --worker W [--storage-option k=v ...] \\
        [--wait-go]

The process trains exactly as ``python -m workers --run URL --worker W`` does (the
same WorkerLoop), and under ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
it joins a gloo process group first, as a torchrun rank does (``--worker auto`` is
the data-parallel baseline). It prints ``READY`` when set up (run manifest, dataset,
initial parameters loaded, process group joined); with ``--wait-go`` it then waits
for a line on stdin before the first step, so that a benchmark can cap the links
after start-up. At the end it prints ``RESULT {json}``.

Timing (perf_counter, in this process). The training loop runs from the first
batch of step 1 to the start of the final evaluation; it includes the synchroniser's
``finish()`` (the last rounds, "drain"). Within it, *blocked* time is every call
that talks to the other parties and can wait on the network:

- ``Synchronizer.step`` (sends, merges and their waits) and ``Synchronizer.finish``;
- ``torch.distributed.all_reduce`` (data-parallel: gradients and the loss);
- ``StatusBoard.update`` (the progress object written to the store).

Everything else (forward, backward, optimizer, clipping, batching, logging) is
*compute*. Utilisation is compute / loop time; "steady" leaves the one-off drain
out of both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from benchmarks import stages
from benchmarks.measurements import status_totals, summarise_traffic, sync_summary

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("benchmarks.timed_worker")


class Clock:
    """Where the loop's time went."""

    def __init__(self) -> None:
        self.loop_start: float | None = None
        self.loop_end: float | None = None
        self.sync_s = 0.0
        self.finish_s = 0.0
        self.allreduce_s = 0.0
        self.status_s = 0.0

    def report(self) -> dict[str, float]:
        loop = (self.loop_end or 0.0) - (self.loop_start or 0.0)
        blocked = self.sync_s + self.finish_s + self.allreduce_s + self.status_s
        steady = loop - self.finish_s
        return {
            "loop_s": loop, "blocked_s": blocked, "compute_s": loop - blocked,
            "sync_s": self.sync_s, "drain_s": self.finish_s, "allreduce_s": self.allreduce_s,
            "status_s": self.status_s,
            "utilisation": (loop - blocked) / loop if loop > 0 else 0.0,
            "utilisation_steady": (loop - blocked) / steady if steady > 0 else 0.0,
        }


def _timed(fn, clock: Clock, attr: str):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(clock, attr, getattr(clock, attr) + time.perf_counter() - t0)

    return wrapper


def instrument(clock: Clock) -> None:
    """Wrap the calls that communicate (see the module docstring); process-wide."""
    import torch.distributed as dist  # noqa: PLC0415

    from diloco import synchronizer  # noqa: PLC0415
    from workers import loop, status  # noqa: PLC0415

    dist.all_reduce = _timed(dist.all_reduce, clock, "allreduce_s")
    synchronizer.Synchronizer.step = _timed(synchronizer.Synchronizer.step, clock, "sync_s")
    synchronizer.Synchronizer.finish = _timed(synchronizer.Synchronizer.finish, clock, "finish_s")
    status.StatusBoard.update = _timed(status.StatusBoard.update, clock, "status_s")

    batch, evaluate = loop.WorkerLoop._batch, loop.evaluate

    def first_batch(self):
        if clock.loop_start is None:
            clock.loop_start = time.perf_counter()
        return batch(self)

    def final_eval(*args, **kwargs):
        if clock.loop_end is None:
            clock.loop_end = time.perf_counter()
        return evaluate(*args, **kwargs)

    loop.WorkerLoop._batch = first_batch
    loop.evaluate = final_eval


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True)
    p.add_argument("--worker", required=True)
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--wait-go", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.storage_option)} or None

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from workers.loop import Group, WorkerLoop  # noqa: PLC0415

    clock = Clock()
    instrument(clock)
    stage_clock = stages.from_env()  # BENCH_STAGES=1: the round's stages (bench_scale)
    base_rss = stages.peak_rss()["rss"]
    group = Group.from_env()
    if group.size > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    def metrics(m: dict[str, Any]) -> None:  # forwarded by the parent (e.g. to MLflow)
        print("METRIC " + json.dumps(m), flush=True)
        if "loss" in m:
            log.info("%s step %d loss %.4f", m["worker"], m["step"], m["loss"])

    loop = WorkerLoop.open(args.run, args.worker, storage_options=opts, group=group,
                      metrics=metrics)
    print("READY", flush=True)
    if args.wait_go and not sys.stdin.readline():
        log.warning("the benchmark went away before the start signal; not training")
        loop.close()
        return 1
    try:
        res = loop.run()
    finally:
        loop.close()
    if group.size > 1:
        dist.barrier()
        dist.destroy_process_group()
    out: dict[str, Any] = {
        **res.to_dict(),
        "timing": clock.report(),
        "traffic": summarise_traffic(loop.store.traffic.snapshot()),
        "status_traffic": status_totals(loop),
    }
    if loop.sync is not None:
        out["sync"] = sync_summary(loop.sync.stats)
    out["memory"] = {"base_rss": base_rss, "peak_rss": stages.peak_rss()["peak"]}
    if stage_clock is not None:
        out["stages"] = stage_clock.report()
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# -- the parent's side -------------------------------------------------------------------


def rank_env(rank: int, world: int, master_addr: str, master_port: int,
             ifname: str | None = None) -> dict[str, str]:
    """What torchrun puts in a rank's environment (plus gloo's interface)."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
    if ifname:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return env


def launch(run_url: str, worker: str, *, env: dict[str, str] | None = None,
           prefix: Sequence[str] = (), storage_options: dict | None = None,
           wait_go: bool = False, log_file: IO[str] | None = None) -> subprocess.Popen[str]:
    """Start one timed worker (``prefix``: e.g. ``ip netns exec NAME``)."""
    cmd = [*prefix, sys.executable, "-m", "benchmarks.timed_worker", "--run", run_url,
           "--worker", worker]
    for k, v in (storage_options or {}).items():
        cmd += ["--storage-option", f"{k}={json.dumps(v)}"]
    if wait_go:
        cmd.append("--wait-go")
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            stderr=log_file if log_file is not None else subprocess.DEVNULL)


def _line(proc: subprocess.Popen[str], want: str, deadline: float) -> str:
    assert proc.stdout is not None
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker process {proc.pid}: no {want} line in time")
        line = proc.stdout.readline()
        if not line:
            code = proc.wait(timeout=30)
            raise RuntimeError(f"worker process {proc.pid} exited ({code}) before {want}")
        if line.startswith(want):
            return line[len(want):].strip()


def wait_ready(procs: Sequence[subprocess.Popen[str]], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        _line(proc, "READY", deadline)


def go(procs: Sequence[subprocess.Popen[str]]) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("GO\n")
        proc.stdin.flush()


def collect(procs: Sequence[subprocess.Popen[str]], timeout: float = 3600,
            on_metric: Callable[[dict[str, Any]], None] | None = None) -> list[dict]:
    """Each process's RESULT (in order), passing METRIC lines to ``on_metric`` as they
    come; kills them all if one fails or ``timeout`` passes."""
    results: list[dict | None] = [None] * len(procs)
    failed = threading.Event()

    def read(i: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("METRIC ") and on_metric is not None:
                with contextlib.suppress(Exception):  # metrics never stop a run
                    on_metric(json.loads(line[7:]))
            elif line.startswith("RESULT "):
                results[i] = json.loads(line[7:])
        if results[i] is None:
            failed.set()

    readers = [threading.Thread(target=read, args=(i, p), daemon=True)
               for i, p in enumerate(procs)]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        for t in readers:
            while t.is_alive() and not failed.is_set():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker processes still running after {timeout:.0f} s")
                t.join(0.5)
            if failed.is_set():
                bad = [p.pid for p, r in zip(procs, results, strict=True) if r is None]
                raise RuntimeError(f"worker process(es) {bad} exited without a result")
        for proc in procs:
            proc.wait(timeout=60)
        return [r for r in results if r is not None]
    finally:
        stop(procs)


def stop(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Terminate the given processes (ours, by pid) that are still running."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


if __name__ == "__main__":
    from workers.group_exit import leave  # noqa: PLC0415

    leave(main())  # a rank of a group: no interpreter teardown (workers/group_exit.py)
