"""A Docker engine for tests: Debian's dockerd on a socket, data root and exec root
of its own, started and stopped by the test session (as tests/s3server.py does for
the S3 servers).

The engine is ``scripts/docker-engine daemon`` (dockerd with no bridge and no
iptables, so containers run with ``--network host``), its files under ``root``
(default ``$DILOCO_DOCKER_ROOT`` or /var/tmp/diloco-docker). The image cache stays
there between sessions, so image builds are cached; only the dockerd process, and the
containers this object started (labelled with its ``label``), go at `stop`.

If an engine already answers on that socket (``scripts/docker-engine start``), it is
used and left running. An engine started here is stopped at `stop`: SIGTERM, up to
``stop_timeout`` seconds, then SIGKILL; whatever it left running under its exec root
(containerd, shims) is killed by pid, and what it left mounted under its root is
unmounted. It also gets SIGTERM if the test process dies without stopping it
(PR_SET_PDEATHSIG), so no dockerd outlives a session.

It is also the pytest plugin (``pytest_plugins`` at the end of tests/conftest.py) that
gives the container tests their session fixtures: ``docker_engine`` (installed by
``scripts/docker-engine install`` where dockerd is missing, started once per session,
stopped at its end; the tests skip in one line where it cannot start) and ``image``
(``scripts/docker-image``, built once per session on that engine). Both skip unless
asked for (``-m containers`` or ``DILOCO_TEST_CONTAINERS=1``), so a plain ``pytest``
never starts an engine.

Usage::

    with DockerEngine() as engine:
        engine.docker("info")                        # the client, on this engine
        engine.docker(*engine.run_args(), "--network", "host", image, "true")
        os.environ | engine.env()                    # DOCKER_HOST, DOCKER_BUILDKIT, DOCKER
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "docker-engine"
DEFAULT_ROOT = "/var/tmp/diloco-docker"
#: the tag scripts/docker-image gives the image (the docker pools' --image)
IMAGE = "localhost/diloco-flows:latest"
#: the container tests' short `tiny` run: 16 steps of a small model, two fragments
SHORT_RUN = [
    "model.overrides={d_model: 64, n_layers: 2, n_heads: 2, max_seq_len: 64}",
    "data.seq_len=32", "data.batch_size=8", "optim.warmup_steps=2", "train.steps=16",
    "train.eval_every=0", "train.eval_batches=2", "train.log_every=4", "train.threads=1",
    "train.checkpoint_every=8", "sync.schedule.sync_every=8", "sync.schedule.fragments=2",
    "sync.schedule.overlap=1", 'data.sources=["builtin:shakespeare/tragedies/*"]',
]
_PR_SET_PDEATHSIG = 1


def _term_with_parent() -> None:  # in the child, before exec: SIGTERM when we die
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class DockerEngine:
    """dockerd on ``unix://<root>/docker.sock``; `start` returns once ``docker info``
    answers, `stop` leaves no process of it behind."""

    def __init__(self, root: str | os.PathLike[str] | None = None,
                 startup_timeout: float = 60.0, stop_timeout: float = 30.0) -> None:
        self.root = Path(root or os.environ.get("DILOCO_DOCKER_ROOT") or DEFAULT_ROOT)
        self.host = f"unix://{self.root / 'docker.sock'}"
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        #: every container `run_args` starts carries it; `stop` removes them
        self.label = f"diloco-test-session={uuid.uuid4().hex[:12]}"
        self.reused = False
        self.client = ""
        self._proc: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        """What a client or script needs to use this engine (add it to os.environ)."""
        return {"DOCKER_HOST": self.host, "DOCKER_BUILDKIT": "1", "DOCKER": self.client,
                "DILOCO_DOCKER_ROOT": str(self.root)}

    def docker(self, *args: str, check: bool = True, timeout: float | None = 600,
               **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """``docker ARGS`` on this engine, output captured as text."""
        kwargs.setdefault("capture_output", True)
        return subprocess.run([self.client, *args], env={**os.environ, **self.env()},
                              text=True, check=check, timeout=timeout, **kwargs)

    def run_args(self) -> list[str]:
        """``run --label ...``: a container that `stop` removes if it is still there."""
        return ["run", "--label", self.label]

    def answers(self) -> bool:
        try:
            return self.docker("info", check=False, timeout=20).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def start(self) -> str:
        """Start dockerd (or use the one answering on the socket); return DOCKER_HOST.
        RuntimeError, with dockerd's last lines, if it does not answer."""
        env = {**os.environ, "DILOCO_DOCKER_ROOT": str(self.root)}
        self.client = subprocess.run([str(SCRIPT), "client"], env=env, capture_output=True,
                                     text=True, check=True).stdout.strip()
        if self.answers():
            self.reused = True
            return self.host
        self.root.mkdir(parents=True, exist_ok=True)
        log = self.root / "dockerd.log"
        with open(log, "wb") as out:
            self._proc = subprocess.Popen([str(SCRIPT), "daemon"], env=env, stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, preexec_fn=_term_with_parent)
        deadline = time.monotonic() + self.startup_timeout
        while not self.answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                said = log.read_text(errors="replace").strip().splitlines()[-5:]
                self.stop()
                raise RuntimeError(f"dockerd did not answer on {self.host}: "
                                   + " | ".join(said or ["no output"]))
            time.sleep(0.25)
        return self.host

    def stop(self) -> None:
        """Remove the containers started with `run_args`; stop dockerd if it is ours."""
        if self.client and (self._proc is not None or self.reused):
            ids = self.docker("ps", "--all", "--quiet", "--filter", f"label={self.label}",
                              check=False, timeout=60).stdout.split()
            if ids:
                self.docker("rm", "--force", *ids, check=False, timeout=120)
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        for pid in self.leftovers():  # containerd and shims live in sessions of their own
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for mount in self.mounts():  # a network namespace's, after a kill
            if subprocess.run(["umount", mount], capture_output=True).returncode:
                subprocess.run(["umount", "-l", mount], capture_output=True)

    def leftovers(self) -> list[int]:
        """Processes still running from this engine's exec root (containerd, shims)."""
        mark = str(self.root / "exec").encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with suppress(OSError):  # gone meanwhile
                    if mark in (entry / "cmdline").read_bytes():
                        pids.append(int(entry.name))
        return pids

    def mounts(self) -> list[str]:
        """Mount points under the engine's root, deepest first."""
        with open("/proc/mounts") as table:
            points = [line.split()[1] for line in table]
        return sorted((p for p in points if p.startswith(f"{self.root}/")), reverse=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()



# -- the session fixtures of the container tests ---------------------------------------

def wanted(config: pytest.Config) -> bool:
    """Asked for: ``-m`` names the marker, or DILOCO_TEST_CONTAINERS=1."""
    return (os.environ.get("DILOCO_TEST_CONTAINERS") == "1"
            or "containers" in (config.getoption("markexpr", "") or ""))


def say(config: pytest.Config, line: str) -> None:
    """A line in pytest's output, captured or not (the figures the docs quote)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"containers: {line}")


@dataclass
class Build:
    seconds: float
    output: str


def build(engine: DockerEngine, image: str = IMAGE, *args: str) -> Build:
    """``scripts/docker-image ARGS`` on ENGINE: what a user runs, cached by the engine."""
    t0 = time.monotonic()
    got = subprocess.run([str(REPO / "scripts" / "docker-image"), *args], cwd=REPO,
                         env={**os.environ, **engine.env(), "IMAGE": image},
                         capture_output=True, text=True, timeout=1700)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    return Build(time.monotonic() - t0, got.stdout)


@pytest.fixture(scope="session")
def docker_engine(request: pytest.FixtureRequest) -> Iterator[DockerEngine]:
    """The engine for the session: installed if missing, started, stopped at the end."""
    if not wanted(request.config):
        pytest.skip("container tests build an image (minutes): "
                    "run them with -m containers or DILOCO_TEST_CONTAINERS=1")
    if os.geteuid() != 0:
        pytest.skip("container tests need root (they start dockerd)")
    if shutil.which("dockerd") is None:
        got = subprocess.run([str(SCRIPT), "install"], capture_output=True, text=True)
        if got.returncode != 0:
            said = (got.stderr or got.stdout).strip().splitlines()
            pytest.skip(f"could not install docker.io: {said[-1] if said else got.returncode}")
    engine = DockerEngine()
    t0 = time.monotonic()
    try:
        engine.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"no Docker engine: {exc}")
    how = "already running" if engine.reused else f"started in {time.monotonic() - t0:.1f} s"
    say(request.config, f"engine {engine.host} ({how}), client {engine.client}")
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def image(docker_engine: DockerEngine, request: pytest.FixtureRequest) -> str:
    """The image, built (or found in the engine's cache) by scripts/docker-image."""
    built = build(docker_engine)
    for line in built.output.splitlines():
        say(request.config, line)
    say(request.config, f"scripts/docker-image took {built.seconds:.1f} s")
    return IMAGE
