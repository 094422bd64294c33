"""A job started with --exit-with-parent notes its launcher's pid (flows/__init__) and
exits at once if the launcher is gone; a launcher that is pid 1 (`docker run IMAGE
diloco run`, a docker work pool's flow run) is not gone. Before this, every job of
`docker run IMAGE diloco run tiny` exited with 'the launcher (pid 1) is gone'."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import flows


class Exited(Exception):
    pass


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch):
    """note(parent, passed): `_note_launcher` in a job whose parent is PARENT and whose
    DILOCO_LAUNCHER_PID is PASSED (None: not set); Exited(status) if it exits."""
    def exit_(status: int) -> None:
        raise Exited(status)

    monkeypatch.setattr(sys, "argv", ["-m", "--exit-with-parent"])
    monkeypatch.setattr(os, "_exit", exit_)

    def note(parent: int, passed: str | None) -> int | None:
        monkeypatch.setattr(os, "getppid", lambda: parent)
        if passed is None:
            monkeypatch.delenv("DILOCO_LAUNCHER_PID", raising=False)
        else:
            monkeypatch.setenv("DILOCO_LAUNCHER_PID", passed)
        return flows._note_launcher()

    return note


def test_a_launcher_of_pid_1_is_there(job) -> None:
    assert job(1, "1") == 1


def test_a_launcher_gone_is_noticed(job) -> None:
    with pytest.raises(Exited, match=str(flows.EXIT_ORPHANED)):
        job(1, "4242")  # reparented to init
    with pytest.raises(Exited):
        job(77, "4242")  # to a subreaper
    with pytest.raises(Exited):
        job(1, None)  # no pid passed: init as the parent means gone


def test_the_launcher_is_noted(job) -> None:
    assert job(4242, "4242") == 4242
    assert job(4242, None) == 4242


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare")
def test_a_job_under_a_launcher_of_pid_1_starts() -> None:
    """For real: the launcher is pid 1 of a pid namespace, as in a container."""
    launcher = ("import os, subprocess, sys; assert os.getpid() == 1; "
                "env = dict(os.environ, DILOCO_LAUNCHER_PID=str(os.getpid())); "
                "sys.exit(subprocess.run([sys.executable, '-c', "
                "'import flows; print(flows.LAUNCHER_PID)', '--exit-with-parent'], "
                "env=env).returncode)")
    got = subprocess.run(["unshare", "--pid", "--fork", "--user", "--map-root-user",
                          sys.executable, "-c", launcher], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(flows.__file__)), timeout=60)
    if "unshare:" in got.stderr and got.returncode != 0:
        pytest.skip(f"no pid namespace here: {got.stderr.strip()}")
    assert (got.returncode, got.stdout.strip()) == (0, "1"), got.stderr
