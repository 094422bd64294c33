"""A Prefect home whose database already exists, for the tests' Prefect servers.

A Prefect server on an empty ``PREFECT_HOME`` first creates its SQLite database, runs
every migration and registers the block types: 11 s of CPU on this project's
machines, against 4.5 s for a server on a home that has them (measured with
``SubprocessASGIServer`` start and stop, two cores). Every ``diloco run`` a test
starts brings its own temporary server on a home of its own, so the suite paid that
first start dozens of times. `prefect_home` copies, into a home that does not exist
yet, a database that one server per test process created once; what the server does
afterwards is unchanged. The first-run path (an empty home) stays tested where it
matters: tests/test_cli.py's main command runs on a fresh home.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_lock = threading.Lock()
_template: Path | None = None

_MAKE = """
from prefect.server.api.server import SubprocessASGIServer
server = SubprocessASGIServer()
server.start()
server.stop()
"""


def _make_template() -> Path:
    """A home where Prefect's temporary server started and stopped once: its database
    checkpointed into one file, without the server's log."""
    home = Path(tempfile.mkdtemp(prefix="diloco-prefect-home-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    # (Prefect waits 20 s for its temporary server by default: too short on two busy cores)
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")
    made = subprocess.run([sys.executable, "-c", _MAKE], env=env, timeout=300, text=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if made.returncode != 0:
        raise RuntimeError(f"no Prefect home template in {home}: {made.stderr[-3000:]}")
    db = home / "prefect.db"
    with sqlite3.connect(db) as conn:  # the write-ahead log folded into the file
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for path in home.iterdir():
        if path.name not in ("prefect.db", "memo_store.toml"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return home


def prefect_home(path: Path) -> Path:
    """``path`` as a Prefect home holding a created, migrated database (made once per
    test process); a home that has a database already is left as it is."""
    global _template
    with _lock:
        if _template is None:
            _template = _make_template()
        if not (path / "prefect.db").exists():
            shutil.copytree(_template, path, dirs_exist_ok=True)
    return path
