"""``diloco leave RUN --worker W`` when W is an island of two processes (gloo on CPU):
the whole island finishes its round, commits and stops, every rank exiting 0, rank 0
alone printing the result line (state ``left``), as a one-process worker does. Both
the replicated and the sharded (fsdp) island."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_distributed import ROOT
from test_island_stop import data_url, running_run, start_ranks, wait_all, wait_for_step

from diloco.membership import read_json
from storage import layout
from storage.objectstore import ObjectStore

pytestmark = pytest.mark.slow

DILOCO = str(Path(sys.executable).parent / "diloco")
__all__ = ["data_url"]  # the module's fixture, shared


@pytest.mark.parametrize("island", ["replicate", "fsdp"])
def test_leave_stops_every_rank_of_an_island_cleanly(tmp_path, data_url, island):
    with running_run(tmp_path, data_url, 400, f"train.island={island}") as url:
        logs = tmp_path / "logs"
        logs.mkdir()
        procs = start_ranks(url, logs)
        wait_for_step(logs / "err0", 3, procs)
        asked = subprocess.run([DILOCO, "leave", url, "--worker", "solo", "--wait",
                                "--timeout", "120"], cwd=ROOT, text=True,
                               capture_output=True, timeout=180)
        codes = wait_all(procs, 120)
        err = (logs / "err0").read_text()[-3000:] + (logs / "err1").read_text()[-3000:]
        assert asked.returncode == 0, asked.stdout + asked.stderr + err
        assert "solo left after step" in asked.stdout
        assert codes == [0, 0], err
    lines = (logs / "out0").read_text().splitlines()
    assert len(lines) == 1 and (logs / "out1").read_text() == ""
    result = json.loads(lines[0])
    assert result["state"] == "left" and result["steps"] < 400
    left = read_json(ObjectStore(url), layout.left("solo"))
    assert left is not None and left["step"] == result["steps"]
    assert max(left["last_rounds"]) >= 0  # rank 0's rounds, not a follower's "none sent"
