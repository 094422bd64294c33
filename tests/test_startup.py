"""Start-up, the way a user meets it: what the commands and the job entry points
check before anything is launched or written (a missing bucket, a folder that
holds no run), each a one-line error with exit status 2; and no process outlives
the command that started it (a job whose launcher died during its imports, the
jobs and Prefect's temporary server of a `diloco run` killed with SIGKILL)."""

from __future__ import annotations

import json
import logging
import os
import runpy
import signal
import subprocess
import sys
import time
import uuid
import warnings
from contextlib import suppress
from pathlib import Path

import pytest
from cli_runs import alive, clean_env, descendants

from workers.config import load_config
from workers.data.prepare import prepare_data
from workers.runs import create_run

BIN = Path(sys.executable).parent
DILOCO = str(BIN / "diloco")
ROOT = Path(__file__).resolve().parent.parent

MICRO = [
    "model.overrides={d_model: 64, n_layers: 2, n_heads: 2, max_seq_len: 64}",
    "data.seq_len=32", "data.batch_size=8", "optim.warmup_steps=4", "optim.lr=0.01",
    "train.eval_every=0", "train.eval_batches=2", "train.threads=1", "sync.schedule.sync_every=8",
    "sync.schedule.fragments=2", "sync.schedule.overlap=1", "train.checkpoint_every=8",
]
SHORT = [a for item in MICRO for a in ("--set", item)]



def error_line(stderr: str) -> str:
    """The one error line of a refusal (log lines before it are allowed, a traceback
    or a second error line are not)."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr
    assert stderr.rstrip().endswith(errors[0]), stderr  # nothing after it
    return errors[0]


def tree(path: Path) -> list[str] | None:
    """Every file and folder under ``path`` (None if it does not exist)."""
    if not path.exists():
        return None
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def wait_gone(pids: list[int], timeout: float) -> float:
    """Seconds until every pid has ended; fails after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if not any(alive(p) for p in pids):
            return time.monotonic() - start
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    raise AssertionError(f"still running {timeout:.0f} s later: {left}")


def kill_all(pids) -> None:
    for pid in pids:  # only processes this test started (its launcher's descendants)
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("data") / "shakespeare")
    prepare_data(["builtin:shakespeare/tragedies/*"], url, max_bytes=200_000)
    return url


def run_py(args: list[str], env: dict[str, str], timeout: float = 120):
    return subprocess.run([sys.executable, *args], env=env, text=True, capture_output=True,
                          timeout=timeout, cwd=ROOT)


def run_module(module: str, args: list[str], env: dict[str, str],
               capsys) -> tuple[int, str, str]:
    """``python -m MODULE ARGS`` with the environment ``env``, run in this process as
    the interpreter runs it (its ``__main__`` block included, without a second of
    imports per process): its exit status, stdout and stderr. The logging set-up the job does
    for itself, the environment and argv are put back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    saved_env, saved_argv = dict(os.environ), sys.argv[:]
    capsys.readouterr()
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *args]
    try:
        with warnings.catch_warnings():  # the module was imported already: runpy says so
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        root.handlers[:] = handlers
        root.setLevel(level)
    out = capsys.readouterr()
    return code, out.out, out.err


# -- a missing bucket ---------------------------------------------------------------------


@pytest.mark.s3
def test_a_missing_bucket_is_named_before_anything_starts(s3_env, data_url, tmp_path):
    """`diloco run` into a bucket that does not exist: one line naming the bucket and
    the command that creates it, exit 2, in seconds, and nothing started or written
    (it used to start the flow and fail 33 s later with 60 lines of traceback)."""
    bucket = f"diloco-missing-{uuid.uuid4().hex[:12]}"
    env = clean_env(tmp_path, fresh_prefect=True, **s3_env)  # nothing in tmp_path
    start = time.monotonic()
    out = subprocess.run([DILOCO, "run", *SHORT, "--set", "train.steps=16", "--set",
                          f"data.dataset={data_url}", "--set", f"store=s3://{bucket}/runs"],
                         cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300)
    took = time.monotonic() - start
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    line = error_line(out.stderr)
    assert f"the bucket '{bucket}'" in line, line
    assert f"diloco bucket setup s3://{bucket}/PREFIX --workers NAMES" in line, line
    assert tree(tmp_path) == [], "something was written"
    assert took < 30, f"took {took:.1f} s"


@pytest.mark.s3
@pytest.mark.parametrize("command", ["resume", "workers-aggregate", "workers-worker"])
def test_every_entry_point_names_a_missing_bucket(s3_env, tmp_path, capsys, command):
    """(`python -m workers` in this process: it checks the bucket before anything.)"""
    bucket = f"diloco-missing-{uuid.uuid4().hex[:12]}"
    url = f"s3://{bucket}/runs/tiny-20260101-120000"
    env = clean_env(tmp_path, fresh_prefect=True, DILOCO_TRACKING="off", **s3_env)
    if command == "resume":
        out = subprocess.run([DILOCO, "resume", url], cwd=tmp_path, env=env, text=True,
                             capture_output=True, timeout=120)
        code, stdout, err = out.returncode, out.stdout, out.stderr
    else:
        role = ["--aggregate"] if command == "workers-aggregate" else ["--worker", "region-a"]
        code, stdout, err = run_module("workers", ["--run", url, *role], env, capsys)
    assert code == 2, stdout[-3000:] + err[-3000:]
    line = error_line(err)
    assert f"diloco bucket setup s3://{bucket}/PREFIX --workers NAMES" in line, line
    assert tree(tmp_path) == []


# -- a folder that holds no run ---------------------------------------------------------


AGGREGATE = ["workers", "--aggregate"]


@pytest.mark.parametrize("entry, folder", [
    (AGGREGATE, "empty"), (AGGREGATE, "other-files"), (AGGREGATE, "absent"),
    (["workers", "--worker", "region-a"], "other-files"),
    (["flows.aggregator"], "other-files"),
    (["flows.worker", "--worker", "region-a"], "other-files"),
], ids=["workers-aggregate-empty", "workers-aggregate-other-files", "workers-aggregate-absent",
        "workers-worker", "flows-aggregator", "flows-worker"])
def test_a_folder_that_is_not_a_run_is_left_as_it_was(tmp_path, capsys, entry, folder):
    """A job pointed at a folder that holds no run writes nothing there (the
    aggregator used to register members/aggregator.json first): one line, exit 2.
    (`python -m MODULE` in this process: what is checked happens before the job
    talks to anything.)"""
    where = tmp_path / "not-a-run"
    if folder != "absent":
        where.mkdir()
    if folder == "other-files":
        (where / "notes.txt").write_text("my notes\n")
    before = tree(where)
    code, out, err = run_module(entry[0], ["--run", str(where), *entry[1:]],
                                clean_env(tmp_path, fresh_prefect=True, DILOCO_TRACKING="off"),
                                capsys)
    assert tree(where) == before, err[-3000:]
    assert code == 2, out[-3000:] + err[-3000:]
    assert f"no run at {where}" in error_line(err)


# -- no process outlives its launcher ------------------------------------------------------


@pytest.mark.parametrize("after", [0.0, 1.0], ids=["before-it-starts", "during-its-imports"])
def test_a_job_whose_launcher_died_during_its_imports_exits(data_url, tmp_path, after):
    """A launcher killed (SIGKILL) right after it started the aggregator job, or a
    second later while the job still imports Prefect and torch: the job exits on its
    own instead of aggregating on with parent pid 1 (it used to note its parent
    only after the imports, by then init)."""
    cfg = load_config("tiny", [*MICRO, "train.steps=16", f"data.dataset={data_url}",
                               f"store={tmp_path}"])
    url = str(tmp_path / "run")
    create_run(cfg, url)
    launcher_code = (
        "import sys, time\n"
        "from flows.launchers import LocalLauncher\n"
        f"launcher = LocalLauncher(evaluate=False, log_dir={str(tmp_path / 'logs')!r})\n"
        f"launcher.start({url!r}, 'aggregator')\n"
        "print(launcher.procs['aggregator'].pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = clean_env(tmp_path, DILOCO_TRACKING="off")
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], env=env, cwd=ROOT,
                                stdout=subprocess.PIPE, text=True)
    job = None
    try:
        job = int(launcher.stdout.readline())
        time.sleep(after)
        launcher.kill()
        launcher.wait()
        took = wait_gone([job], timeout=60)
    finally:
        launcher.kill()
        if job is not None:
            kill_all([job])
    log = (tmp_path / "logs" / "aggregator.log").read_text()
    print(f"the orphaned aggregator job exited {took:.1f} s after its launcher died: "
          f"{log.strip().splitlines()[-1] if log.strip() else ''}")
    assert "launcher" in log, log[-2000:]


@pytest.mark.slow
def test_a_killed_diloco_run_leaves_no_process(tmp_path, data_url):
    """`diloco run` killed with SIGKILL while its jobs start: the jobs and Prefect's
    temporary server it started are gone within a bounded time (the server used to
    run on, orphaned). The server wrote to its log file, not to the command's
    stderr."""
    env = clean_env(tmp_path, DILOCO_TRACKING="off")
    proc = subprocess.Popen([DILOCO, "run", *SHORT, "--set", "train.steps=400", "--set",
                             f"data.dataset={data_url}"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            seen.update(descendants(proc.pid))
            server = [p for p, c in seen.items() if "uvicorn" in c and "prefect" in c]
            jobs = [p for p, c in seen.items() if "flows.worker" in c or "flows.aggregator" in c]
            if server and len(jobs) == 3:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert server and len(jobs) == 3, seen
        # the server writes to its log in PREFECT_HOME, not to the command's stderr
        # (its shutdown noise used to end a finished run with a traceback)
        server_log = tmp_path / "prefect-home" / "temporary-server.log"
        assert [os.readlink(f"/proc/{server[0]}/fd/{fd}") for fd in (1, 2)] == \
            [str(server_log)] * 2
        assert f"temporary server of pid {proc.pid}" in server_log.read_text()
        proc.kill()
        proc.wait()
        killed = time.monotonic()
        server_took = wait_gone(server, timeout=30)
        jobs_took = wait_gone(jobs, timeout=90)
    finally:
        proc.kill()
        kill_all(seen)
    print(f"after SIGKILL of diloco run: the server was gone in {server_took:.1f} s, the jobs "
          f"in {jobs_took:.1f} s ({time.monotonic() - killed:.1f} s in all)")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux" or not Path("/usr/bin/unshare").exists(),
                    reason="needs unshare (util-linux) for a pid namespace")
def test_sigterm_to_diloco_run_as_pid_1_checkpoints_and_says_so(tmp_path, data_url):
    """`docker stop` of a container whose command is `diloco run`: SIGTERM to pid 1,
    which by default ignores it. The jobs checkpoint, the command prints one line
    saying it was stopped and how to continue (no traceback, none of Prefect's
    "Crash detected" lines), exits 143 (it used to exit 1 with Prefect's
    TerminationSignal traceback), and `diloco resume` finishes the run."""
    env = clean_env(tmp_path, DILOCO_TRACKING="off")
    run = [*SHORT, "--set", "train.steps=64", "--set", f"data.dataset={data_url}",
           "--set", "train.checkpoint_every=400"]  # only the stop's checkpoint
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", DILOCO, "run",
                             *run], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        steps = []
        while time.monotonic() < deadline and proc.poll() is None and not steps:
            with suppress(OSError, ValueError):  # not there yet, or being replaced
                steps = [s for s in tmp_path.glob("runs/*/members/region-a/status.json")
                         if json.loads(s.read_text()).get("step")]
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        (pid_1,) = [p for p, c in descendants(proc.pid).items()  # python .../diloco run
                    if f"{DILOCO} run" in c and "flows." not in c]
        os.kill(pid_1, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    if "unshare:" in err and proc.returncode != 143:
        pytest.skip(f"no pid namespace here: {err.strip()[:200]}")
    assert proc.returncode == 143, out[-2000:] + err[-3000:]
    assert "Traceback" not in err and "Crash detected" not in err, err[-3000:]
    (name,) = [p.name for p in (tmp_path / "runs").iterdir()]
    assert err.strip().splitlines()[-2:] == [
        "stopped by SIGTERM: the jobs saved their checkpoints. Continue with:",
        f"  diloco resume runs/{name}"], err[-2000:]
    for worker in ("region-a", "region-b"):
        assert list(tmp_path.glob(f"runs/{name}/workers/{worker}/ckpt/*.json")), worker
    # (the resume only finishes the run: on the Prefect server this process keeps)
    resumed = subprocess.run([DILOCO, "resume", name], cwd=tmp_path, text=True,
                             env=clean_env(tmp_path, shared_prefect=True, DILOCO_TRACKING="off"),
                             capture_output=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"{name} finished in" in resumed.stdout
