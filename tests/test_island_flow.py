"""The Prefect `worker` flow of an island (``nproc 2``: torchrun, gloo on CPU) ends in
the state that says what happened: Completed with state ``left`` when the worker
left the run (``diloco leave``), Cancelled (not Failed) when the island stopped after
a checkpoint on a SIGTERM that did not come from the flow (torchrun's own status is
not 0 then: a rank's 143 fails it)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest
from cli_runs import shared_server
from prefect_server import PrefectServer
from test_distributed import ROOT
from test_island_stop import data_url, running_run
from typer.testing import CliRunner

from cli.app import app
from storage.objectstore import ObjectStore
from workers import checkpoint
from workers.status import read_status

pytestmark = pytest.mark.slow

__all__ = ["data_url"]  # the module's fixture, shared

# the worker flow of an island, as a work pool runs it; its final state on stdout
_FLOW = r"""
import json, sys
from flows.worker import worker
state = worker(run_url=sys.argv[1], worker="solo", nproc=2, return_state=True)
out = state.result(raise_on_failure=False) if state.is_completed() else None
print("FLOW " + json.dumps({"state": state.type.value, "message": state.message,
                            "result": out}, default=str), flush=True)
"""


@pytest.fixture(scope="module")
def server():
    """The Prefect server this test process keeps (the flow runs only need an API)."""
    return shared_server()


def start_flow(server: PrefectServer, url: str, name: str) -> subprocess.Popen:
    return server.spawn([sys.executable, "-c", _FLOW, url], f"island-flow-{name}.log",
                        cwd=ROOT, env={"DILOCO_TRACKING": "off", "OMP_NUM_THREADS": "1"})


def wait_for_step(url: str, step: int, proc: subprocess.Popen, log: str) -> None:
    store, deadline = ObjectStore(url), time.monotonic() + 300
    while time.monotonic() < deadline:
        if ((read_status(store, "solo") or {}).get("step") or 0) >= step:
            return
        assert proc.poll() is None, log
        time.sleep(0.3)
    raise AssertionError(f"the island never reached step {step}")


def final_state(server: PrefectServer, proc: subprocess.Popen, name: str) -> dict:
    try:
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = server.logs(f"island-flow-{name}.log")
    lines = [x for x in text.splitlines() if x.startswith("FLOW ")]
    assert lines, text[-4000:]
    return json.loads(lines[-1][len("FLOW "):])


def test_a_leaving_island_completes_its_flow_run(server, tmp_path, data_url):
    with running_run(tmp_path, data_url, 400, "train.island=replicate") as url:
        proc = start_flow(server, url, "leave")
        wait_for_step(url, 3, proc, server.logs("island-flow-leave.log")[-3000:])
        # `diloco leave`, in this process: it only writes the request to the store
        asked = CliRunner().invoke(app, ["leave", url, "--worker", "solo"])
        assert asked.exit_code == 0, f"{asked.output}\n{asked.exception!r}"
        got = final_state(server, proc, "leave")
    assert got["state"] == "COMPLETED", got
    assert got["result"]["state"] == "left" and got["result"]["steps"] < 400, got


def test_an_island_stopped_by_a_sigterm_is_cancelled_not_failed(server, tmp_path, data_url):
    """SIGTERM to torchrun, not through the flow (a node's shutdown, an operator): the
    ranks save one checkpoint and exit 143; the flow run says Cancelled, with the step."""
    with running_run(tmp_path, data_url, 400, "train.island=replicate") as url:
        proc = start_flow(server, url, "stop")
        wait_for_step(url, 3, proc, server.logs("island-flow-stop.log")[-3000:])
        (torchrun,) = [p for p in psutil.Process(proc.pid).children(recursive=True)
                       if any("torchrun" in part for part in p.cmdline()[:2])]
        torchrun.send_signal(signal.SIGTERM)
        got = final_state(server, proc, "stop")
        saved = checkpoint.latest_step(ObjectStore(url), "solo")
    assert got["state"] == "CANCELLED", got
    assert saved and saved >= 3 and f"after step {saved}" in got["message"], got
