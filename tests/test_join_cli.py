"""``diloco join``, ``diloco leave`` and the members of ``diloco status``, run as a
user runs them: a worker joins a running local run (its contributions land in the
means), another leaves it, and the run still finishes; every refusal is one line,
exit 2, and writes nothing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runs import SHORT, clean_env

DILOCO = str(Path(sys.executable).parent / "diloco")


def env(cwd: Path) -> dict[str, str]:
    return clean_env(cwd, shared_prefect=True, DILOCO_TRACKING="off")


def unwrapped(text: str) -> str:
    """``text`` with every run of whitespace one space: what a console wrapped at its
    width reads as."""
    return " ".join(text.split())


def stop_jobs_of(cwd: Path) -> None:
    """SIGKILL every process whose command line names a path under ``cwd``: a job
    started by `diloco join` in this process outlives a failed test otherwise."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(cwd) in cmd:
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), signal.SIGKILL)


def listing(run: Path) -> dict[str, int]:
    return {str(p.relative_to(run)): p.stat().st_size for p in run.rglob("*") if p.is_file()}


def settings(*items: str) -> list[str]:
    out = list(SHORT)
    for item in items:
        out += ["--set", item]
    return out


def create(cwd: Path, name: str, *items: str) -> Path:
    """A run created and never started (no job runs: its store does not change)."""
    from workers.config import load_config
    from workers.runs import create_run

    run = cwd / "runs" / name
    overrides = [x for x in settings(*items) if x != "--set"]
    create_run(load_config("tiny", overrides), str(run))
    return run


@pytest.fixture(scope="module")
def idle(tmp_path_factory) -> Path:
    """Three runs that are created and not running: a diloco run with two workers
    and slots to spare, one whose two slots are full, a data-parallel one."""
    cwd = tmp_path_factory.mktemp("join-idle")
    create(cwd, "open")
    create(cwd, "full", "data.slots=2")
    create(cwd, "dp", "train.strategy=data_parallel")
    return cwd / "runs"


def refused(result, *words: str) -> None:
    """One line on stderr, exit 2 (the command run in this process)."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize(("run", "args", "words"), [
    ("nosuch", ["join", "--worker", "region-c"], ["no run 'nosuch'"]),
    ("open", ["join", "--worker", "region-a"], ["'region-a' is taken", "another --worker"]),
    ("open", ["join", "--worker", "bad name"], ["not valid"]),
    ("open", ["join", "--worker", "aggregator"], ["reserved"]),
    ("full", ["join", "--worker", "region-c"], ["no free data slot", "data.slots"]),
    ("dp", ["join", "--worker", "region-c"], ["data_parallel", "only 'diloco'"]),
    ("nosuch", ["leave", "--worker", "region-a"], ["no run 'nosuch'"]),
    ("open", ["leave", "--worker", "region-z"], ["not a member", "region-a, region-b"]),
])
def test_a_refused_join_or_leave_is_one_line_and_writes_nothing(idle, in_process, run,
                                                                args, words):
    from cli.app import app

    before = {p.name: listing(p) for p in idle.iterdir()}
    target = str(idle / run) if run != "nosuch" else run
    refused(in_process.invoke(app, [args[0], target, *args[1:]]), *words)
    assert {p.name: listing(p) for p in idle.iterdir()} == before


def test_a_taken_joiner_name_is_refused_once_claimed(idle, in_process):
    """The second of two joins of one name: refused, nothing more written."""
    from cli.app import app

    run = idle / "open"
    (run / "members").mkdir(exist_ok=True)
    (run / "members" / "region-c.json").write_text(json.dumps(
        {"name": "region-c", "join": True, "claim": "someone-else"}))
    before = listing(run)
    refused(in_process.invoke(app, ["join", str(run), "--worker", "region-c"]),
            "'region-c' is taken")
    assert listing(run) == before
    (run / "members" / "region-c.json").unlink()


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def rounds_applied(run: Path) -> int:
    try:
        status = json.loads((run / "members" / "aggregator" / "status.json").read_text())
    except (OSError, ValueError):
        return 0
    return int(status.get("rounds") or 0)


def test_join_and_leave_a_running_run(tmp_path, in_process, monkeypatch):
    """A run of two workers: region-c joins, its contributions are in the means;
    region-b leaves, the others stop waiting for it; the run finishes; status shows
    the members; a finished run refuses joins and leaves with one line.

    `diloco run` is the installed command; join, leave and status run in this process
    (cwd and environment the run's: the joiner's job inherits them)."""
    from cli import console
    from cli.app import app

    for key, value in env(tmp_path).items():
        monkeypatch.setenv(key, value)
    # the width the command had as a process (COLUMNS=120): this process's console
    # took its width from whatever COLUMNS was when a test first imported it
    monkeypatch.setattr(console.console, "width", 120)
    monkeypatch.setattr(console.errors, "width", 120)

    def diloco(*args: str):
        return in_process.invoke(app, list(args))

    # 480 steps: the joiner's start and admission, then region-b's leave, all before
    # the end (at 240 a loaded full suite once saw the run finish before the leave)
    run_cmd = [DILOCO, "run", *settings("train.steps=480", "train.checkpoint_every=80")]
    proc = subprocess.Popen(run_cmd, cwd=tmp_path, env=env(tmp_path), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (tmp_path / "runs").is_dir() and any((tmp_path / "runs").iterdir()),
                 120, "the run to be created")
        (run,) = (tmp_path / "runs").iterdir()
        wait_for(lambda: rounds_applied(run) >= 2, 180, "two rounds applied")

        joined = diloco("join", run.name, "--worker", "region-c", "--wait", "--timeout", "240")
        assert joined.exit_code == 0, joined.stdout + joined.stderr
        said = unwrapped(joined.stdout)
        assert "region-c is joining" in said
        assert f"diloco status {run.name}" in said
        assert "region-c admitted: data slot 2" in said
        launched = json.loads((run / "members" / "launcher.json").read_text())
        assert "--join" in launched["jobs"]["region-c"]["command"]
        assert {"aggregator", "region-a", "region-b"} <= set(launched["jobs"])

        left = diloco("leave", run.name, "--worker", "region-b", "--wait", "--timeout", "240")
        assert left.exit_code == 0, left.stdout + left.stderr
        assert "region-b left after step" in unwrapped(left.stdout)
        refused(diloco("leave", run.name, "--worker", "region-b"), "already left")

        status = diloco("status", run.name)
        assert status.exit_code == 0, status.stderr
        table = status.stdout[status.stdout.index("members"):]
        assert "region-c" in table and "region-b" in table
        assert "region-c joined" in table and "region-b left after rounds" in table
        members = {m["worker"]: m for m in json.loads(
            diloco("status", run.name, "--json").stdout)["members"]}
        assert members["region-c"]["joined"] and members["region-c"]["slot"] == 2
        assert members["region-b"]["left"] and not members["region-a"]["left"]

        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
        stop_jobs_of(tmp_path)  # the joiner is this process's child, not the run's
    assert proc.returncode == 0, out[-4000:]
    assert "finished" in out and "region-c" in out.split("finished in", 1)[1]
    means = [json.loads(p.read_text()) for p in sorted(run.glob("frag/*/r*/mean.json"))]
    with_c = [m for m in means if "region-c" in m["weights"]]
    assert with_c, "no mean has region-c's contribution"
    gone = json.loads((run / "members" / "region-b" / "left.json").read_text())["last_rounds"]
    for p, last in enumerate(gone):
        later = [m for m in means if m["fragment"] == p and m["round"] > last]
        assert later and not any("region-b" in w for m in later for w in m["weights"])
        # no one waits for it: at most the round open when it left still expected it
        assert all("region-b" not in m["expected"] for m in later if m["round"] > last + 1)
    # a finished run: nothing to join or leave, nothing written
    before = listing(run)
    refused(diloco("join", run.name, "--worker", "region-d"), "has finished")
    refused(diloco("leave", run.name, "--worker", "region-a"), "has finished")
    assert listing(run) == before


def test_mlflow_round_metrics_count_on_time_late_dropped_and_expected(monkeypatch):
    """A round's report with a late contribution (key ``worker@round``): participation
    counts the contributions on time; late, dropped and expected are their own
    metrics; no metric is named with '@' (MLflow refuses such names)."""
    from tracking import metrics

    report = {"fragment": 1, "round": 4, "weights": {"a": 0.4, "c": 0.4, "b@3": 0.2},
              "rejected": {}, "seconds": 0.1, "grad_norm": 1.0, "late": 1, "dropped": 2,
              "expected": 3}
    found = {m.key: m.value for m in metrics.round_metrics(report, {}, 0, 9)}
    assert found["participation"] == 2 and found["late"] == 1
    assert found["dropped"] == 2 and found["expected"] == 3
    assert not [k for k in found if "@" in k]
    assert metrics.round_size(report) == len(found) + 1  # + inner_step, with a schedule


def test_the_progress_artifact_names_the_member_set():
    from flows.jobs import member_set

    rows = [{"worker": "region-a", "slot": 0, "joined": False, "left": False},
            {"worker": "region-b", "slot": 1, "joined": False, "left": True},
            {"worker": "region-c", "slot": 2, "joined": True, "left": False},
            {"worker": "region-d", "slot": None, "joined": True, "left": False}]
    assert member_set(rows) == ("; members: region-a (slot 0), region-b (left), "
                                "region-c (joined, slot 2), region-d (joined, waiting for "
                                "admission)")
    assert member_set(None) == ""


def test_a_joiner_is_launched_with_join_and_its_claim():
    """Local: a detached process (it outlives `diloco join`) with --join --claim;
    deployments: the worker flow's parameters join=True, claim."""
    from flows.launchers import DeploymentLauncher, LocalLauncher

    cmd = LocalLauncher(detached=True).command("s3://b/r", "region-c", join=True, claim="c1")
    assert cmd[-3:] == ["--join", "--claim", "c1"]
    assert cmd[cmd.index("--claim") + 1] == "c1" and "--exit-with-parent" not in cmd
    assert "--exit-with-parent" in LocalLauncher().command("s3://b/r", "region-a")
    params = DeploymentLauncher(key="k", nproc=2).parameters("s3://b/r", "region-c",
                                                             join=True, claim="c1")
    assert params == {"run_url": "s3://b/r", "worker": "region-c", "join": True,
                      "claim": "c1"}


def test_resume_relaunches_joined_members_and_never_one_that_left(tmp_path):
    """What a start or `diloco resume` launches: the aggregator and every member that
    neither finished nor left, the workers that joined mid-run included."""
    from diloco.run import open_run
    from flows.jobs import to_launch
    from workers.report import snapshot

    run = create(tmp_path, "r")
    members = run / "members"
    (members / "region-c").mkdir(parents=True)
    (members / "region-c.json").write_text(json.dumps({"name": "region-c", "join": True,
                                                       "claim": "c1"}))
    (members / "region-c" / "admission.json").write_text(json.dumps({"slot": 2}))
    exchange = open_run(str(run))
    assert to_launch(exchange, snapshot(exchange)) == ["aggregator", "region-a", "region-b",
                                                       "region-c"]
    (members / "region-b").mkdir()
    (members / "region-b" / "left.json").write_text(json.dumps({"last_rounds": [3, 3]}))
    assert to_launch(exchange, snapshot(exchange)) == ["aggregator", "region-a", "region-c"]
