"""Multi-process training the way a user launches it: a two-process island inside one
region under torchrun, and the data-parallel baseline across two workers (two ranks
started with torchrun's environment, as tests/test_island_stop.py starts an island's).
gloo on CPU; the store is a local directory; the aggregator runs in this process, and
so does the one-process worker the island is compared with."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from test_worker import MICRO as WORKER_MICRO

from diloco.aggregator import Aggregator
from diloco.run import open_run
from workers.config import load_config
from workers.data.prepare import prepare_data
from workers.runs import create_run

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).parent / "torchrun"
STEP = re.compile(r"workers\.progress: (\S+) step (\d+) loss ([0-9.]+)")

MICRO = [*WORKER_MICRO, "train.checkpoint_every=0", "train.steps=16"]


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("data") / "shakespeare")
    prepare_data(["builtin:shakespeare"], url, max_bytes=200_000)
    return url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [str(TORCHRUN), "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "workers", "--", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def ranks(nproc: int, logs: Path, *args: str) -> str:
    """``python -m workers ARGS`` as ``nproc`` ranks with the environment torchrun gives
    them (no torchrun agent process); all must exit 0. Their stderr, rank after rank."""
    logs.mkdir()
    port, procs = free_port(), []
    for rank in range(nproc):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        with open(logs / f"err{rank}", "w") as err:
            procs.append(subprocess.Popen([sys.executable, "-m", "workers", *args], cwd=ROOT,
                                          env=env, stdout=subprocess.DEVNULL, stderr=err))
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:  # a hung rank: end it (only the processes started here)
            if p.poll() is None:
                p.kill()
                p.wait()
    stderr = "".join((logs / f"err{rank}").read_text() for rank in range(nproc))
    assert codes == [0] * nproc, stderr[-3000:]
    return stderr


def losses(stderr: str, worker: str) -> list[float]:
    found = {}
    for w, step, loss in STEP.findall(stderr):
        if w == worker:
            found[int(step)] = float(loss)
    return [found[s] for s in sorted(found)]


def run_island(tmp_path: Path, data_url: str, nproc: int) -> list[float]:
    """The loss curve of worker ``solo``: an island of ``nproc`` processes under
    torchrun, or with ``nproc`` 1 the worker in this process (`WorkerLoop`, what
    ``python -m workers`` runs; its losses as the progress log writes them)."""
    from workers.loop import WorkerLoop  # noqa: PLC0415

    url = str(tmp_path / f"island{nproc}")
    cfg = load_config("tiny", [*MICRO, f"data.dataset={data_url}", "workers=[solo]",
                               "data.slots=1"])  # the whole data, as before data slots
    create_run(cfg, url)
    agg = Aggregator(open_run(url))
    stop = threading.Event()
    t = threading.Thread(target=agg.run, args=(stop, 300))
    t.start()
    logged: dict[int, float] = {}
    try:
        if nproc == 1:
            def metrics(m):
                if "loss" in m:
                    logged[m["step"]] = float(f"{m['loss']:.4f}")  # workers.progress's %.4f
            loop = WorkerLoop.open(url, "solo", metrics=metrics)
            try:
                loop.run()
            finally:
                loop.close()
        else:
            out = torchrun(nproc, "--run", url, "--worker", "solo")
    finally:
        t.join(60)
        stop.set()
    assert agg.done
    return [logged[s] for s in sorted(logged)] if nproc == 1 else losses(out.stderr, "solo")


def test_two_process_island_matches_one_process(tmp_path, data_url):
    """A 2-process island (4 sequences each) gives the loss curve of one process with
    the same global batch of 8: only the order of float additions differs."""
    one = run_island(tmp_path, data_url, 1)
    two = run_island(tmp_path, data_url, 2)
    assert len(one) == len(two) == 16
    assert two == pytest.approx(one, rel=2e-4)
    assert one[-1] < one[0] - 1.0


def test_data_parallel_baseline_on_two_processes(tmp_path, data_url):
    """The baseline: gradients all-reduced every step, so both workers hold the same
    parameters all along; it reports the loss averaged over both workers."""
    url = str(tmp_path / "dp")
    cfg = load_config("tiny", [*MICRO, f"data.dataset={data_url}",
                               "train.strategy=data_parallel", "train.checkpoint_every=16"])
    create_run(cfg, url)
    stderr = ranks(2, tmp_path / "logs", "--run", url, "--worker", "auto")
    a, b = losses(stderr, "region-a"), losses(stderr, "region-b")
    assert len(a) == 16 and a == b  # the all-reduced loss is the same on both ranks
    assert a[-1] < a[0] - 1.0
    # both workers checkpointed identical parameters at step 16
    from storage.objectstore import ObjectStore  # noqa: PLC0415
    from workers import checkpoint  # noqa: PLC0415

    store = ObjectStore(url)
    _, sa = checkpoint.load(store, "region-a")
    _, sb = checkpoint.load(store, "region-b")
    for name, value in sa["model"].items():
        assert torch.equal(value, sb["model"][name]), name
