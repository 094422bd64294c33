"""A zygote: one process that has imported what a ``python -m workers`` job imports
(torch, its distributed checkpoint and FSDP, ``torch._dynamo``, s3fs, the worker, the
aggregator) and forks a child per job, so that no job pays those imports again
(seconds of CPU each). Used by the fault trials (tests/faults.py) for their worker,
aggregator and tests/fault_job.py jobs, and by the island tests
(tests/test_island_stop.py) for an island's ranks.

A forked job is still a process of its own: its own pid, session (``os.setsid``: a
``killpg`` of its pid ends it and anything it started), environment, working
directory, stdout and stderr files, signals and exit status. It runs its argv as the
interpreter would (``-m MODULE`` or a script, through runpy: the ``__main__`` blocks
run, ``sys.argv`` and ``sys.path[0]`` as a new interpreter sets them) and exits as it
would; a signal that ends it is reported negative, as `subprocess` does.

The parent side is `Zygote` (`zygote()`: the one of this test process, started on
first use) and `Forked`, the part of `subprocess.Popen` the tests use.
``DILOCO_TEST_ZYGOTE=0``: `enabled` says no, and the fault trials start plain
processes instead (to check that nothing depends on the shortcut).

Protocol: the zygote (this file run as a script) reads one JSON line per job on
stdin (argv, env, cwd, out, and optionally err: a file of its own for stderr, else
stderr goes to ``out`` too; both opened for appending) and answers ``started PID``,
then ``exit PID CODE`` once that child ended; it ends when its stdin closes.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from contextlib import suppress
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(Path(__file__).resolve())

#: what the zygote imports before it forks: every import of the jobs' start-up
IMPORTS = (
    "s3fs",  # an S3 run's store
    "torch._dynamo",  # imported by the first optimizer made (~1.2 s of CPU)
    "torch.distributed.checkpoint",  # a worker's checkpoints
    "torch.distributed.fsdp",  # an fsdp island
    "workers.__main__",
    "workers.loop",
    "workers.island",
    "workers.group_exit",
    "diloco.aggregator",
    "diloco.run",
    "storage.exchange",
    "storage.backends",
    "storage.reach",
)


def enabled() -> bool:
    """Whether jobs may be forked (``DILOCO_TEST_ZYGOTE=0``: plain processes)."""
    return os.environ.get("DILOCO_TEST_ZYGOTE", "1") != "0"


# -- the test process's side ---------------------------------------------------------


class Forked:
    """A job forked by a `Zygote`: the part of `subprocess.Popen` the tests use."""

    def __init__(self, zygote: Zygote, pid: int):
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.zygote.ended:
            if not self.zygote.ended.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(f"forked job {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The zygote process (this file as a script), started at once; its imports go
    on while the test does other things, and the first `start` waits for them."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("DILOCO_", "MLFLOW_", "PREFECT_"))}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115 - read if it fails
        self.proc = subprocess.Popen([sys.executable, SCRIPT], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.errors)
        self.ended = threading.Condition()
        self.live: dict[int, Forked] = {}  # pid -> the job, until it ended
        self.started: queue.Queue[Forked | None] = queue.Queue()
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, *rest = line.split()
            if kind == b"started":
                job = self.live[int(rest[0])] = Forked(self, int(rest[0]))
                self.started.put(job)
            elif kind == b"exit":
                with self.ended:
                    self.live.pop(int(rest[0])).returncode = int(rest[1])
                    self.ended.notify_all()
        self.started.put(None)  # it ended

    def start(self, argv: list[str], env: dict[str, str], out: Path,
              err: Path | None = None, cwd: Path = ROOT) -> Forked:
        """Fork a job running ``argv`` (``[python, "-m", module, ...]`` or ``[python,
        script, ...]``): its stdout to ``out``, its stderr there too, or to ``err``."""
        if argv[0] != sys.executable:
            raise ValueError(f"a zygote runs Python only, not {argv[0]}")
        job = {"argv": argv, "env": env, "cwd": str(cwd), "out": str(out)}
        if err is not None:
            job["err"] = str(err)
        for path in (out, err or out):  # there once started: a test may read them at once
            open(path, "ab").close()  # noqa: SIM115
        assert self.proc.stdin is not None
        with self.lock:
            self.proc.stdin.write(json.dumps(job).encode() + b"\n")
            self.proc.stdin.flush()
            forked = self.started.get(timeout=120)
        if forked is None:
            self.errors.seek(0)
            raise RuntimeError("the zygote (tests/zygote.py) ended:\n"
                               + self.errors.read().decode(errors="replace")[-3000:])
        return forked

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Close its stdin: it ends (jobs still running go on, in their sessions)."""
        if self.proc.poll() is None:
            with suppress(OSError):
                self.proc.stdin.close()
            self.proc.wait(timeout=30)
        self.errors.close()


_zygote: Zygote | None = None
_lock = threading.Lock()


def zygote() -> Zygote:
    """This test process's `Zygote`, started on first use (and again if it died)."""
    global _zygote
    with _lock:
        if _zygote is None or not _zygote.alive():
            _zygote = Zygote()
            atexit.register(_zygote.stop)
        return _zygote


# -- the zygote's side ---------------------------------------------------------------


def serve() -> None:
    """Import `IMPORTS`, then fork a child per job read on stdin (module docstring)
    and report each one's exit, until stdin closes. Woken by SIGCHLD (through a
    wakeup pipe) or stdin, never by a timer."""
    import importlib
    import select

    for name in IMPORTS:
        importlib.import_module(name)
    if threading.active_count() != 1:  # a fork copies only this thread
        raise SystemExit(f"tests/zygote.py: {threading.active_count()} threads after import")
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    pending, children = b"", set()
    while True:
        ready = select.select([0, wake_r], [], [])[0]
        if wake_r in ready:
            with suppress(BlockingIOError):
                os.read(wake_r, 4096)
        while children:  # every child that ended, before any new pid is reported
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            os.write(1, f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())
        if 0 not in ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            job = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _become(job, (wake_r, wake_w))  # never returns: the job's SystemExit
            children.add(pid)
            os.write(1, f"started {pid}\n".encode())


def _become(job: dict, close: tuple[int, ...]) -> None:
    """The child of `serve`: become the job, run it, exit as it exits (its
    SystemExit, or an exception, ends this process as either ends an interpreter)."""
    import runpy
    import warnings

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in close:
        os.close(fd)
    os.setsid()
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    out = os.open(job["out"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    err = os.open(job.get("err", job["out"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in (null, out, err):
        os.close(fd)
    argv = job["argv"][1:]  # after the interpreter
    if argv[0] == "-m":
        # the zygote imported the module's package already: runpy says so on stderr,
        # where a fresh interpreter says nothing (a test may read a job's stderr)
        warnings.filterwarnings("ignore", category=RuntimeWarning,
                                message=r".* found in sys\.modules after import of package")
        sys.path[0] = job["cwd"]  # as ``python -m`` sets it
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = str(Path(argv[0]).resolve().parent)  # as ``python script`` sets it
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
    raise SystemExit(0)


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # the project's packages (this script's folder is tests/)
    serve()
