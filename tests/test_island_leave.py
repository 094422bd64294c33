"""``diloco leave RUN --worker W`` when W is an island of two processes (gloo on CPU):
the whole island finishes its round, commits and stops, every rank exiting 0, rank 0
alone printing the result line (state ``left``), as a one-process worker does. Both
the replicated and the sharded (fsdp) island. ``diloco leave`` runs in this process
(conftest's ``in_process``), the island's ranks as processes of their own (forked by
tests/test_island_stop.py's zygote)."""

from __future__ import annotations

import json

import pytest
from test_island_stop import (
    data_url,
    running_run,
    start_ranks,
    wait_all,
    wait_for_step,
    zygote,
)

from diloco.membership import read_json
from storage import layout
from storage.objectstore import ObjectStore

pytestmark = pytest.mark.slow

__all__ = ["data_url", "zygote"]  # the module's fixtures, shared


@pytest.mark.parametrize("island", ["replicate", "fsdp"])
def test_leave_stops_every_rank_of_an_island_cleanly(tmp_path, data_url, island, in_process,
                                                     zygote):
    from cli.app import app  # noqa: PLC0415

    with running_run(tmp_path, data_url, 400, f"train.island={island}") as url:
        logs = tmp_path / "logs"
        logs.mkdir()
        procs = start_ranks(url, logs, zygote)
        wait_for_step(logs / "err0", 3, procs)
        try:
            asked = in_process.invoke(app, ["leave", url, "--worker", "solo", "--wait",
                                            "--timeout", "120"])
        finally:
            codes = wait_all(procs, 120)
        err = (logs / "err0").read_text()[-3000:] + (logs / "err1").read_text()[-3000:]
        assert asked.exit_code == 0, asked.output + err
        assert "solo left after step" in asked.output
        assert codes == [0, 0], err
    lines = (logs / "out0").read_text().splitlines()
    assert len(lines) == 1 and (logs / "out1").read_text() == ""
    result = json.loads(lines[0])
    assert result["state"] == "left" and result["steps"] < 400
    left = read_json(ObjectStore(url), layout.left("solo"))
    assert left is not None and left["step"] == result["steps"]
    assert max(left["last_rounds"]) >= 0  # rank 0's rounds, not a follower's "none sent"
