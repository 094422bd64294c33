"""A Prefect server, its work pools and their workers on loopback, for tests.

    with PrefectServer(tmp_path) as server:          # prefect server start, own PREFECT_HOME
        env = server.env                              # PREFECT_API_URL etc. for subprocesses
        with server.worker("region-a"):               # prefect worker start --pool region-a
            ...
        with server.api():                            # this process's client on it
            deployed = server.deploy(cwd)             # `diloco deploy` in this process

Every process is started with subprocess in its own session and stopped (SIGTERM,
then SIGKILL) on exit, with everything it started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager, suppress
from pathlib import Path

try:  # tests/ is on sys.path under pytest's default import mode
    from prefect_home import prefect_home
except ImportError:  # tests imported as a package
    from tests.prefect_home import prefect_home

BIN = Path(sys.executable).parent
PREFECT = str(BIN / "prefect")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM the process's session, then SIGKILL what is left of it."""
    if proc.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


class PrefectServer:
    """``prefect server start`` on 127.0.0.1 with a PREFECT_HOME of its own."""

    def __init__(self, home: Path, *, start_timeout: float = 120.0):
        self.home = Path(home)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.log = self.home / "server.log"
        self.children: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        """The environment of anything that talks to this server."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update({
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_URL": self.url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "2",
            "PREFECT_RUNNER_POLL_FREQUENCY": "1",
            "PREFECT_LOGGING_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
        })
        return env

    def start(self) -> PrefectServer:
        prefect_home(self.home)  # its database made already: a third of the start's CPU
        env = self.env
        env.pop("PREFECT_API_URL")
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"prefect server not healthy in {self.start_timeout:.0f} s: "
                           f"{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        for child in reversed(self.children):
            stop_process(child)
        if self.proc is not None:
            stop_process(self.proc)

    def __enter__(self) -> PrefectServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def spawn(self, args: list[str], log_name: str, cwd: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        """A process talking to this server, stopped with it."""
        with open(self.home / log_name, "ab") as out:
            proc = subprocess.Popen(args, env={**self.env, **(env or {})}, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=cwd, start_new_session=True)
        self.children.append(proc)
        return proc

    @contextmanager
    def worker(self, pool: str, cwd: Path | None = None, env: dict[str, str] | None = None,
               *, kind: str = "process", queue: str | None = None):
        """``prefect worker start --pool POOL --type KIND`` (only work queue QUEUE if
        given) for as long as the block runs; its log is ``worker-POOL[-QUEUE].log``."""
        args = [PREFECT, "worker", "start", "--pool", pool, "--type", kind]
        if queue:
            args += ["--work-queue", queue]
        proc = self.spawn(args, f"worker-{pool}{f'-{queue}' if queue else ''}.log", cwd=cwd,
                          env=env)
        try:
            yield proc
        finally:
            stop_process(proc)
            self.children.remove(proc)

    @contextmanager
    def api(self, **env: str):
        """For as long as the block runs, this process talks to this server as a
        subprocess given `env` would: Prefect's settings name its API, and the
        environment (inherited by the processes started meanwhile) holds its PREFECT_
        settings and ``env``, none of the caller's. Restored afterwards."""
        from prefect.settings import PREFECT_API_URL, temporary_settings  # noqa: PLC0415

        saved = dict(os.environ)
        for key in [k for k in os.environ if k.startswith("PREFECT_")]:
            del os.environ[key]
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("PREFECT_")})
        os.environ.update(env)
        try:
            with temporary_settings({PREFECT_API_URL: self.url}):
                yield self
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def deploy(self, cwd: Path, *args: str, **env: str) -> str:
        """``diloco deploy ARGS`` run from ``cwd`` on this server, in this process (the
        command's code as its console script runs it, without the 2 s of imports of a
        new process; the ``prefect deploy`` it runs is a process of its own): its
        stdout; fails the test unless it exits 0."""
        from typer.testing import CliRunner  # noqa: PLC0415

        from cli.app import app  # noqa: PLC0415

        before = Path.cwd()
        os.chdir(cwd)
        try:
            with self.api(**env):
                result = CliRunner().invoke(app, ["deploy", *args])
        finally:
            os.chdir(before)
        assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
        return result.stdout

    def logs(self, name: str) -> str:
        path = self.home / name
        return path.read_text(errors="replace") if path.exists() else ""
