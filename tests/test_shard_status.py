"""``diloco status`` of a run with a sharded aggregator (``aggregator.shards: 2``)
shows shard 1 beside the aggregator (shard 0): its rounds and last poll while it
runs, and, once its job is killed, that it is silent (no poll for several of its
heartbeats), so a dead shard is visible; ``--json`` carries the same."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
from cli_runs import clean_env
from test_distributed import MICRO, ROOT, data_url
from test_shard_eval import contribute

from cli.app import app
from flows.aggregator import run_aggregator_job
from flows.control import shard_board
from flows.shard_status import SILENT_HEARTBEATS, silent_for
from storage.objectstore import ObjectStore
from tracking.hooks import Hooks
from workers.config import load_config
from workers.runs import create_run
from workers.status import read_status

pytestmark = pytest.mark.slow
__all__ = ["data_url"]  # the module's fixture, shared

def status(runner, url: str, *extra: str) -> str:
    """``diloco status`` in this process (the table's content is the subject)."""
    done = runner.invoke(app, ["status", url, *extra])
    assert done.exit_code == 0, done.stdout + done.stderr
    return done.stdout


def shard_row(text: str) -> str:
    return next(line for line in text.splitlines() if line.strip().startswith("aggregator-s1"))


def test_status_shows_each_shard_and_a_dead_one(tmp_path, data_url, in_process):
    url = str(tmp_path / "run")
    cfg = load_config("tiny", [*MICRO, f"data.dataset={data_url}", "train.steps=400",
                               "aggregator.shards=2"])
    create_run(cfg, url)
    stop = threading.Event()
    jobs = [threading.Thread(target=contribute, args=(url, stop)),
            threading.Thread(target=run_aggregator_job, args=(url,),
                             kwargs={"stop": stop, "evaluate": False, "hooks": Hooks()})]
    # shard 1's job as the local launcher starts it: it talks to no Prefect (no server,
    # no Prefect home prepared for it)
    shard1 = subprocess.Popen([sys.executable, "-m", "flows.aggregator_job", "--run", url,
                               "--shard", "1"], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL,
                              env=clean_env(tmp_path, fresh_prefect=True, DILOCO_TRACKING="off"))
    for t in jobs:
        t.start()
    try:
        store, deadline = ObjectStore(url), time.monotonic() + 180
        while ((read_status(store, shard_board(1)) or {}).get("rounds") or 0) < 2:
            assert time.monotonic() < deadline and shard1.poll() is None, "shard 1 never ran"
            time.sleep(0.2)
        alive = shard_row(status(in_process, url))
        assert "running" in alive and "rounds" in alive and "silent" not in alive, alive

        shard1.send_signal(signal.SIGKILL)  # a dead shard: its status stays "running"
        shard1.wait(30)
        last = read_status(store, shard_board(1))
        # silent once SILENT_HEARTBEATS heartbeats have passed since its last poll
        deadline = time.monotonic() + SILENT_HEARTBEATS * last["heartbeat_s"] + 2
        while silent_for(read_status(store, shard_board(1))) is None:
            assert time.monotonic() < deadline, "shard 1 never became silent"
            time.sleep(0.2)
        text = status(in_process, url)
        assert "silent" in shard_row(text), text
        assert f"{last['rounds']}/" in shard_row(text), text
        assert "aggregator-s1 is silent" in text and "is its job alive?" in text, text
        shards = json.loads(status(in_process, url, "--json"))["aggregator_shards"]
        assert shards["aggregator-s1"]["state"] == "running"
        assert shards["aggregator-s1"]["silent_s"] > SILENT_HEARTBEATS * last["heartbeat_s"]
        assert shards["aggregator-s1"]["rounds"] == last["rounds"]
    finally:
        stop.set()
        if shard1.poll() is None:
            shard1.kill()
            shard1.wait()
        for t in jobs:
            t.join(60)
