"""Stopping a 2-process island (gloo on CPU): a SIGTERM that reaches one rank, or
torchrun, stops every rank after the same step with one checkpoint and the stopped
exit status (no rank left waiting in a collective), and a restart resumes from it.
Rank 0 alone prints the worker's result line.

An island's ranks are ``python -m workers`` processes with torchrun's environment;
here they are forked from the zygote of tests/zygote.py, one process per test process
that has imported torch and the worker once (each rank is still a process of its own,
with its own pid, session, signals, stdout and exit status), so that a rank does not
pay torch's start-up. The SIGTERM to torchrun test starts torchrun and its ranks as a
user does."""

from __future__ import annotations

import json
import os
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
from zygote import Forked, Zygote
from zygote import zygote as the_zygote

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


@pytest.fixture(scope="module")
def zygote() -> Zygote:
    """The test process's zygote (tests/zygote.py), shared with the fault trials."""
    return the_zygote()


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
            procs.append(zygote.start([sys.executable, "-m", "workers", *args], env,
                                      logs / f"out{rank}", logs / f"err{rank}"))
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
