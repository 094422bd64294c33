"""What a Prefect user sees of a run: a short real run against a Prefect server on
loopback, the train flow launching its worker and aggregator jobs as flow runs of
their own (the `worker` and `aggregator` flows in child processes, as a work pool
would run them), read back through the Prefect client: the flow runs' names, the
train flow's tasks, the training progress in the logs, the progress artifact (read
in this process). What a run of the deployments shows (its flow runs named after the
run it chose) is checked on the run of tests/test_deployments.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

try:
    from prefect_server import PrefectServer
except ImportError:  # tests imported as a package
    from tests.prefect_server import PrefectServer

ROOT = Path(__file__).resolve().parent.parent

MICRO = [
    "model.overrides={d_model: 64, n_layers: 2, n_heads: 2, max_seq_len: 64}",
    "data.seq_len=32", "data.batch_size=8", "optim.warmup_steps=2", "train.steps=16",
    "train.eval_every=8", "train.eval_batches=2", "train.log_every=1", "train.threads=1",
    "train.checkpoint_every=8", "sync.schedule.sync_every=8", "sync.schedule.fragments=2", "sync.schedule.overlap=1",
    'data.sources=["builtin:shakespeare/tragedies/*"]',
]

# The train flow with the local backend, its jobs started as flow runs (a launcher
# whose commands call the flows), with the terminal settings of `diloco run`.
_RUN = r"""
import json, sys
from cli.console import quiet_logs
quiet_logs(False)
import flows.train as t
from flows.launchers import AGGREGATOR, LocalLauncher

class FlowLauncher(LocalLauncher):
    def command(self, run_url, name):
        if name == AGGREGATOR:
            code = f"from flows.aggregator import aggregator; aggregator(run_url={run_url!r})"
        else:
            code = (f"from flows.worker import worker; "
                    f"worker(run_url={run_url!r}, worker={name!r})")
        return [sys.executable, "-c", code]

t.LocalLauncher = FlowLauncher
store, overrides = sys.argv[1], json.loads(sys.argv[2])
state = t.train(config="tiny", overrides=[*overrides, f"store={store}"],
                run_url=f"{store}/view-run", return_state=True)
print(json.dumps({"state": state.type.value}))
"""

def read_back() -> dict:
    """Every flow run of the server: its state, logs and tasks; and the artifacts."""
    out = {}
    with get_client(sync_client=True) as client:
        for run in client.read_flow_runs():
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(
                any_=[run.id])))
            tasks = [t.name for t in client.read_task_runs()
                     if t.flow_run_id == run.id]
            out[run.name] = {"state": run.state.type.value,
                             "logs": [entry.message for entry in logs], "tasks": tasks}
        artifacts = client.read_artifacts()
        out["artifacts"] = [{"key": a.key, "type": a.type, "data": a.data,
                             "description": a.description} for a in artifacts]
    return out


@pytest.mark.slow
def test_flow_runs_show_the_training(tmp_path):
    with PrefectServer(tmp_path / "prefect") as server:
        env = {**server.env, "DILOCO_TRACKING": "off"}
        run = subprocess.run([sys.executable, "-c", _RUN, str(tmp_path / "runs"),
                              json.dumps(MICRO)], env=env, text=True, capture_output=True,
                             timeout=400, cwd=ROOT)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert json.loads(run.stdout.strip().splitlines()[-1]) == {"state": "COMPLETED"}
        # the terminal stays quiet: the progress lines went to the API only
        assert "round" not in run.stderr, run.stderr[-3000:]
        with server.api():
            seen = json.loads(json.dumps(read_back(), default=str))
    artifacts = seen.pop("artifacts")
    names = set(seen)
    assert names == {"view-run", "view-run/region-a", "view-run/region-b",
                     "view-run/aggregator"}, names
    assert all(r["state"] == "COMPLETED" for r in seen.values()), seen

    train = seen["view-run"]
    assert set(train["tasks"]) >= {"create-run", "launch-aggregator", "launch-workers",
                                   "wait", "gc", "report"}, train["tasks"]
    rounds = [m for m in train["logs"] if m.startswith("round ")]
    assert rounds and "loss" in rounds[-1], train["logs"]
    assert any("finished after 6 of 6 rounds" in m for m in train["logs"]), train["logs"]

    worker = seen["view-run/region-a"]["logs"]
    sent = [m for m in worker if "sent" in m and "received" in m]
    assert sent and all("loss" in m and "MB" in m and "waited" in m for m in sent), worker
    assert any("eval loss" in m for m in worker), worker
    assert len(worker) < 40, worker  # a line per round and eval, not per step

    agg = seen["view-run/aggregator"]["logs"]
    applied = [m for m in agg if "applied" in m]
    assert len(applied) == 6 and all("2 of 2 members" in m for m in applied), agg

    progress = [a for a in artifacts if a["type"] == "progress"]
    assert len(progress) == 1 and progress[0]["data"] == 100.0, artifacts
    assert progress[0]["description"] == "rounds applied by the aggregator: 6/6 (finished)"
