"""The training worker on the shipped Shakespeare corpus: the loss falls, a stopped
or crashed worker resumes exactly, bad input fails fast with a clear message.
Workers and the aggregator run as threads on a memory:// store; a micro model keeps
the whole file to a few tens of seconds."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from diloco.aggregator import Aggregator
from diloco.run import open_run
from storage.objectstore import ObjectStore
from workers.config import load_config
from workers.data.prepare import prepare_data
from workers.loop import Interrupted, WorkerLoop, lr_at
from workers.runs import create_run
from workers.status import read_status

ROOT = Path(__file__).resolve().parent.parent

MICRO = [
    "model.overrides={d_model: 64, n_layers: 2, n_heads: 2, max_seq_len: 64}",
    "data.seq_len=32",
    "data.batch_size=8",
    "optim.warmup_steps=5",
    "optim.lr=0.01",
    "train.eval_every=0",
    "train.eval_batches=2",
    "train.log_every=1",
    "train.threads=1",
    "sync.schedule.sync_every=8",
    "sync.schedule.fragments=2",
    "sync.schedule.overlap=1",
]

_DATASET = f"memory://datasets/shakespeare-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def dataset() -> str:
    """A 300 kB slice of the installed Shakespeare corpus, prepared once."""
    prepare_data(["builtin:shakespeare"], _DATASET, max_bytes=300_000)
    return _DATASET


def config(dataset: str, *extra: str):
    return load_config("tiny", [*MICRO, f"data.dataset={dataset}", *extra])


class Run:
    """A run with its aggregator in a thread and workers trained in threads."""

    def __init__(self, cfg, url: str | None = None):
        self.url = url or f"memory://workers/{uuid.uuid4().hex}"
        self.cfg = cfg
        create_run(cfg, self.url)
        self.stop = threading.Event()
        self.aggregator = Aggregator(open_run(self.url))
        self.agg_thread = threading.Thread(target=self.aggregator.run, args=(self.stop, 120))
        self.agg_thread.start()
        self.losses: dict[str, dict[int, float]] = {w: {} for w in cfg.workers}

    def metrics(self, m):
        if "loss" in m:
            self.losses[m["worker"]][m["step"]] = m["loss"]

    def train(self, interrupt: dict[str, int] | None = None, crash: dict[str, int] | None = None):
        """Train every worker to the end. ``interrupt``: stop (SIGTERM) after that
        step and resume; ``crash``: die after that step without saving, and resume
        from the last periodic checkpoint."""
        results, errors = {}, []

        def work(worker):
            try:
                for attempt in range(3):
                    stop = threading.Event()

                    def metrics(m, stop=stop, attempt=attempt):
                        self.metrics(m)
                        if attempt == 0 and "loss" in m:
                            if (interrupt or {}).get(worker) == m["step"]:
                                stop.set()
                            if (crash or {}).get(worker) == m["step"]:
                                raise KeyboardInterrupt  # the process dies here

                    loop = WorkerLoop.open(self.url, worker, metrics=metrics, stop=stop)
                    try:
                        results[worker] = loop.run()
                        return
                    except (Interrupted, KeyboardInterrupt):
                        continue
                    finally:
                        loop.close()
            except Exception as exc:  # pragma: no cover - surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(w,)) for w in self.cfg.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        self.agg_thread.join(120)
        self.stop.set()
        if errors:
            raise errors[0]
        return results


def test_loss_falls_on_shakespeare(dataset):
    run = Run(config(dataset, "train.steps=40", "train.eval_every=20"))
    results = run.train()
    for worker, res in results.items():
        losses = [run.losses[worker][s] for s in sorted(run.losses[worker])]
        # bytes start near ln(256) = 5.55 nats; a model that learned the character
        # frequencies is below 3.5
        assert losses[0] > 5.0
        assert sum(losses[-5:]) / 5 < 3.5, losses
        assert res.eval_loss is not None and res.eval_loss < 3.6
        assert res.steps == 40 and res.tokens == 40 * 8 * 32
        assert res.bytes_up > 0 and res.bytes_down > 0
    assert run.aggregator.done


def test_resume_is_exact(dataset):
    """A worker stopped by SIGTERM resumes from the checkpoint it saved; one that
    crashed resumes from its last periodic checkpoint and replays. Both give the
    losses of an uninterrupted run (CPU, same seed) to 1e-6."""
    cfg = config(dataset, "train.steps=30", "train.checkpoint_every=10", "sync.membership.quorum=1.0")
    plain = Run(cfg)
    plain_results = plain.train()
    broken = Run(cfg)
    results = broken.train(interrupt={"region-a": 13}, crash={"region-b": 17})
    assert results["region-a"].resumed_from == 13
    assert results["region-b"].resumed_from == 10  # the periodic checkpoint before 17
    for w in cfg.workers:
        a = [plain.losses[w][s] for s in range(1, 31)]
        b = [broken.losses[w][s] for s in range(1, 31)]
        assert b == pytest.approx(a, rel=1e-6, abs=1e-6)
        # the exchange bytes a worker reports cover all its lives: a resumed worker
        # moved at least what an uninterrupted one did (it redoes some rounds)
        status = read_status(ObjectStore(broken.url), w)
        assert status["bytes_up"] == results[w].bytes_up >= plain_results[w].bytes_up
        assert status["bytes_down"] == results[w].bytes_down >= plain_results[w].bytes_down


def test_lr_schedule():
    cfg = load_config("tiny", ["optim.lr=1.0", "optim.warmup_steps=10", "train.steps=110",
                               "optim.min_lr_ratio=0.1"])
    # linear warmup: step 5 of 10 -> 0.5; end of warmup -> 1.0
    assert lr_at(5, cfg) == pytest.approx(0.5)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    # cosine from 1.0 to 0.1 over 100 steps: halfway 0.1 + 0.9 * 0.5 = 0.55; end 0.1
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(110, cfg) == pytest.approx(0.1)


# -- bad input fails fast, with the thing named --------------------------------------
def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workers", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout)


@pytest.fixture
def main_here(capsys):
    """``python -m workers ARGS`` run by its ``main`` in this process (the same parsing,
    checks, messages and exit status, without a torch start-up of its own):
    ``main_here(*args) -> (status, stderr)``. The signal handlers and root logger that
    ``main`` sets for its process are put back afterwards."""
    import logging  # noqa: PLC0415
    import signal  # noqa: PLC0415

    from workers.__main__ import main  # noqa: PLC0415

    def run(*args: str) -> tuple[int, str]:
        capsys.readouterr()
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        signals = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = main(list(args))
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)
            for sig, handler in signals.items():
                signal.signal(sig, handler)
        return code, capsys.readouterr().err

    return run


def test_cli_help_describes_everything():
    out = cli("--help")
    assert out.returncode == 0
    for flag in ("--run", "--worker", "--create", "--aggregate", "--config", "--set",
                 "--storage-option", "torchrun"):
        assert flag in out.stdout


def test_unknown_config_field_is_named(tmp_path, main_here):
    code, err = main_here("--run", str(tmp_path / "r"), "--create", "--set", "train.stpes=10")
    assert code == 2
    assert "train: unknown field(s) stpes" in err
    assert "allowed: steps" in err
    assert not (tmp_path / "r" / "run.json").exists()


def test_missing_data_is_named(tmp_path, main_here):
    url = str(tmp_path / "r")
    cfg = load_config("tiny", [*MICRO, f"data.dataset={tmp_path / 'nodata'}"])
    # create the run with a dataset, then point the manifest at a missing one
    prepare_data(["builtin:shakespeare"], str(tmp_path / "nodata"), max_bytes=50_000)
    create_run(cfg, url)
    manifest = json.loads((tmp_path / "r" / "run.json").read_text())
    manifest["config"]["data"]["dataset"] = str(tmp_path / "gone")
    (tmp_path / "r" / "run.json").write_text(json.dumps(manifest))
    code, err = main_here("--run", url, "--worker", "region-a")
    assert code == 2
    assert str(tmp_path / "gone") in err and "workers.data prepare" in err


def test_manifest_that_does_not_match_the_model(tmp_path, main_here):
    url = str(tmp_path / "r")
    data_url = str(tmp_path / "data")
    prepare_data(["builtin:shakespeare"], data_url, max_bytes=50_000)
    create_run(config(data_url), url)
    manifest = json.loads((tmp_path / "r" / "run.json").read_text())
    manifest["config"]["model"]["overrides"]["d_model"] = 32
    (tmp_path / "r" / "run.json").write_text(json.dumps(manifest))
    code, err = main_here("--run", url, "--worker", "region-a")
    assert code == 2
    assert "the model has parameter" in err and "where the run has" in err


def test_unknown_worker_and_missing_run(tmp_path, main_here):
    code, err = main_here("--run", str(tmp_path / "nothing"), "--worker", "region-a")
    assert code == 2
    assert "manifest" in err and str(tmp_path / "nothing") in err
    assert not (tmp_path / "nothing").exists()  # nothing written


def test_unreachable_store_fails_with_its_url(monkeypatch, main_here):
    # credentials from the environment: on the command line they are refused
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    code, err = main_here("--run", "s3://diloco-test/run", "--worker", "region-a",
                          "--storage-option", "endpoint_url=http://127.0.0.1:9")
    assert code == 2
    assert "cannot reach the store s3://diloco-test/run" in err


def test_sigterm_checkpoints_and_the_worker_resumes(tmp_path, dataset):
    """The way a scheduler stops a job: SIGTERM to `python -m workers`. The worker
    saves a checkpoint and exits with 143; started again it resumes there and ends
    with exactly the parameters of an uninterrupted run. (The stopped job is a
    process of its own; the uninterrupted run and the restart train in this process,
    as `python -m workers` does: `WorkerLoop.open(url, worker).run()`.)"""
    import signal  # noqa: PLC0415
    import time  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from storage.objectstore import ObjectStore  # noqa: PLC0415
    from workers import checkpoint  # noqa: PLC0415

    data_url = str(tmp_path / "data")
    prepare_data(["builtin:shakespeare"], data_url, max_bytes=100_000)
    steps = "train.steps=60"
    cfg = load_config("tiny", [*MICRO, f"data.dataset={data_url}", "workers=[solo]", steps])

    def run_to_end(url, interrupt: bool):
        create_run(cfg, url)
        agg = Aggregator(open_run(url))
        stop = threading.Event()
        t = threading.Thread(target=agg.run, args=(stop, 300))
        t.start()
        cmd = [sys.executable, "-m", "workers", "--run", url, "--worker", "solo"]
        loop = None
        try:
            if interrupt:
                proc = subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE)
                # wait until it has trained a few steps, then stop it like a scheduler
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    status = (Path(url) / "members" / "solo" / "status.json")
                    if status.exists() and json.loads(status.read_text())["step"] >= 12:
                        break
                    time.sleep(0.2)
                proc.send_signal(signal.SIGTERM)
                out, err = proc.communicate(timeout=120)
                assert proc.returncode == 143, err[-2000:]
                assert "interrupted_after" in out
                stopped = json.loads(out.strip().splitlines()[-1])["interrupted_after"]
                assert checkpoint.latest_step(ObjectStore(url), "solo") == stopped
            loop = WorkerLoop.open(url, "solo")
            result = json.loads(json.dumps(loop.run().to_dict()))  # the result line's
        finally:
            if loop is not None:
                loop.close()
            t.join(120)
            stop.set()
        return result, agg

    plain, agg_plain = run_to_end(str(tmp_path / "plain"), interrupt=False)
    resumed, agg_resumed = run_to_end(str(tmp_path / "resumed"), interrupt=True)
    assert resumed["resumed_from"] is not None and plain["resumed_from"] is None
    assert resumed["steps"] == plain["steps"] == 60
    assert resumed["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6)
    for p in range(len(agg_plain.outer)):
        assert torch.equal(agg_plain.canonical(p), agg_resumed.canonical(p))


class SlowStore:
    """An object store whose PUTs take ``delay`` seconds (a saturated slow link)."""

    def __init__(self, base, delay: float):
        self.base, self.delay = base, delay
        self.puts: list[dict] = []

    def put(self, key, body):
        import time  # noqa: PLC0415

        time.sleep(self.delay)
        self.puts.append(json.loads(body))
        self.base.put(key, body)

    def __getattr__(self, name):
        return getattr(self.base, name)


def test_running_status_writes_never_stall_the_training_loop():
    """With background writes, a `running` status returns without waiting for its
    PUT: 20 updates return while every PUT is held back (only the newest pending one
    is written, by the writer thread); a final state is written before update()
    returns and no older `running` status lands after it."""
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    from storage.objectstore import ObjectStore  # noqa: PLC0415
    from workers.status import StatusBoard, read_status  # noqa: PLC0415

    gate = threading.Event()

    class HeldStore(SlowStore):
        """A link whose PUTs wait until the test opens the gate."""

        def put(self, key, body):
            self.callers.append(threading.current_thread())
            gate.wait(30)
            super().put(key, body)

    base = ObjectStore(f"memory://status/{time.time_ns()}")
    held = HeldStore(base, 0.0)
    held.callers = []
    board = StatusBoard(held, "w", background=True)
    for step in range(1, 21):
        board.update("running", force=True, step=step)
    # all 20 returned with no PUT done: none waited for one, none ran on this thread
    assert held.puts == []
    assert threading.current_thread() not in held.callers
    gate.set()
    board.update("finished", force=True, step=20)
    assert read_status(base, "w")["state"] == "finished"
    time.sleep(0.7)  # whatever the writer thread still held cannot overwrite it
    assert read_status(base, "w") == {**read_status(base, "w"), "state": "finished"}
    assert len(held.puts) < 20  # coalesced: intermediate ones were never sent
    assert [p["step"] for p in held.puts] == sorted(p["step"] for p in held.puts)
    # without background writes, every update waits for its PUT (the old behaviour):
    # when update() returns, the PUT has landed
    slow = SlowStore(base, 0.1)
    sync = StatusBoard(slow, "v")
    sync.update("running", force=True, step=1)
    assert [p["step"] for p in slow.puts] == [1]
    assert read_status(base, "v")["step"] == 1


def test_a_registration_names_the_code_that_ran(tmp_path):
    """members/<name>.json says which interpreter and which installed diloco-flows a
    party ran, so an audit tells a region running the image from one running a
    checkout; it is written once (a restart keeps the first)."""
    from importlib.metadata import version

    from storage import layout
    from storage.objectstore import ObjectStore
    from workers.status import StatusBoard

    store = ObjectStore(str(tmp_path / "run"))
    StatusBoard(store, "region-a").register(island=1)
    StatusBoard(store, "region-a").register(island=2)
    member = json.loads(store.get(layout.member("region-a")))
    assert member["python"] == sys.executable
    assert member["version"] == version("diloco-flows")
    assert member["island"] == 1
