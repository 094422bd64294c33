"""A real MLflow tracking server on loopback for tests.

``mlflow server`` in a child process on 127.0.0.1 and a free port, runs and metrics
in ``sqlite:///<dir>/mlflow.db``, artifacts proxied by the server to
``s3://<bucket>/<prefix>`` on the test S3 server (moto, see ``s3server.py``), and
the job runner off (``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``, docs/design.md).

Usage::

    with MlflowServer(tmp_path, s3_env, bucket="diloco-test") as server:
        os.environ["MLFLOW_TRACKING_URI"] = server.url     # http://127.0.0.1:<port>
        ...
        server.stop()        # a server that dies mid-run

The server runs in its own process group (uvicorn starts worker processes), and
`stop()` ends that group only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from s3server import Served


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer(Served):
    """``mlflow server`` on 127.0.0.1, SQLite backend, artifacts on S3."""

    def __init__(
        self,
        workdir: Path,
        s3_env: dict[str, str],
        *,
        bucket: str,
        prefix: str = "mlflow",
        startup_timeout: float = 90.0,
    ) -> None:
        self.workdir = Path(workdir)
        self.s3_env = dict(s3_env)
        self.bucket = bucket
        self.prefix = prefix
        self.startup_timeout = startup_timeout
        self.url = ""
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = self.workdir / "mlflow-server.log"

    @property
    def artifacts_destination(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def start(self) -> str:
        """Start the server and return its URL once /health answers."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(self.s3_env)
        env.update(
            MLFLOW_S3_ENDPOINT_URL=self.s3_env["AWS_ENDPOINT_URL_S3"],
            MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
        )
        env.pop("MLFLOW_TRACKING_URI", None)  # the server never follows a client setting
        for attempt in range(3):  # the free port may be taken between probe and bind
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            with self._log.open("ab") as log:
                self._proc = subprocess.Popen(
                    [
                        sys.executable, "-m", "mlflow", "server",
                        "--host", "127.0.0.1",
                        "--port", str(self.port),
                        "--workers", "1",
                        "--backend-store-uri", f"sqlite:///{self.workdir / 'mlflow.db'}",
                        "--artifacts-destination", self.artifacts_destination,
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self.workdir,
                    start_new_session=True,  # its own process group, ended by stop()
                )
            if self._wait_healthy():
                return self.url
            self.stop()
            if attempt == 2:
                break
        tail = self._log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"mlflow server did not become healthy at {self.url}:\n{tail}")

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.2)
        return False

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """End the server's process group and wait for it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

