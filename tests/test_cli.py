"""The `diloco` command as a user runs it: the README's main command on the tiny
recipe (shortened by --set), with Prefect's temporary server and MLflow on SQLite,
checked by what it leaves in the store and what it prints; `status` and `cancel`
on that run; and configuration errors, each a clear message with nothing launched."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runs import SHORT, clean_env
from typer.testing import CliRunner

from cli.app import app

DILOCO = str(Path(sys.executable).parent / "diloco")


def diloco(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300):
    return subprocess.run([DILOCO, *args], cwd=cwd, env=env, text=True, capture_output=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    """`diloco run` with the tiny recipe shortened: what it printed and where."""
    cwd = tmp_path_factory.mktemp("user")
    env = clean_env(cwd, fresh_prefect=True, DILOCO_THREADS_AT_EXIT=str(cwd / "threads"))
    out = diloco(["run", *SHORT], cwd, env)  # a first run
    return cwd, out


def busy_threads(record: Path) -> list[dict]:
    """The threads a process left alive at its exit (tracking/exit_threads.py) that
    were in code of this project, torch, matplotlib or MLflow: a thread in native code
    when the interpreter finalizes aborts the process."""
    root = str(Path(__file__).resolve().parent.parent)
    ours = ("/torch/", "/matplotlib/", "/mlflow/")
    return [t for t in json.loads(record.read_text())["threads"]
            if any(any(o in frame for o in ours) or (frame.startswith(root + "/")
                   and ".venv" not in frame) for frame in t["stack"])]


@pytest.mark.slow
def test_main_command(main_run):
    cwd, out = main_run
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    runs = sorted((cwd / "runs").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("tiny-")
    run = runs[0]
    # what it prints: progress, the figures, where to look
    text = out.stdout
    assert f"{run.name} finished in" in text
    for worker in ("region-a", "region-b"):
        assert worker in text
    assert "24/24" in text and "canonical model: eval loss" in text
    assert "participation 100%" in text
    assert f"store    runs/{run.name}" in text
    assert f"diloco status {run.name}" in text
    assert "mlflow ui --backend-store-uri sqlite:///mlflow.db" in text
    assert "Traceback" not in out.stderr
    # the status hint runs as printed, in a shell that never activated the virtualenv
    hint = next(line.split(None, 1)[1] for line in text.splitlines()
                if line.strip().startswith("status "))
    # (status starts no Prefect: the first run's home as it left it, nothing prepared)
    env = clean_env(cwd, fresh_prefect=True)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if Path(p).resolve() != Path(sys.executable).parent.resolve())
    ran = subprocess.run(["bash", "-c", hint], cwd=cwd, env=env, text=True,
                         capture_output=True, timeout=120)
    assert ran.returncode == 0 and "region-a" in ran.stdout, (hint, ran.stdout + ran.stderr)
    # what it leaves in the store
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["workers"] == ["region-a", "region-b"] and manifest["total_steps"] == 24
    status = {n: json.loads((run / "members" / n / "status.json").read_text())
              for n in ("region-a", "region-b", "aggregator")}
    assert all(s["state"] == "finished" for s in status.values()), status
    assert status["region-a"]["step"] == status["region-b"]["step"] == 24
    agg = status["aggregator"]
    assert agg["rounds"] == agg["total_rounds"] == sum(manifest["rounds"])
    assert agg["eval_loss"] < agg["initial_eval_loss"] - 1.0  # a clearly falling loss
    # a finished run keeps no worker checkpoint (retention.after_run: nothing resumes it)
    assert not list(run.glob("workers/*/ckpt/*")), list(run.glob("workers/*/ckpt/*"))
    assert "gc deleted" in text and "traffic:" in text and "canonical checkpoints" in text, (
        text[-3000:])
    assert (run / "global").is_dir() and (run / "logs" / "aggregator.log").exists()
    launcher = json.loads((run / "members" / "launcher.json").read_text())
    assert launcher["backend"] == "local" and set(launcher["jobs"]) == {
        "aggregator", "region-a", "region-b"}
    assert all(job["exit"] == 0 for job in launcher["jobs"].values())
    assert (cwd / "mlflow.db").exists()
    # the command (the MLflow thread of its train job, the progress display, the
    # system-metrics monitor) leaves no thread of its own at its exit, only idle event
    # loops; the jobs none in tracking, torch or matplotlib
    records = [(json.loads(r.read_text())["argv"][0], r) for r in (cwd / "threads").glob("*")]
    assert sorted(Path(a).name for a, _ in records) == [  # the command, and its three jobs
        "aggregator_job.py", "diloco", "worker_job.py", "worker_job.py"], records
    for argv0, record in records:
        left = busy_threads(record)
        if "_job.py" in argv0:  # a worker's status writer and stop timer: waiting, in Python
            left = [t for t in left if any(
                p in f for f in t["stack"] for p in ("/tracking/", "/torch/", "/matplotlib/"))]
        assert not left, (argv0, left)


@pytest.mark.slow
def test_status_and_cancel_of_a_finished_run(main_run, in_process, monkeypatch):
    """The commands in this process (what they print is the subject; the status hint
    of test_main_command runs the installed command in a shell)."""
    cwd, out = main_run
    assert out.returncode == 0
    name = next((cwd / "runs").iterdir()).name
    monkeypatch.chdir(cwd)
    status = in_process.invoke(app, ["status", name])
    assert status.exit_code == 0, status.stderr
    assert "region-b" in status.stdout and "finished" in status.stdout
    assert "24/24" in status.stdout and "rounds" in status.stdout
    as_json = in_process.invoke(app, ["status", name, "--json"])
    assert as_json.exit_code == 0, as_json.stderr
    assert json.loads(as_json.stdout)["aggregator"]["state"] == "finished"
    # a finished run: nothing to cancel or resume, one line each, nothing written
    cancel = in_process.invoke(app, ["cancel", name, "--timeout", "10"])
    assert cancel.exit_code == 2, cancel.stdout + cancel.stderr
    assert "has finished; there is nothing to cancel" in cancel.stderr
    assert not (cwd / "runs" / name / "control" / "cancel.json").exists()
    resumed = in_process.invoke(app, ["resume", name])
    assert resumed.exit_code == 2, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "has finished; there is nothing to resume" in resumed.stderr


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, expected", [
    (["--set", "train.stepz=5"], "train: unknown field(s) stepz; allowed: steps"),
    (["--set", "train.steps=-1"], "train.steps: Input should be greater than or equal to 1"),
    (["--set", "sync.schedule.fragments=7"], "sync"),
    (["no-such-recipe"], "config 'no-such-recipe' is neither a file nor a recipe; "
                         "recipes: gpu-150m, gpu-1b, small, tiny"),
    (["--set", "store=s3://diloco-nowhere/runs"], "cannot reach the store "
                                                  "s3://diloco-nowhere/runs"),
], ids=["unknown-field", "bad-value", "bad-combination", "unknown-recipe", "unreachable-store"])
def test_config_errors_launch_nothing(in_process, tmp_path, monkeypatch, args, expected):
    if "s3://" in args[-1]:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{_closed_port()}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    result = in_process.invoke(app, ["run", *args])
    assert result.exit_code == 2, result.output
    assert "error:" in result.stderr and expected in result.stderr, result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert not (tmp_path / "runs").exists()  # no run, no dataset
    assert not (tmp_path / "prefect-home").exists()  # Prefect never started


def test_the_console_script_exits_2_without_a_traceback(tmp_path):
    # refused before Prefect starts: no Prefect home prepared for it
    out = diloco(["run", "--set", "train.stepz=5"], tmp_path,
                 clean_env(tmp_path, fresh_prefect=True), timeout=60)
    assert out.returncode == 2
    assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", ["status", "resume", "cancel"])
def test_unknown_run_is_named(in_process, command):
    result = in_process.invoke(app, [command, "nope"])
    assert result.exit_code == 2
    assert "no run 'nope'" in result.stderr


def test_every_command_has_help():
    runner = CliRunner()
    top = runner.invoke(app, ["--help"])
    assert top.exit_code == 0
    for command in ("run", "status", "resume", "cancel", "deploy", "prepare-data"):
        assert command in top.output
        result = runner.invoke(app, [command, "--help"])
        assert result.exit_code == 0, (command, result.output)
        assert "Usage: diloco " + command in result.output.replace("root ", "")


def test_deploy_needs_a_server(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    result = CliRunner().invoke(app, ["deploy"])
    assert result.exit_code == 2
    assert "PREFECT_API_URL is not set" in result.output


def test_prepare_data(tmp_path):
    out = tmp_path / "ds"
    result = CliRunner().invoke(app, ["prepare-data", "builtin:shakespeare/comedies/*",
                                      "--out", str(out), "--max-bytes", "20000"])
    assert result.exit_code == 0, result.output
    assert "20,000 bytes read" in result.output
    assert (out / "dataset.json").exists()
    again = CliRunner().invoke(app, ["prepare-data", "builtin:shakespeare", "--out", str(out)])
    assert again.exit_code == 2 and "error:" in again.output


def test_an_error_line_keeps_its_brackets(capsys):
    """Errors quote commands and user input; rich would read ``[cloud]`` as markup
    and drop it from ``pip install 'diloco-flows[cloud]'``."""
    from cli.console import fail

    exit_ = fail("install it: pip install 'diloco-flows[cloud]' (got [bold]x[/])")
    assert exit_.exit_code == 2
    err = capsys.readouterr().err
    assert "pip install 'diloco-flows[cloud]' (got [bold]x[/])" in " ".join(err.split())
