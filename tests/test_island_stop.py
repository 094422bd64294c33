"""Stopping a 2-process island (gloo on CPU): a SIGTERM that reaches one rank, or
torchrun, stops every rank after the same step with one checkpoint and the stopped
exit status (no rank left waiting in a collective), and a restart resumes from it.
Rank 0 alone prints the worker's result line.

An island's ranks are ``python -m workers`` processes with torchrun's environment;
here they are forked from a `Zygote`, one process per module that has imported torch
and the worker once (each rank is still a process of its own, with its own pid,
signals, stdout and exit status), so that a rank does not pay torch's start-up. The
SIGTERM to torchrun test starts torchrun and its ranks as a user does."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_distributed import MICRO, ROOT, TORCHRUN, free_port

from diloco.aggregator import Aggregator
from diloco.run import open_run
from storage.objectstore import ObjectStore
from workers import checkpoint
from workers.config import load_config
from workers.data.prepare import prepare_data
from workers.runs import create_run

pytestmark = pytest.mark.slow

STOPPED = 143  # flows.jobs.EXIT_STOPPED: interrupted, checkpoint saved
STEP = re.compile(r"workers\.progress: solo step (\d+) loss")
BOUND_S = 60.0  # every rank gone this long after the signal


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("data") / "shakespeare")
    prepare_data(["builtin:shakespeare"], url, max_bytes=200_000)
    return url


@contextmanager
def running_run(tmp_path: Path, data_url: str, steps: int, *extra: str):
    """A one-worker run (``solo``; ``extra``: more config overrides) with its
    aggregator running in this process."""
    url = str(tmp_path / "run")
    cfg = load_config("tiny", [*MICRO, f"data.dataset={data_url}", "workers=[solo]",
                               "data.slots=1", f"train.steps={steps}", *extra])
    create_run(cfg, url)
    agg, stop = Aggregator(open_run(url)), threading.Event()
    t = threading.Thread(target=agg.run, args=(stop, 600))
    t.start()
    try:
        yield url
    finally:
        stop.set()
        t.join(60)


# The zygote: imports what a rank of `python -m workers` imports, then forks one child
# per request (a JSON line on stdin: environment, arguments, stdout and stderr files),
# answers its pid, and reports every child's exit status when it ends. Nothing has run
# a thread in it when it forks.
_ZYGOTE = r"""
import json, os, signal, sys, traceback
import torch, torch.distributed, torch.distributed.checkpoint
from torch.distributed.fsdp import fully_shard
import diloco.run, storage.backends, storage.reach, workers.island, workers.loop
from workers.__main__ import main
from workers.group_exit import leave

def reap(*_):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        os.write(1, f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())

signal.signal(signal.SIGCHLD, reap)
os.write(1, b"ready\n")
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.environ.clear()
            os.environ.update(job["env"])
            for fd, path in ((1, job["out"]), (2, job["err"])):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            sys.stdin.close()
            sys.argv = ["workers", *job["args"]]
            leave(main(job["args"]))  # as workers/__main__.py ends
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.write(1, f"pid {pid}\n".encode())
"""


class Forked:
    """A rank forked by the `Zygote`: the part of `subprocess.Popen` the tests use."""

    def __init__(self, zygote: Zygote, pid: int):
        self.zygote, self.pid = zygote, pid

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def poll(self) -> int | None:
        return self.zygote.codes.get(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        with self.zygote.ended:
            if not self.zygote.ended.wait_for(lambda: self.pid in self.zygote.codes, timeout):
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
            return self.zygote.codes[self.pid]


class Zygote:
    """One process that has imported torch and the worker, forking the ranks."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE], cwd=ROOT, text=True, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1",
                                         "PYTHONUNBUFFERED": "1"})
        self.codes: dict[int, int] = {}
        self.ended = threading.Condition()
        self.pids: queue.Queue[int] = queue.Queue()
        first = self.proc.stdout.readline()
        assert first == "ready\n", first
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            kind, pid, *code = line.split()
            if kind == "pid":
                self.pids.put(int(pid))
            else:
                with self.ended:
                    self.codes[int(pid)] = int(code[0])
                    self.ended.notify_all()

    def fork(self, env: dict[str, str], args: list[str], out: Path, err: Path) -> Forked:
        self.proc.stdin.write(json.dumps({"env": env, "args": args, "out": str(out),
                                          "err": str(err)}) + "\n")
        self.proc.stdin.flush()
        return Forked(self, self.pids.get(timeout=60))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)
        self.reader.join(10)


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def start_ranks(url: str, logs: Path, zygote: Zygote | None = None
                ) -> list[subprocess.Popen | Forked]:
    """The two ranks of an island, started as torchrun would (its environment), so
    that each rank's exit status and stdout can be read: processes of their own, or
    forked by ``zygote``."""
    port, procs = free_port(), []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        args = ["--run", url, "--worker", "solo"]
        if zygote is not None:
            env["PYTHONUNBUFFERED"] = "1"  # as workers/__main__.py sets it
            procs.append(zygote.fork(env, args, logs / f"out{rank}", logs / f"err{rank}"))
            continue
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "workers", *args], cwd=ROOT,
            env=env, stdout=open(logs / f"out{rank}", "w"),  # noqa: SIM115
            stderr=open(logs / f"err{rank}", "w")))  # noqa: SIM115
    return procs


def wait_for_step(err: Path, step: int, procs: list[subprocess.Popen | Forked]) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if any(int(s) >= step for s in STEP.findall(err.read_text())):
            return
        assert all(p.poll() is None for p in procs), err.read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no step {step} in time: {err.read_text()[-2000:]}")


def wait_all(procs: list[subprocess.Popen | Forked], bound_s: float) -> list[int]:
    try:
        return [p.wait(timeout=bound_s) for p in procs]
    finally:
        for p in procs:  # a hung rank: end it (only the processes this test started)
            if p.poll() is None:
                p.kill()
                p.wait()


def stop_one_rank(url: str, logs: Path, rank: int, after_step: int, zygote: Zygote) -> int:
    """Start the island, SIGTERM ``rank`` once rank 0 logged ``after_step``; the
    step the island stopped after (its checkpoint's)."""
    logs.mkdir()
    procs = start_ranks(url, logs, zygote)
    wait_for_step(logs / "err0", after_step, procs)
    procs[rank].send_signal(signal.SIGTERM)
    sent = time.monotonic()
    codes = wait_all(procs, BOUND_S)
    assert time.monotonic() - sent < BOUND_S
    assert codes == [STOPPED, STOPPED], (logs / "err0").read_text()[-3000:]
    lines = (logs / "out0").read_text().splitlines()
    assert len(lines) == 1 and (logs / "out1").read_text() == ""  # rank 0 alone says it
    stopped = json.loads(lines[0])["interrupted_after"]
    assert checkpoint.latest_step(ObjectStore(url), "solo") == stopped >= after_step
    return stopped


@pytest.mark.parametrize("island", ["replicate", "fsdp"])
def test_sigterm_to_one_rank_stops_the_island_together_and_it_resumes(tmp_path, data_url,
                                                                       island, zygote):
    """SIGTERM to rank 1 (the rank that does not commit the checkpoint), then, restarted,
    to rank 0: both times every rank exits 143 after the same step, the checkpoint is
    that step's (an fsdp island's holds every rank's shards), and the restart goes on
    from it."""
    with running_run(tmp_path, data_url, 400, f"train.island={island}") as url:
        first = stop_one_rank(url, tmp_path / "a", rank=1, after_step=3, zygote=zygote)
        second = stop_one_rank(url, tmp_path / "b", rank=0, after_step=first + 2,
                               zygote=zygote)
    err = (tmp_path / "b" / "err0").read_text()
    assert f"resumed from the checkpoint of step {first}" in err
    assert min(int(s) for s in STEP.findall(err)) == first + 1  # nothing redone, no gap
    assert second > first
    ranks = checkpoint.latest(ObjectStore(url), "solo").dcp["ranks"]
    assert ranks == (2 if island == "fsdp" else 1)  # an fsdp island's ranks wrote theirs


def test_sigterm_to_torchrun_stops_the_island_with_a_checkpoint(tmp_path, data_url):
    """What a launcher does (flows.worker sends SIGTERM to torchrun): torchrun passes it
    on to the ranks; they stop after the same step, save once, and the island's stdout
    holds one result line."""
    with running_run(tmp_path, data_url, steps=400) as url:
        err = tmp_path / "err"
        cmd = [str(TORCHRUN), "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               "-m", "workers", "--", "--run", url, "--worker", "solo"]
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                stdout=subprocess.PIPE, text=True,
                                stderr=open(err, "w"))  # noqa: SIM115
        wait_for_step(err, 3, [proc])
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=BOUND_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lines = out.splitlines()
        assert len(lines) == 1, err.read_text()[-3000:]
        stopped = json.loads(lines[0])["interrupted_after"]
        assert checkpoint.latest_step(ObjectStore(url), "solo") == stopped >= 3
        assert proc.returncode != 0  # torchrun's own status: not "finished"


def test_an_island_that_finishes_prints_one_result_line(tmp_path, data_url, zygote):
    with running_run(tmp_path, data_url, steps=8) as url:
        (tmp_path / "logs").mkdir()
        procs = start_ranks(url, tmp_path / "logs", zygote)
        assert wait_all(procs, 240) == [0, 0]
    lines = (tmp_path / "logs" / "out0").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["steps"] == 8
    assert (tmp_path / "logs" / "out1").read_text() == ""
