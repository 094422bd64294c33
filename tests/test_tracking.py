"""MLflow tracking: parent and child runs, metric histories, artifacts, outages.

A "tiny run" here is synthetic: the hooks of the train job, two workers and the
aggregator are driven in-process with made-up metrics (`fake_run`), each through
its own `MlflowHooks`, as the separate jobs would. The numbers are chosen so that
every expected value below can be checked by hand:

- 60 inner steps, metrics every 10 steps, eval at 20 and 40 and at the end (60).
- H = 20, P = 2: a merge point every s = H/P = 10 steps; merge point k (1..6)
  belongs to fragment (k-1) % 2, round (k-1) // 2, and is the aggregator's MLflow
  step k-1 (= r*P + p). The aggregator evaluates after fragment 1 (k = 2, 4, 6,
  inner steps 20, 40, 60).
- A worker sends 1000 bytes and receives 500 per merge point: at step t it has
  sent 100*t and received 50*t bytes. The aggregator has sent 100 k and received
  200 k bytes after merge point k, 40 k of them checkpoints: 600 + 1200 at the end,
  so the run moved 2 * (6000 + 3000) + 1800 = 19,800 bytes, 240 of checkpoints.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from storage.objectstore import ObjectStore
from tracking.hooks import Hooks
from tracking.mlflow_hooks import MlflowHooks, hooks_for
from tracking.plots import RUN_PLOTS
from tracking.runs import TRACKING_KEY
from workers.config import RunConfig, load_config

try:
    from mlflow_server import MlflowServer
except ImportError:  # tests imported as a package
    from tests.mlflow_server import MlflowServer

WORKERS = ("region-a", "region-b")
STEPS = 60
UP_PER_MERGE, DOWN_PER_MERGE = 1000, 500


def tiny_config(strategy: str = "diloco", steps: int = STEPS) -> dict[str, Any]:
    cfg = load_config(None, [
        f"train.steps={steps}", "train.eval_every=20", "train.log_every=10",
        f"train.strategy={strategy}", "sync.schedule.sync_every=20", "sync.schedule.fragments=2",
        "sync.schedule.overlap=0", "data.batch_size=4", "data.seq_len=32",
        "train.log_model=false",  # a fake run has no model in its store to log
    ])
    return cfg.model_dump(mode="json")


def tiny_parameters(config: dict[str, Any]) -> int:
    """The parameter count of the config's model, built on the meta device (no
    memory) and counted: what the train job reads from the run's manifest."""
    import torch  # noqa: PLC0415

    from workers.model import Transformer  # noqa: PLC0415

    with torch.device("meta"):
        model = Transformer(RunConfig.model_validate(config).model_config_resolved)
    return sum(p.numel() for p in model.parameters())


def worker_loss(worker: str, step: int, strategy: str) -> float:
    return 5.0 - 0.02 * step + (0.1 if worker == "region-b" else 0.0) + (
        0.05 if strategy == "data_parallel" else 0.0)


def eval_loss(step: int, strategy: str) -> float:
    """Canonical eval loss: 4.5 at step 20, 4.0 at 40, 3.5 at 60 (DP 0.1 higher)."""
    return 5.0 - 0.025 * step + (0.1 if strategy == "data_parallel" else 0.0)


def worker_eval(worker: str, step: int, strategy: str) -> float:
    """A replica is a little behind the canonical model (region-b a little more)."""
    return eval_loss(step, strategy) + (0.15 if worker == "region-a" else 0.25)


def fake_run(
    run_url: str,
    *,
    strategy: str = "diloco",
    storage_options: dict | None = None,
    steps: int = STEPS,
    between: Any = None,
    close_timeout: float = 30.0,
    pace: float = 0.0,
) -> dict[str, Any]:
    """Drive the hooks of a tiny run: train job, two workers, aggregator. Returns
    the hooks and what each close() did not log. ``between(step)`` runs after each
    logging step (tests stop a server there)."""
    cfg = tiny_config(strategy, steps)
    tokens_per_step = 4 * 32
    train = hooks_for(run_url, role="train", storage_options=storage_options)
    train.run_started(cfg, run_url, resumed=False, n_params=tiny_parameters(cfg))
    workers = {w: hooks_for(run_url, role=f"worker:{w}", storage_options=storage_options)
               for w in WORKERS}
    agg = hooks_for(run_url, role="aggregator", storage_options=storage_options)
    for w, hooks in workers.items():
        hooks.worker_started(w, {"host": "test", "island": 1, "resumed_from": None})
    for step in range(10, steps + 1, 10):
        for w, hooks in workers.items():
            m = {"worker": w, "step": step, "loss": worker_loss(w, step, strategy),
                 "lr": 1e-3, "tokens_per_s": 1000.0, "tokens": step * tokens_per_step}
            if strategy == "diloco":
                m.update(bytes_up=UP_PER_MERGE * step // 10,
                         bytes_down=DOWN_PER_MERGE * step // 10,
                         wait_s=0.01 * step, staleness=0.0, late_means=0)
            else:  # the baseline's store traffic: the initial parameters only
                m.update(bytes_up=0, bytes_down=7)
            hooks.worker_metrics(w, m)
            if step % 20 == 0:
                hooks.worker_metrics(w, {"worker": w, "step": step,
                                         "eval_loss": worker_eval(w, step, strategy),
                                         "final": step == steps})
        if strategy == "diloco":
            k = step // 10
            p, r = (k - 1) % 2, (k - 1) // 2
            report = {"fragment": p, "round": r, "weights": {"region-a": 0.5, "region-b": 0.5},
                      "rejected": {}, "adopted": False, "seconds": 0.25,
                      "grad_norm": 1.0 + k, "bytes_up": 100 * k, "bytes_down": 200 * k,
                      "bytes_checkpoints": 40 * k}
            if p == 1 and step != steps:
                report["eval_loss"] = eval_loss(step, strategy)
                report["perplexity"] = 2.718281828 ** report["eval_loss"]
            agg.aggregator_round(report)
            if step == steps:  # the aggregator's final evaluation, after the rounds
                loss = eval_loss(step, strategy)
                agg.aggregator_eval({"eval_loss": loss, "perplexity": 2.718281828 ** loss,
                                     "rounds": k, "final": True})
        if between is not None:
            between(step)
        time.sleep(pace)  # spreads the timestamps for the wall-time plots
    for w, hooks in workers.items():
        hooks.worker_finished(w, {"worker": w, "steps": steps,
                                  "tokens": steps * tokens_per_step, "seconds": 6.0,
                                  "final_loss": worker_loss(w, steps, strategy),
                                  "eval_loss": worker_eval(w, steps, strategy),
                                  "wait_seconds": 0.6, "bytes_up": 6000,
                                  "bytes_down": 3000, "resumed_from": None},
                              "finished")
    closes = {}
    for name, hooks in [*workers.items(), ("aggregator", agg)]:
        closes[name] = hooks.close(timeout=close_timeout)
    train.run_finished({"state": "finished", "run": run_url, "steps": steps})
    closes["train"] = train.close(timeout=close_timeout)
    return {"train": train, "workers": workers, "aggregator": agg, "closes": closes}


@pytest.fixture(scope="session")
def mlflow_db_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow SQLite database with its schema migrated (about 8 s, once)."""
    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def sqlite_tracking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                    mlflow_db_template: Path) -> str:
    """MLFLOW_TRACKING_URI on a fresh SQLite file in tmp_path (cwd there too)."""
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_db_template, db)
    uri = f"sqlite:///{db}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "diloco-test")
    monkeypatch.setenv("DILOCO_SYSTEM_METRICS", "off")
    monkeypatch.delenv("DILOCO_TRACKING", raising=False)
    monkeypatch.chdir(tmp_path)
    return uri


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def assert_history(client: MlflowClient, run_id: str, key: str,
                   expected: list[tuple[int, float]]) -> None:
    got = history(client, run_id, key)
    assert [s for s, _ in got] == [s for s, _ in expected], (key, got)
    assert [v for _, v in got] == pytest.approx([v for _, v in expected]), (key, got)


def check_tiny_run(client: MlflowClient, run_url: str, store: ObjectStore) -> dict[str, Any]:
    """The parent, two worker children and the aggregator child of `fake_run`."""
    info = json.loads(store.get(TRACKING_KEY))
    assert info["version"] == 1
    assert info["workers"] == list(WORKERS)
    assert info["schedule"] == {"sync_every": 20, "fragments": 2, "overlap": 0,
                                "total_steps": STEPS, "tokens_per_step": 128}
    parent = client.get_run(info["parent_run_id"])
    assert parent.info.run_name == run_url.rsplit("/", 1)[-1]
    assert parent.info.status == "FINISHED"
    tags, params = parent.data.tags, parent.data.params
    assert tags["diloco.role"] == "train"
    assert tags["diloco.regions"] == "region-a,region-b"
    assert tags["diloco.mode"] == "streaming"
    assert tags["diloco.strategy"] == "diloco"
    assert tags["diloco.code_version"]
    assert "@" not in tags["diloco.store"]
    # MLflow's standard tags: the UI shows the name, the source and the commit
    assert tags["mlflow.runName"] == run_url.rsplit("/", 1)[-1]
    assert tags["mlflow.source.type"] == "JOB"
    assert tags["mlflow.source.name"] == "diloco train"
    assert re.fullmatch(r"[0-9a-f]{40}", tags["mlflow.source.git.commit"])
    assert params["train.steps"] == str(STEPS)
    assert params["sync.schedule.fragments"] == "2"
    assert params["workers"] == '["region-a", "region-b"]'
    assert int(params["model.parameters"]) > 0
    assert len(params) > 40  # the whole resolved config

    # the UI opens the experiment on its model-training view, not the GenAI overview
    experiment = client.get_experiment(info["experiment_id"])
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    children = client.search_runs(
        [info["experiment_id"]],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    by_name = {c.info.run_name: c for c in children}
    assert sorted(by_name) == ["aggregator", "region-a", "region-b"]
    for w in WORKERS:
        run = by_name[w]
        assert run.info.status == "FINISHED"
        assert run.data.tags["diloco.worker"] == w
        assert run.data.tags["diloco.info.host"] == "test"
        assert run.data.tags["mlflow.runName"] == w
        assert run.data.tags["mlflow.source.name"] == "diloco worker"
        assert run.data.tags["mlflow.source.git.commit"] == tags["mlflow.source.git.commit"]
        rid = run.info.run_id
        # log_every 10: steps 10..60; loss 5 - 0.02 t (+0.1 for region-b)
        off = 0.1 if w == "region-b" else 0.0
        assert_history(client, rid, "loss",
                       [(t, 5.0 - 0.02 * t + off) for t in range(10, 61, 10)])
        assert [s for s, _ in history(client, rid, "eval_loss")] == [20, 40, 60]
        assert history(client, rid, "bytes_up")[-1] == (60, 6000.0)  # 1000 * 6 merges
        assert history(client, rid, "bytes_down")[-1] == (60, 3000.0)
        for key in ("lr", "tokens_per_s", "wait_s", "staleness", "tokens"):
            assert len(history(client, rid, key)) == 6, key
        assert history(client, rid, "result/wait_seconds") == [(60, 0.6)]
    agg = by_name["aggregator"].info.run_id
    assert by_name["aggregator"].info.status == "FINISHED"
    assert by_name["aggregator"].data.tags["mlflow.runName"] == "aggregator"
    assert by_name["aggregator"].data.tags["mlflow.source.name"] == "diloco aggregator"
    # one step axis: merge point k = r*P + p (0..5) sits at its inner step 10 (k+1);
    # fragment 0 at 10, 30, 50; the round (r) and merge point (k) are metrics
    assert history(client, agg, "grad_norm/frag0") == [(10, 2.0), (30, 4.0), (50, 6.0)]
    assert history(client, agg, "grad_norm/frag1") == [(20, 3.0), (40, 5.0), (60, 7.0)]
    assert history(client, agg, "participation") == [(10 * (k + 1), 2.0) for k in range(6)]
    assert history(client, agg, "weight/region-a") == [(10 * (k + 1), 0.5) for k in range(6)]
    assert history(client, agg, "round_seconds") == [(10 * (k + 1), 0.25) for k in range(6)]
    assert history(client, agg, "inner_step") == [(10 * (k + 1), 10.0 * (k + 1))
                                                  for k in range(6)]
    assert history(client, agg, "round") == [(10 * (k + 1), float(k // 2)) for k in range(6)]
    assert history(client, agg, "merge_point") == [(10 * (k + 1), float(k)) for k in range(6)]
    # the same steps as the workers' eval_loss (20, 40, 60): the curves line up
    assert_history(client, agg, "eval_loss", [(20, 4.5), (40, 4.0), (60, 3.5)])
    assert len(history(client, agg, "perplexity")) == 3
    assert history(client, agg, "bytes_down")[-1] == (60, 1200.0)

    artifacts = {f.path for f in client.list_artifacts(parent.info.run_id)}
    assert {"summary.json", "config.yaml", "plots"} <= artifacts
    plots = {Path(f.path).name: f.file_size
             for f in client.list_artifacts(parent.info.run_id, "plots")}
    assert sorted(plots) == sorted(RUN_PLOTS)
    assert all(size > 10_000 for size in plots.values()), plots
    summary_path = client.download_artifacts(parent.info.run_id, "summary.json")
    summary = json.loads(Path(summary_path).read_text())
    assert summary["steps"] == STEPS
    results = summary["tracking"]["results"]
    assert results["final_eval_loss"] == pytest.approx(3.5)
    assert results["best_eval_loss"] == pytest.approx(3.5)
    # every party's bytes: the workers' and the aggregator's (its checkpoints included)
    assert results["bytes_exchanged"] == 2 * (6000 + 3000) + 600 + 1200 == 19_800
    assert results["bytes_workers"] == 18_000
    assert results["bytes_aggregator"] == 1800
    assert results["bytes_checkpoints"] == 240
    assert results["bytes_source"] == "measured (store): workers + aggregator"
    assert results["tokens"] == 2 * 60 * 128
    assert summary["tracking"]["not_logged_by_train_job"] == {}
    # the same numbers as metrics of the parent, for MLflow's own run comparison
    final = client.get_run(parent.info.run_id).data.metrics
    assert final["final_eval_loss"] == pytest.approx(3.5)
    assert final["bytes_exchanged"] == 19_800
    assert final["bytes_checkpoints"] == 240
    return {"parent": parent, "children": by_name, "info": info}


# -- unit-level behaviour ----------------------------------------------------------------

def test_tracking_off_gives_noop_hooks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DILOCO_TRACKING", "off")
    hooks = hooks_for(tmp_path.as_uri(), role="train")
    assert type(hooks) is Hooks
    assert type(hooks_for(tmp_path.as_uri(), role="aggregator")) is Hooks


def test_default_uri_is_sqlite_in_cwd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tracking.settings import default_tracking_uri, flatten, strip_credentials

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert default_tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert strip_credentials("https://u:secret@host:5000/x") == "https://host:5000/x"
    assert strip_credentials("s3://KEY:SECRET@bucket/p") == "s3://bucket/p"
    flat = flatten({"a": {"b": 1, "c": [1, 2], "d": {}}, "e": None, "f": "x" * 7000,
                    "store": "s3://KEY:SECRET@bucket/runs"})
    assert flat == {"a.b": "1", "a.c": "[1, 2]", "a.d": "{}", "e": "null",
                    "f": "x" * 5999 + "…", "store": "s3://bucket/runs"}


def test_tiny_run_on_sqlite(sqlite_tracking: str, tmp_path: Path) -> None:
    """(1) A tiny run: parent and children with their metric histories, params,
    tags and artifacts (that hook calls do not wait for MLflow is the next test's)."""
    run_url = (tmp_path / "store" / "run-sqlite").as_uri()
    run = fake_run(run_url, pace=0.05)
    assert all(c == {} for c in run["closes"].values()), run["closes"]
    check_tiny_run(MlflowClient(sqlite_tracking), run_url, ObjectStore(run_url))


def test_restarted_jobs_continue_their_runs(sqlite_tracking: str, tmp_path: Path) -> None:
    """A worker job that died and a train job that resumed continue their runs
    (found through tracking.json and the child's tags) instead of making new ones."""
    run_url = (tmp_path / "store" / "run-resume").as_uri()
    cfg = tiny_config()
    train = MlflowHooks(run_url, role="train")
    train.run_started(cfg, run_url, resumed=False)
    # as in a real run, the worker job starts once the train job has created the
    # parent run (tracking.json); on a busy machine that takes a moment
    deadline = time.monotonic() + 60
    while not ObjectStore(run_url).exists(TRACKING_KEY) and time.monotonic() < deadline:
        time.sleep(0.1)
    first = MlflowHooks(run_url, role="worker:region-a")
    first.worker_started("region-a", {"attempt": 1})
    for step in (10, 20):
        first.worker_metrics("region-a", {"worker": "region-a", "step": step, "loss": 1.0})
    assert first.close(timeout=30) == {}  # died without worker_finished
    assert train.close(timeout=30) == {}

    client = MlflowClient(sqlite_tracking)
    info = json.loads(ObjectStore(run_url).get(TRACKING_KEY))
    parent = info["parent_run_id"]
    kids = client.search_runs([info["experiment_id"]],
                              filter_string=f"tags.`mlflow.parentRunId` = '{parent}'")
    assert [k.info.status for k in kids] == ["KILLED"]
    assert client.get_run(parent).info.status == "KILLED"

    train = MlflowHooks(run_url, role="train")
    train.run_started(cfg, run_url, resumed=True)  # same params again: accepted
    second = MlflowHooks(run_url, role="worker:region-a")
    second.worker_started("region-a", {"attempt": 2, "resumed_from": 20})
    for step in (30, 40):
        second.worker_metrics("region-a", {"worker": "region-a", "step": step, "loss": 0.5})
    second.worker_finished("region-a", {"steps": 40}, "finished")
    assert second.close(timeout=30) == {}
    assert train.close(timeout=30) == {}

    kids = client.search_runs([info["experiment_id"]],
                              filter_string=f"tags.`mlflow.parentRunId` = '{parent}'")
    assert len(kids) == 1
    child = kids[0]
    assert child.info.status == "FINISHED"
    assert child.data.tags["diloco.info.attempt"] == "2"
    assert child.data.tags["diloco.info.resumed_from"] == "20"
    assert [s for s, _ in history(client, child.info.run_id, "loss")] == [10, 20, 30, 40]
    runs = client.search_runs([info["experiment_id"]],
                              filter_string="tags.`diloco.role` = 'train'")
    assert [r.info.run_id for r in runs] == [parent]


def test_hook_calls_never_wait_for_mlflow(sqlite_tracking: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's metrics while MLflow holds every metric request (a server that
    stopped answering): thousands of hook calls still return, and once MLflow
    answers again nothing was lost."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    answer = threading.Event()  # MLflow answers metric requests once this is set
    holding = threading.Event()  # a metric request is waiting for an answer
    real_log_batch = SqlAlchemyStore.log_batch

    def held_log_batch(self, run_id, metrics, params, tags):  # noqa: ANN001, ANN202
        if metrics:
            holding.set()
            answer.wait()
        return real_log_batch(self, run_id, metrics, params, tags)

    monkeypatch.setattr(SqlAlchemyStore, "log_batch", held_log_batch)
    run_url = (tmp_path / "store" / "run-many").as_uri()
    train = MlflowHooks(run_url, role="train")
    train.run_started(tiny_config(), run_url, resumed=False)
    worker = MlflowHooks(run_url, role="worker:region-a", flush_every=0.2)

    def metrics(step: int) -> None:
        worker.worker_metrics("region-a", {"worker": "region-a", "step": step,
                                           "loss": 1.0 / step, "lr": 0.1, "tokens": step})

    metrics(1)
    # the bound is for a run that never reaches MLflow, not a speed target
    assert holding.wait(60), "the first metrics never reached MLflow"
    loop = threading.Thread(target=lambda: [metrics(s) for s in range(2, 3001)], daemon=True)
    loop.start()
    loop.join(120)
    assert not loop.is_alive(), "a hook call waited for MLflow"
    assert not answer.is_set()
    answer.set()
    # 12,000 metrics into SQLite take 20 to 40 s on two busy cores
    assert worker.close(timeout=120) == {}
    assert train.close(timeout=120) == {}
    client = MlflowClient(sqlite_tracking)
    child = client.search_runs(
        [client.get_experiment_by_name("diloco-test").experiment_id],
        filter_string="tags.`diloco.child` = 'worker:region-a'")[0]
    assert len(client.get_metric_history(child.info.run_id, "loss")) == 3000


def test_buffer_bound_drops_oldest_and_counts(sqlite_tracking: str, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """No train job ever writes tracking.json: the worker keeps max_buffer metrics,
    drops the oldest, and close() says how many were not logged, and why."""
    run_url = (tmp_path / "store" / "run-orphan").as_uri()
    hooks = MlflowHooks(run_url, role="worker:region-a", max_buffer=100)
    for step in range(1, 251):
        hooks.worker_metrics("region-a", {"worker": "region-a", "step": step, "loss": 1.0})
    with caplog.at_level(logging.WARNING, logger="tracking.mlflow_hooks"):
        t = time.perf_counter()
        lost = hooks.close(timeout=2)
    # bounded by its timeout, not the 30 s default nor forever (loose: a busy machine)
    assert time.perf_counter() - t < 10
    assert lost == {"metrics": 250}  # 150 dropped from the buffer, 100 never sent
    assert "not logged: 250 metrics" in caplog.text
    assert "tracking.json" in caplog.text



def test_the_thread_retries_a_failing_task_and_close_cuts_its_backoff_short(
        sqlite_tracking: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A task that fails (the server away) is retried, in order, until it gets
    through; the outage is logged once and its end too. While it keeps failing,
    close() does not wait out the backoff: one last try, then the task is counted
    as not logged, with the last error."""
    from tenacity import wait_fixed

    from tracking import mlflow_hooks

    monkeypatch.setattr(mlflow_hooks, "OUTAGE_WAIT", wait_fixed(0.01))
    hooks = MlflowHooks((tmp_path / "store" / "run-away").as_uri(), role="train",
                        flush_every=0.05)
    calls: list[float] = []
    done = threading.Event()

    def flaky() -> None:
        calls.append(time.monotonic())
        if len(calls) <= 3:
            raise ConnectionError("server away")
        done.set()

    with caplog.at_level(logging.INFO, logger="tracking.mlflow_hooks"):
        hooks._task(mlflow_hooks._Task("flaky", flaky, lost={"tags": 1}))
        assert done.wait(30)
        deadline = time.monotonic() + 30
        while "answers again" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(calls) == 4 and caplog.text.count("unreachable, buffering and retrying") == 1
    assert "answers again" in caplog.text

    monkeypatch.setattr(mlflow_hooks, "OUTAGE_WAIT", wait_fixed(600))  # close() cuts it short
    down: list[float] = []

    def away() -> None:
        down.append(time.monotonic())
        raise ConnectionError("still away")

    hooks._task(mlflow_hooks._Task("away", away, lost={"params": 2}))
    deadline = time.monotonic() + 30
    while not down and time.monotonic() < deadline:
        time.sleep(0.01)
    t = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tracking.mlflow_hooks"):
        assert hooks.close(timeout=60) == {"params": 2}
    assert time.monotonic() - t < 30 and len(down) == 2  # the first try, and one last
    assert "(last error: ConnectionError: still away)" in caplog.text
    hooks._thread.join(5)
    assert not hooks._thread.is_alive()


def test_while_closing_a_missing_tracking_json_is_polled_until_close_gives_up(
        sqlite_tracking: str, tmp_path: Path) -> None:
    """`NotReady` (no train job has written tracking.json) is not an outage: close()
    keeps polling for it, every 0.25 s, for as long as its timeout, then the thread
    ends."""
    from tracking import mlflow_hooks
    from tracking.runs import NotReady

    hooks = MlflowHooks((tmp_path / "store" / "run-early").as_uri(), role="train")
    polls: list[float] = []

    def early() -> None:
        polls.append(time.monotonic())
        raise NotReady("no tracking.json yet")

    hooks._task(mlflow_hooks._Task("early", early, lost={"tags": 3}))
    t = time.monotonic()
    assert hooks.close(timeout=1.0) == {"tags": 3}
    assert 1.0 <= time.monotonic() - t < 10
    closing = [p for p in polls if p >= t]
    assert len(closing) >= 2 and not hooks.sender.outage
    hooks._thread.join(5)
    assert not hooks._thread.is_alive()

# -- against a tracking server ---------------------------------------------------------

@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory, s3_env: dict[str, str],
                  s3_bucket: str, mlflow_db_template: Path) -> Iterator[MlflowServer]:
    """One `mlflow server` for this module (starting one takes 10-20 s here)."""
    workdir = tmp_path_factory.mktemp("mlflow-server")
    shutil.copy(mlflow_db_template, workdir / "mlflow.db")
    server = MlflowServer(workdir, s3_env, bucket=s3_bucket, prefix=f"mlflow-{workdir.name}")
    yield server
    server.stop()


@pytest.fixture
def server_tracking(mlflow_server: MlflowServer, tmp_path: Path,
                    monkeypatch: pytest.MonkeyPatch) -> MlflowServer:
    """The module's server, (re)started if a test stopped it, as the tracking URI."""
    if not mlflow_server.running:
        mlflow_server.start()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "diloco-test")
    monkeypatch.setenv("DILOCO_SYSTEM_METRICS", "off")
    monkeypatch.delenv("DILOCO_TRACKING", raising=False)
    monkeypatch.chdir(tmp_path)
    return mlflow_server


@pytest.mark.s3
@pytest.mark.s3_backends("moto")  # MLflow's own S3 client; one server per module (time)
def test_tiny_run_on_tracking_server(server_tracking: MlflowServer, s3_endpoint: tuple,
                                     s3_bucket: str, tmp_path: Path) -> None:
    """(2) The same run against `mlflow server` on loopback; the run's store and the
    server's artifacts are both on the loopback S3 server."""
    endpoint, options = s3_endpoint
    run_url = f"s3://{s3_bucket}/runs-{tmp_path.name}/run-server"
    run = fake_run(run_url, storage_options=options)
    assert all(c == {} for c in run["closes"].values()), run["closes"]
    client = MlflowClient(server_tracking.url)
    store = ObjectStore(run_url, storage_options=options)
    checked = check_tiny_run(client, run_url, store)
    assert checked["info"]["tracking_uri"] == server_tracking.url
    # the artifacts are objects in the bucket, under the server's destination
    bucket = ObjectStore(f"s3://{s3_bucket}/{server_tracking.prefix}", storage_options=options)
    keys = bucket.list()
    assert any(k.endswith("plots/eval_loss_vs_step.png") for k in keys), keys
    assert any(k.endswith("summary.json") for k in keys), keys


@pytest.mark.s3
@pytest.mark.s3_backends("moto")  # the module's MLflow server stores artifacts on S3 (time)
def test_server_stopped_mid_run_does_not_stop_training(
    server_tracking: MlflowServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """(3) The server dies after step 30: hook calls keep returning, the
    loop finishes, and each close() is bounded and counts what was not logged."""
    run_url = (tmp_path / "store" / "run-outage").as_uri()
    client = MlflowClient(server_tracking.url)

    def kill_server(step: int) -> None:
        if step != 30:
            return
        # let the children exist first, so the outage hits logging, not creation
        store = ObjectStore(run_url)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if store.exists(TRACKING_KEY):
                info = json.loads(store.get(TRACKING_KEY))
                kids = client.search_runs(
                    [info["experiment_id"]],
                    filter_string=f"tags.`mlflow.parentRunId` = '{info['parent_run_id']}'")
                if len(kids) == 3:
                    break
            time.sleep(0.2)
        else:
            pytest.fail("the child runs were not created within 30 s")
        server_tracking.stop()
        stopped_at.append(time.perf_counter())

    stopped_at: list[float] = []
    with caplog.at_level(logging.WARNING, logger="tracking.mlflow_hooks"):
        run = fake_run(run_url, between=kill_server, close_timeout=5)
    after = time.perf_counter() - stopped_at[0]
    # 4 closes of at most 5 s each, plus the loop itself
    assert after < 4 * 5 + 5, after
    closes = run["closes"]
    # At least what came after the server died (more if the last flush before it
    # had not happened yet). A worker: steps 40, 50, 60 with 9 metrics each, eval
    # at 40 and 60, and 8 numbers of its result: 27 + 2 + 8 = 37. The aggregator:
    # merge points 4, 5, 6, each 4 + 2 weights + inner_step + bytes up and down,
    # plus eval loss and perplexity at 4 and 6: 3 * 9 + 2 * 2 = 31.
    for w in WORKERS:
        assert closes[w].get("metrics", 0) >= 37, closes
    assert closes["aggregator"].get("metrics", 0) >= 31, closes
    # summary.json, config.yaml and the plots
    assert closes["train"].get("artifacts") == 2 + len(RUN_PLOTS), closes
    assert "not logged" in caplog.text
    assert "unreachable" in caplog.text


def test_system_metrics_monitor_optional(sqlite_tracking: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With psutil the child run gets system/* metrics (MLflow's SystemMetricsMonitor
    on a client-created run); without psutil this is skipped and tracking goes on."""
    pytest.importorskip("psutil")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    run_url = (tmp_path / "store" / "run-sys").as_uri()
    train = MlflowHooks(run_url, role="train", system_metrics=True)
    train.run_started(tiny_config(), run_url, resumed=False)
    worker = MlflowHooks(run_url, role="worker:region-a", system_metrics=True)
    worker.worker_metrics("region-a", {"worker": "region-a", "step": 1, "loss": 1.0})
    client = MlflowClient(sqlite_tracking)
    keys: set[str] = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(k.startswith("system/") for k in keys):
        time.sleep(0.5)
        exp = client.get_experiment_by_name("diloco-test")
        runs = client.search_runs([exp.experiment_id] if exp else [],
                                  filter_string="tags.`diloco.child` = 'worker:region-a'")
        keys = set(runs[0].data.metrics) if runs else set()
    worker.close(timeout=10)
    train.close(timeout=10)
    assert any(k.startswith("system/cpu") for k in keys), keys


def test_thread_ends_after_close(sqlite_tracking: str, tmp_path: Path) -> None:
    run_url = (tmp_path / "store" / "run-threads").as_uri()
    hooks = MlflowHooks(run_url, role="train")
    hooks.run_started(tiny_config(), run_url, resumed=False)
    assert hooks.close(timeout=30) == {}
    hooks._thread.join(1)
    assert not hooks._thread.is_alive()
    assert hooks.close() == {}  # twice is harmless


# A process whose hooks' thread is still in native code when close() stops waiting
# (the train job's plots and model export under load): its exit waits for that work,
# then ends with status 0. Before, the interpreter finalized under the thread, which
# aborted the process ("terminate called without an active exception", SIGABRT)
# every time in this script, after the process had done all its work.
EXIT_SCRIPT = """
import sys, threading, time
from pathlib import Path
import torch
from tracking import mlflow_hooks
from tracking.exit_threads import record_threads_at_exit
record_threads_at_exit()
torch.set_num_threads(1)
hooks = mlflow_hooks.MlflowHooks(sys.argv[2], role="train")
started = threading.Event()
def native():  # torch ops release the GIL and take it back, as matplotlib's do
    started.set()
    a, t = torch.randn(256, 256), time.monotonic()
    while time.monotonic() - t < 2:
        a = torch.tanh(a @ a)
    Path(sys.argv[1], "done").write_text("the task ended")
hooks._task(mlflow_hooks._Task("native work", native, lost={"artifacts": 1}))
def never():
    Path(sys.argv[1], "next").write_text("a task after close() gave up")
hooks._task(mlflow_hooks._Task("next", never, lost={"tags": 1}))
assert started.wait(60)
print(hooks.close(timeout=0.2), flush=True)
"""


def test_a_thread_close_gave_up_on_ends_before_the_interpreter(sqlite_tracking: str,
                                                               tmp_path: Path) -> None:
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    root = Path(__file__).resolve().parent.parent
    record = tmp_path / "threads"
    env = {**os.environ, "PYTHONPATH": str(root), "DILOCO_THREADS_AT_EXIT": str(record)}
    ran = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path),
                          (tmp_path / "store" / "run-exit").as_uri()],
                         env=env, cwd=tmp_path, text=True, capture_output=True, timeout=120)
    assert ran.returncode == 0, (ran.returncode, ran.stdout + ran.stderr[-3000:])
    assert "terminate called" not in ran.stderr
    # close() kept its bound and counted what it gave up on ...
    assert ran.stdout.strip().splitlines()[-1] == "{'artifacts': 1, 'tags': 1}"
    # ... the task under way ended before the interpreter, the next one never began
    assert (tmp_path / "done").exists() and not (tmp_path / "next").exists()
    (written,) = record.glob("*.json")
    left = json.loads(written.read_text())["threads"]
    assert not [t for t in left if t["name"].startswith("mlflow-")], left


@pytest.mark.slow
def test_micro_training_run_through_the_train_job(sqlite_tracking: str, tmp_path: Path) -> None:
    """End to end: `flows.train.run_train` launches the aggregator and two workers
    as processes (they inherit MLFLOW_TRACKING_URI) and a real 20-step run lands in
    MLflow: parent, three children, histories, plots. About 50 s on two cores."""
    from flows.launchers import LocalLauncher
    from flows.train import run_train

    cfg = load_config("tiny", [
        "train.steps=20", "train.eval_every=10", "train.log_every=5",
        "train.checkpoint_every=0", "sync.schedule.sync_every=10", "sync.schedule.fragments=2",
        "sync.schedule.overlap=0", "data.batch_size=4", "data.seq_len=32",
    ])
    run_url = str(tmp_path / "store" / "micro")
    report = run_train(cfg, run_url, launcher=LocalLauncher(), poll_s=0.5)
    assert report["state"] == "finished"

    client = MlflowClient(sqlite_tracking)
    info = json.loads(ObjectStore(run_url).get(TRACKING_KEY))
    parent = client.get_run(info["parent_run_id"])
    assert parent.info.run_name == "micro" and parent.info.status == "FINISHED"
    assert parent.data.params["train.steps"] == "20"
    # the prepared data as the run's input: named by its sources, its digest the
    # fingerprint of its tokens, its source the data's URL
    from workers.data.streams import open_dataset

    (given,) = parent.inputs.dataset_inputs
    assert given.dataset.name == "builtin:shakespeare"
    assert given.dataset.digest == open_dataset(f"{run_url}/data").fingerprint
    assert f"{run_url}/data" in given.dataset.source
    assert json.loads(given.dataset.profile)["train_tokens"] > 0
    assert {t.key: t.value for t in given.tags} == {"mlflow.data.context": "training"}
    kids = {k.info.run_name: k for k in client.search_runs(
        [info["experiment_id"]],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")}
    assert sorted(kids) == ["aggregator", "region-a", "region-b"]
    assert all(k.info.status == "FINISHED" for k in kids.values())
    for w in ("region-a", "region-b"):
        rid = kids[w].info.run_id
        assert [s for s, _ in history(client, rid, "loss")] == [5, 10, 15, 20]
        assert history(client, rid, "eval_loss")[-1][0] == 20
        assert history(client, rid, "bytes_up")[-1][1] > 0
    agg = kids["aggregator"].info.run_id
    # H = 10, P = 2, 20 steps: rounds 0 and 1 of each fragment at merge points 1..4,
    # and a final round of each (merge alpha 0.5 > 0) at 5 and 6; logged at their inner
    # steps 5 (k + 1), the final rounds at the last step (20)
    assert [s for s, _ in history(client, agg, "grad_norm/frag0")] == [5, 15, 20]
    assert [s for s, _ in history(client, agg, "grad_norm/frag1")] == [10, 20, 20]
    assert [v for _, v in history(client, agg, "round")] == [0, 0, 1, 1, 2, 2]
    assert history(client, agg, "eval_loss")
    plots = {Path(f.path).name for f in client.list_artifacts(parent.info.run_id, "plots")}
    assert plots == set(RUN_PLOTS)
    # the finished run's canonical model, as transformers loads it
    model = {Path(f.path).name for f in client.list_artifacts(parent.info.run_id, "model")}
    assert {"config.json", "model.safetensors"} <= model, model
    assert "round 3/3" in client.get_run(parent.info.run_id).data.tags["diloco.model"]
    final = client.get_run(parent.info.run_id).data.metrics
    assert final["final_eval_loss"] == pytest.approx(report["global"]["eval_loss"])


def test_a_stall_shows_on_the_aggregators_run(sqlite_tracking: str, tmp_path: Path) -> None:
    """A stalled aggregator is visible in MLflow while the run waits: the tag names
    who is missing, the metric says for how long; both clear when rounds resume."""
    run_url = (tmp_path / "store" / "run-stall").as_uri()
    train = MlflowHooks(run_url, role="train")
    train.run_started(tiny_config(), run_url, resumed=False)
    deadline = time.monotonic() + 60
    while not ObjectStore(run_url).exists(TRACKING_KEY) and time.monotonic() < deadline:
        time.sleep(0.1)
    agg = MlflowHooks(run_url, role="aggregator")
    text = "fragment 0 round 3 waits for region-b since 10:00:00 UTC (75 s)"
    agg.aggregator_stalled([{"fragment": 0, "round": 3, "missing": ["region-b"],
                             "since": "2026-11-24T10:00:00+00:00", "waited_s": 75.0,
                             "text": text}])
    assert agg.close(timeout=30) == {}
    assert train.close(timeout=30) == {}
    client = MlflowClient(sqlite_tracking)
    info = json.loads(ObjectStore(run_url).get(TRACKING_KEY))
    (child,) = client.search_runs([info["experiment_id"]],
                                  filter_string="tags.`diloco.role` = 'aggregator'")
    assert child.data.tags["diloco.stalled"] == text
    assert [v for _, v in history(client, child.info.run_id, "stalled_s")] == [75.0]


def test_curves_read_old_and_new_aggregator_steps(sqlite_tracking: str) -> None:
    """Runs logged before the one step axis have the aggregator's eval at merge
    point k with ``inner_step`` mapping k to the inner step; new runs log at the inner
    step. Both read back on the workers' axis."""
    from mlflow.entities import Metric

    from tracking.curves import load_run_curves

    client = MlflowClient(sqlite_tracking)
    exp = client.create_experiment("old-and-new")
    for style in ("old", "new"):
        parent = client.create_run(exp, run_name=style, tags={"diloco.role": "train"})
        agg = client.create_run(exp, run_name="aggregator", tags={
            "mlflow.parentRunId": parent.info.run_id, "diloco.role": "aggregator"})
        metrics = []
        for k, loss in ((1, 4.5), (3, 4.0), (5, 3.5)):
            step = k if style == "old" else 10 * (k + 1)
            metrics += [Metric("eval_loss", loss, 1000 + k, step),
                        Metric("inner_step", 10.0 * (k + 1), 1000 + k, step)]
        client.log_batch(agg.info.run_id, metrics=metrics, synchronous=True)
        ev = load_run_curves(client, client.get_run(parent.info.run_id)).canonical_eval()
        assert ev.steps.tolist() == [20, 40, 60], style
        assert ev.values.tolist() == [4.5, 4.0, 3.5], style


def test_artifacts_survive_moving_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               mlflow_db_template: Path) -> None:
    """The embedded store's artifact location is relative (``mlartifacts``): a run
    tracked in one directory, moved elsewhere, is opened from the new place by the
    client and by ``mlflow ui``, artifacts included."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import urllib.request

    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copy(mlflow_db_template, checkout / "mlflow.db")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the embedded default
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "diloco-test")
    monkeypatch.setenv("DILOCO_SYSTEM_METRICS", "off")
    monkeypatch.delenv("DILOCO_TRACKING", raising=False)
    monkeypatch.chdir(checkout)
    run = fake_run((tmp_path / "store" / "run-moved").as_uri(), steps=20)
    assert all(c == {} for c in run["closes"].values()), run["closes"]
    client = MlflowClient(f"sqlite:///{checkout / 'mlflow.db'}")
    exp = client.get_experiment_by_name("diloco-test")
    assert exp.artifact_location == "mlartifacts"
    (parent,) = client.search_runs([exp.experiment_id], "tags.`diloco.role` = 'train'")
    assert parent.info.artifact_uri == f"mlartifacts/{parent.info.run_id}/artifacts"

    moved = tmp_path / "elsewhere" / "moved-checkout"
    moved.parent.mkdir()
    checkout.rename(moved)
    monkeypatch.chdir(moved)
    client = MlflowClient("sqlite:///mlflow.db")
    got = client.download_artifacts(parent.info.run_id, "summary.json", str(tmp_path))
    assert json.loads(Path(got).read_text())["steps"] == 20

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # one worker and no job runner (as tests/mlflow_server.py): they serve no artifact,
    # and start five more processes (about 17 s of CPU)
    ui = subprocess.Popen(  # noqa: S603 - mlflow ui from the moved directory, as the hint says
        [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", "sqlite:///mlflow.db",
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1"], cwd=moved,
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        url = (f"http://127.0.0.1:{port}/get-artifact?path=summary.json"
               f"&run_uuid={parent.info.run_id}")
        deadline, body = time.monotonic() + 90, None
        while body is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=5) as answer:
                    body = answer.read()
            except OSError:
                time.sleep(0.5)
        assert body is not None and json.loads(body)["steps"] == 20
    finally:
        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(30)


def test_an_old_absolute_artifact_location_is_made_relative(
        sqlite_tracking: str, tmp_path: Path) -> None:
    """An embedded store made before (experiment at ``file:///<old dir>/mlartifacts``,
    its runs under it), in a checkout that has moved since: the next run made from
    here turns the experiment and its runs relative, and the old run's artifacts open."""
    from tracking.runs import make_relative

    client = MlflowClient(sqlite_tracking)
    old = "file:///somewhere/it/was/mlartifacts"
    exp = client.create_experiment("diloco-test", artifact_location=old)
    run = client.create_run(exp, run_name="old")
    assert run.info.artifact_uri == f"{old}/{run.info.run_id}/artifacts"
    kept = (tmp_path / "mlartifacts" / run.info.run_id / "artifacts")
    kept.mkdir(parents=True)
    (kept / "summary.json").write_text('{"steps": 7}')
    other = client.create_experiment("elsewhere", artifact_location="file:///data/artifacts")

    run_url = (tmp_path / "store" / "run-new").as_uri()
    fake_run(run_url, steps=20)
    assert client.get_experiment(exp).artifact_location == "mlartifacts"
    assert client.get_run(run.info.run_id).info.artifact_uri == (
        f"mlartifacts/{run.info.run_id}/artifacts")
    got = client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path))
    assert json.loads(Path(got).read_text()) == {"steps": 7}
    # only what this store put beside itself: another location is left alone
    assert make_relative(sqlite_tracking, other, "file:///data/artifacts") == 0
    assert client.get_experiment(other).artifact_location == "file:///data/artifacts"
