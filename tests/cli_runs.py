"""What the tests that run the `diloco` command as a user does share: a short run,
a clean environment, and the processes a command started (read from /proc, so a
test can check what they were given and that they are gone)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from pathlib import Path

try:  # tests/ is on sys.path under pytest's default import mode
    from prefect_home import prefect_home
    from prefect_server import PrefectServer
except ImportError:  # tests imported as a package
    from tests.prefect_home import prefect_home
    from tests.prefect_server import PrefectServer

ROOT = Path(__file__).resolve().parent.parent

# The tiny recipe, shortened: a micro model, 24 steps, a part of the corpus.
SHORT = [
    "--set", "model.overrides={d_model: 64, n_layers: 2, n_heads: 2, max_seq_len: 64}",
    "--set", "data.seq_len=32", "--set", "data.batch_size=8", "--set", "train.steps=24",
    "--set", "train.eval_every=0", "--set", "train.eval_batches=2", "--set", "sync.schedule.sync_every=8",
    "--set", "sync.schedule.fragments=2", "--set", "sync.schedule.overlap=1", "--set", "optim.warmup_steps=4",
    "--set", "optim.lr=0.01", "--set", "train.checkpoint_every=8",
    "--set", 'data.sources=["builtin:shakespeare/tragedies/*"]',
]


def clean_env(home: Path, *, fresh_prefect: bool = False, shared_prefect: bool = False,
              **extra: str) -> dict[str, str]:
    """No Prefect server configured (the embedded default), a PREFECT_HOME of our own,
    no credentials or tracking settings from the caller's environment.

    The home holds a Prefect database already made (tests/prefect_home.py: the
    temporary server then starts in a third of the CPU); ``fresh_prefect``: an empty
    home, as on a user's first run. ``shared_prefect``: for a test whose run is only
    the material of what it checks, the Prefect server this test process keeps
    (`shared_server`) instead of a temporary server per command."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "MLFLOW_", "DILOCO_", "AWS_"))}
    prefect = home / "prefect-home"
    if shared_prefect:
        env["PREFECT_API_URL"] = shared_server().url
    elif not fresh_prefect:
        prefect_home(prefect)
    env.update(PREFECT_HOME=str(prefect), COLUMNS="120", PYTHONPATH=str(ROOT), **extra)
    return env


_shared: PrefectServer | None = None
_shared_lock = threading.Lock()


def shared_server() -> PrefectServer:
    """One Prefect server per test process, started at its first use and stopped when
    the process exits: 4.5 s of CPU a `diloco run` does not spend on a temporary one."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.proc is None or _shared.proc.poll() is not None:
            home = Path(tempfile.mkdtemp(prefix="diloco-prefect-shared-"))
            atexit.register(shutil.rmtree, home, ignore_errors=True)
            _shared = PrefectServer(home)
            _shared.start()
            atexit.register(_shared.stop)  # (atexit runs the last registered first)
    return _shared


def descendants(pid: int) -> dict[int, str]:
    """The processes under ``pid`` now: {pid: command line}."""
    children: dict[int, list[int]] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(") ", 1)[1].split()[1])
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(
                b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = commands.get(child, "")
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie is dead: it only waits to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return False
