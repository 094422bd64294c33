"""The train job without Prefect: `run_train` with the local launcher, real worker
and aggregator processes on a local store. Cancelling mid-run leaves no process
and a consistent store, and `resume` continues the run; a failed job is named and
relaunched; a continuation starts from the old run's canonical model. The micro
model of the worker tests keeps each run to a few tens of seconds."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from cli_runs import alive

from diloco.run import latest_global, load_canonical, load_initial, open_run, plan_for
from flows.control import CANCEL_KEY, cancel_request, read_launcher, request_cancel
from flows.launchers import LocalLauncher
from flows.train import JobFailed, run_train
from storage.checkpoints import read_checkpoint
from storage.errors import RunNotFound
from tracking.hooks import Hooks
from workers import checkpoint
from workers.config import load_config
from workers.data.prepare import prepare_data
from workers.locate import new_run_url, resolve_run
from workers.model import build_model
from workers.report import build_report, participation
from workers.runs import continuation, create_run, latest_run
from workers.status import read_all


def blocked_in(thread: threading.Thread, function: str, filename: str) -> bool:
    """True if ``thread`` is inside ``function`` of a file ending in ``filename``."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_code.co_filename.endswith(filename):
            return True
        frame = frame.f_back
    return False


MICRO = [
    "model.overrides={d_model: 64, n_layers: 2, n_heads: 2, max_seq_len: 64}",
    "data.seq_len=32", "data.batch_size=8", "optim.warmup_steps=5", "optim.lr=0.01",
    "train.eval_every=0", "train.eval_batches=2", "train.log_every=1", "train.threads=1",
    "sync.schedule.sync_every=8", "sync.schedule.fragments=2", "sync.schedule.overlap=1",
]


@pytest.fixture(autouse=True)
def no_tracking(monkeypatch):
    """MLflow is tested in test_tracking.py; here it would only cost time."""
    monkeypatch.setenv("DILOCO_TRACKING", "off")


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("data") / "shakespeare")
    prepare_data(["builtin:shakespeare/tragedies/*"], url, max_bytes=200_000)
    return url


def micro(data_url: str, store: Path, *extra: str):
    return load_config("tiny", [*MICRO, f"data.dataset={data_url}", f"store={store}", *extra])


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def steps(url: str) -> dict[str, int]:
    ex = open_run(url)
    return {w: (s or {}).get("step", 0) for w, s in read_all(ex.store, ex.manifest.workers).items()}


class Background:
    """run_train in a thread; its result or exception afterwards."""

    def __init__(self, **kwargs):
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, kwargs=kwargs, daemon=True)
        self.thread.start()

    def _run(self, **kwargs):
        try:
            self.result = run_train(**kwargs)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the test
            self.error = exc

    def join(self, timeout: float):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "run_train did not return"
        if self.error is not None:
            raise self.error
        return self.result


def test_cancel_mid_run_then_resume(data_url, tmp_path):
    """Kill -9 the aggregator (it is relaunched and resumes from the store), cancel
    through the store mid-run: every process ends, the checkpoints are committed and
    readable, and resume finishes the run from them."""
    cfg = micro(data_url, tmp_path, "train.steps=90", "train.checkpoint_every=10")
    url = str(tmp_path / f"{cfg.name}-20260101-120000")
    launcher = LocalLauncher()
    bg = Background(config=cfg, run_url=url, launcher=launcher, poll_s=0.3, stop_grace_s=45)

    wait_for(lambda: "aggregator" in launcher.procs and min(steps(url).values()) >= 15, 90,
             "step 15")
    first = launcher.procs["aggregator"]
    first.kill()  # SIGKILL: no checkpoint, no goodbye
    wait_for(lambda: launcher.procs["aggregator"] is not first, 30, "the aggregator relaunched")
    # a write the kill cut short leaves its temp file (invisible to readers): only
    # the cancel must leave none
    killed_mid_write = set(tmp_path.rglob("*~tmp~*"))
    wait_for(lambda: min(steps(url).values()) >= 30, 90, "step 30")
    store = open_run(url).store
    request_cancel(store, reason="test")
    report = bg.join(120)

    assert report["state"] == "cancelled"
    assert "cancelled by" in report["message"]
    record = read_launcher(store)
    assert record["backend"] == "local"
    pids = [job["pid"] for job in record["jobs"].values()] + [first.pid]
    assert not [p for p in pids if alive(p)], "a job process survived the cancel"
    statuses = read_all(store, ["region-a", "region-b", "aggregator"])
    assert {s["state"] for s in statuses.values()} <= {"cancelled", "interrupted"}, statuses
    stopped_at = {w: statuses[w]["step"] for w in ("region-a", "region-b")}
    assert all(30 <= s < 90 for s in stopped_at.values()), stopped_at

    # Consistent: each worker's newest checkpoint loads (checksums verified) at the
    # step it stopped at, and every committed canonical checkpoint reads back.
    ex = open_run(url)
    for w, step in stopped_at.items():
        saved_step, state = checkpoint.load(ex.store, w)
        # a worker stopped between steps saves there; one stopped while blocked on a
        # mean saves nothing and resumes from its last periodic checkpoint: either
        # way its status says where it resumes, and that checkpoint is there
        resumes_from = statuses[w]["resumes_from"]
        assert resumes_from == step or (resumes_from < step and resumes_from % 10 == 0)
        assert saved_step == resumes_from
        # a worker that fell behind (this machine is loaded) healed to the canonical
        # state and skipped the steps in between: its tokens are the steps it trained
        if state["sync"].get("rebases"):
            assert state["tokens"] < saved_step * 8 * 32
        else:
            assert state["tokens"] == saved_step * 8 * 32
    for p in range(len(ex.manifest.fragments)):
        r, key = latest_global(ex, p)
        assert r >= 1
        read_checkpoint(ex.store, key)
    left = set(tmp_path.rglob("*~tmp~*")) - killed_mid_write
    assert not left, f"a half-written object was left behind: {sorted(left)}"

    report = run_train(None, url, launcher=LocalLauncher(), resume=True, poll_s=0.3)
    assert report["state"] == "finished"
    assert cancel_request(ex.store) is None
    assert ex.store.list("control/cancelled"), "the withdrawn request is kept"
    statuses = read_all(ex.store, ["region-a", "region-b", "aggregator"])
    assert all(s["state"] == "finished" for s in statuses.values()), statuses
    assert statuses["region-a"]["step"] == 90
    g = report["global"]
    assert g["rounds"] == g["total_rounds"] == sum(ex.manifest.rounds)
    # counted across the aggregator's restart; one round reduced without a worker that
    # was stopping for the cancel (the gate's grace ran out) may miss its contribution
    assert g["expected"] - 1 <= g["on_time"] <= g["expected"], g
    # a kill between a round's checkpoint and the status write loses one count
    assert all(g["total_rounds"] - 1 <= n <= g["total_rounds"]
               for n in g["rounds_by_worker"].values()), g
    # the canonical model improved on its initial parameters
    assert statuses["aggregator"]["eval_loss"] < statuses["aggregator"]["initial_eval_loss"] - 1

    # A continuation (what the nightly schedule does) starts from the canonical model.
    assert latest_run(str(tmp_path), cfg.name) == url  # what resume_run="latest" picks
    child_cfg = continuation(url, ["optim.warmup_steps=0"], extra_steps=8)
    assert child_cfg.parent_run == url and child_cfg.train.steps == 8
    assert child_cfg.train.seed == cfg.train.seed + 1
    assert child_cfg.data.dataset == data_url
    child = create_run(child_cfg, str(tmp_path / "c2"), init_from=url)
    model = build_model(cfg.model_config_resolved, seed=123)
    load_canonical(ex, plan_for(model, cfg.sync), model)
    plan = plan_for(model, cfg.sync)
    for p, init in enumerate(load_initial(child, len(plan))):
        assert torch.equal(init, plan.gather(model, p))


def test_a_failed_job_is_relaunched_then_named(data_url, tmp_path):
    """A job that keeps failing is relaunched once, then the run fails with its name
    and the end of its output; the other jobs are stopped."""

    class Flaky(LocalLauncher):
        def command(self, run_url, name):
            if name == "region-b":
                return [sys.executable, "-c", "import sys; print('boom: no GPU here'); "
                        "sys.exit(3)"]
            return super().command(run_url, name)

    cfg = micro(data_url, tmp_path, "train.steps=400")
    url = str(tmp_path / "f1")
    launcher = Flaky()
    with pytest.raises(JobFailed) as failed:
        run_train(cfg, url, launcher=launcher, poll_s=0.3, stop_grace_s=30, restarts=1)
    message = str(failed.value)
    assert "region-b failed" in message
    assert "boom: no GPU here" in message and "region-b.log" in message
    assert f"diloco resume {url}" in message
    assert (tmp_path / "f1" / "logs" / "region-b.log").read_text().count("boom") == 2
    assert all(p.poll() is not None for p in launcher.procs.values())
    assert failed.value.report["state"] == "failed"


def test_a_worker_blocked_on_a_mean_still_stops(data_url, tmp_path, monkeypatch):
    """region-a alone: its first merge waits for region-b's contribution, which
    never comes. Asked to stop, it gives up after its patience, without a new
    checkpoint, and says so; it resumes from its last periodic one."""
    import flows.worker_job as worker_job  # noqa: PLC0415

    monkeypatch.setattr(worker_job, "BLOCKED_PATIENCE_S", 2.0)
    cfg = micro(data_url, tmp_path, "train.steps=40", "train.checkpoint_every=2")
    url = str(tmp_path / "b1")
    create_run(cfg, url)
    stop = threading.Event()
    out = {}
    job = threading.Thread(target=lambda: out.update(
        worker_job.run_worker_job(url, "region-a", stop=stop, hooks=LossyHooks())),
        daemon=True)
    job.start()
    store = open_run(url).store
    try:
        wait_for(lambda: blocked_in(job, "wait_mean", os.path.join("diloco", "inflight.py")), 60,
                 "region-a waiting for its first mean")
    finally:
        stop.set()
        job.join(30)
    assert not job.is_alive()
    assert out["state"] == "interrupted"
    saved = checkpoint.latest_step(store, "region-a")
    assert saved and out["steps"] == saved  # the checkpoint before the merge it waited for
    status = read_all(store, ["region-a"])["region-a"]
    assert status["state"] == "interrupted"
    assert f"resumes from step {saved}" in status["note"]
    # what its tracking could not log is in its result and its status, for the report
    assert out["not_logged"] == status["not_logged"] == {"metrics": 37}


class LossyHooks(Hooks):
    """Tracking hooks whose server was unreachable: close() reports losses."""

    def __init__(self, lost: dict[str, int] | None = None):
        self.lost = lost or {"metrics": 37}

    def close(self) -> dict[str, int]:
        return dict(self.lost)


def test_the_report_says_what_tracking_did_not_log(data_url, tmp_path):
    """Each job's not-logged counts (from its status, wherever it ran) reach the
    train job's report and the figures `diloco run` prints, naming the job."""
    from rich.console import Console  # noqa: PLC0415

    from cli.figures import print_report  # noqa: PLC0415
    from flows.jobs import record_not_logged  # noqa: PLC0415

    cfg = micro(data_url, tmp_path)
    url = str(tmp_path / "nl")
    exchange = create_run(cfg, url)
    report = build_report(exchange, run_url=url, state="finished", wall_seconds=1.0)
    assert report["not_logged"] == {}
    record_not_logged(exchange.store, "region-b", {"metrics": 120, "tags": 2})
    record_not_logged(exchange.store, "aggregator", {})  # nothing lost: nothing written
    record_not_logged(exchange.store, "train", {"artifacts": 7})
    report = build_report(exchange, run_url=url, state="finished", wall_seconds=1.0)
    assert report["not_logged"] == {"region-b": {"metrics": 120, "tags": 2},
                                    "train": {"artifacts": 7}}
    console = Console(record=True, width=200)
    print_report(console, report)
    text = console.export_text()
    assert "not logged: region-b: 120 metrics, 2 tags; train: 7 artifacts" in text


def test_run_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("tiny", ["name=exp"])
    first = new_run_url(cfg)
    assert first.startswith(str(tmp_path / "runs" / "exp-"))
    Path(first).mkdir(parents=True)
    assert new_run_url(cfg).startswith(first)  # the same second: -2
    (tmp_path / "runs" / "r1").mkdir()
    (tmp_path / "runs" / "r1" / "run.json").write_text("{}")
    assert resolve_run("r1") == str(tmp_path / "runs" / "r1")
    assert resolve_run("s3://bucket/runs/r1") == "s3://bucket/runs/r1"
    with pytest.raises(RunNotFound, match="runs under runs/: r1"):
        resolve_run("r2")


def test_report_of_a_run_that_has_not_started(data_url, tmp_path):
    cfg = micro(data_url, tmp_path, "train.steps=16")
    ex = create_run(cfg, str(tmp_path / "n1"))
    report = build_report(ex, run_url=str(tmp_path / "n1"), state="failed", wall_seconds=1.0)
    assert [w["state"] for w in report["workers"]] == ["not started", "not started"]
    assert report["global"]["rounds"] == 0
    assert participation({}, ["region-a", "region-b"])["committed_rounds"] == 0
    json.dumps(report)  # the flow's result and the MLflow summary are JSON
    assert not ex.store.exists(CANCEL_KEY)


def test_participation_counts_only_on_time_contributions():
    """12 contributions expected: 10 were in their own round's mean, 1 was folded into
    a later mean, 1 never came. Participation is 10 / 12 (83%), not the 100% that
    counting the late one as taking part gave, and the line says what became of the
    rest."""
    from workers.report import participation_text  # noqa: PLC0415

    status = {"counted_rounds": 6, "expected_total": 12, "participants_total": 12,
              "on_time_total": 10, "late_total": 1, "dropped_total": 0, "absent_total": 1,
              "rounds_by_worker": {"region-a": 6, "region-b": 6}}
    g = participation(status, ["region-a", "region-b"])
    assert g["participation"] == pytest.approx(10 / 12)
    assert (g["on_time"], g["expected"], g["late"], g["dropped"], g["absent"]) == (10, 12, 1, 0, 1)
    text = participation_text(g)
    assert text == "participation 83% on time (10 of 12; 1 late, 0 dropped, 1 absent)"
    full = participation({**status, "on_time_total": 12, "late_total": 0, "absent_total": 0},
                         ["region-a", "region-b"])
    assert participation_text(full) == "participation 100%"


def test_worker_islands_of_two_processes_under_torchrun(data_url, tmp_path):
    """`--nproc 2`: each worker job runs its island under torchrun (two processes
    averaging gradients, rank 0 exchanging with the store). The run finishes, each
    worker registered as an island of 2, the aggregator applied every round, and the
    canonical model is the one both workers hold at the end."""
    cfg = micro(data_url, tmp_path, "train.steps=16")
    url = str(tmp_path / "isl")
    report = run_train(cfg, url, launcher=LocalLauncher(nproc=2), poll_s=0.3)
    assert report["state"] == "finished", report
    ex = open_run(url)
    for w in ("region-a", "region-b"):
        member = json.loads(ex.store.get(f"members/{w}.json"))
        assert member["island"] == 2, member
    assert [w["steps"] for w in report["workers"]] == [16, 16]
    g = report["global"]
    assert g["rounds"] == g["total_rounds"] == sum(ex.manifest.rounds) > 0
    assert g["participation"] == 1.0
    # the workers' final eval is of the canonical model (streaming ends merged)
    finals = {w["eval_loss"] for w in report["workers"]}
    assert len(finals) == 1 and g["eval_loss"] == pytest.approx(finals.pop(), rel=1e-5)
