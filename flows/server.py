"""Prefect's temporary server, tied to the life of the process that needs it.

Without ``PREFECT_API_URL``, Prefect starts a temporary API server the first time a
client is needed (`prefect.server.api.server.SubprocessASGIServer`: ``python -m
uvicorn ... prefect.server.api.server:create_app`` as a plain child process) and
stops it from an ``atexit`` hook. A launcher killed with SIGKILL runs no hook, so
the server ran on, orphaned. `tie_temporary_server` starts that same server
earlier, from the main thread, with the kernel's parent-death signal set in the
child (Linux ``prctl(PR_SET_PDEATHSIG, SIGTERM)``, see storage/tied.py): whatever ends
this process, the server gets SIGTERM. It is registered as Prefect's default
instance (as Prefect's own test utilities do), so every client of this process
uses it, and Prefect's ``atexit`` stop still runs on a normal exit.

The parent-death signal is sent when the *thread* that started the child ends,
hence the main thread only; elsewhere (or off Linux) Prefect starts its server as
it always does.

The server's own output goes to `server_log()` (``$PREFECT_HOME/temporary-server.log``),
not to the command's terminal: when the server stops, its background services are
cancelled mid-query and SQLAlchemy logs the cancelled rollback as an error with a
traceback (Prefect's noise, not the run's), which used to end a finished
``diloco run`` with a traceback on stderr. If the server does not start, the
command's one-line error names that file.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from storage.tied import death_signal_preexec, tied
from tracking.settings import unanswered

log = logging.getLogger(__name__)

#: The server log is set aside (``.1``) when it reaches this size at a start.
SERVER_LOG_MAX_BYTES = 4 << 20


def server_log() -> Path:
    """Where the temporary server started by `tie_temporary_server` writes its
    output: beside the database it serves, in Prefect's home."""
    from prefect.settings import PREFECT_HOME  # noqa: PLC0415

    return Path(PREFECT_HOME.value()).expanduser() / "temporary-server.log"


def _open_server_log(parent: int) -> IO[bytes]:
    """The server log, opened for appending with a line saying whose server starts;
    a log grown past `SERVER_LOG_MAX_BYTES` is moved to ``.1`` first."""
    path = server_log()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if path.stat().st_size > SERVER_LOG_MAX_BYTES:
            path.replace(path.with_name(path.name + ".1"))
    except FileNotFoundError:
        pass
    out = path.open("ab")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    out.write(f"--- {stamp} temporary server of pid {parent}\n".encode())
    out.flush()
    return out



class _WithDeathSignal:
    """The ``subprocess`` module as Prefect's server module sees it while it starts
    the server: `Popen` of a command that dies with this process and writes to the
    server log, everything else unchanged (the server's command, ``python -m uvicorn
    ARGS``, is run `tied`)."""

    def __init__(self, parent: int):
        self._parent = parent

    def Popen(self, args: Any, **kwargs: Any) -> subprocess.Popen:  # noqa: N802 - the module's name
        args = list(args)
        if args[1:3] == ["-m", "uvicorn"]:
            args = tied(args, self._parent)
        else:
            kwargs.setdefault("preexec_fn", death_signal_preexec(self._parent))
        if kwargs.get("stdout") is None and kwargs.get("stderr") is None:
            with _open_server_log(self._parent) as out:  # the child keeps its own copy
                kwargs.update(stdout=out, stderr=subprocess.STDOUT)
                return subprocess.Popen(args, **kwargs)
        return subprocess.Popen(args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


def tie_temporary_server() -> bool:
    """Start Prefect's temporary server now, so that it dies with this process; True
    if this call started it. Nothing to do when ``PREFECT_API_URL`` names a server,
    when one is already running, off Linux, or outside the main thread."""
    from prefect.settings import PREFECT_API_URL  # noqa: PLC0415

    if PREFECT_API_URL.value() or not sys.platform.startswith("linux"):
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    import prefect.server.api.server as server_module  # noqa: PLC0415

    base = server_module.SubprocessASGIServer
    current = base._instances.get(None)
    if current is not None and current.running:
        return False

    class TiedServer(base):  # type: ignore[misc, valid-type]
        def _run_uvicorn_command(self) -> subprocess.Popen:
            real = server_module.subprocess
            server_module.subprocess = _WithDeathSignal(os.getpid())
            try:
                return super()._run_uvicorn_command()
            finally:
                server_module.subprocess = real

    base._instances.pop(None, None)
    server = TiedServer()  # registered as Prefect's default instance (port None)
    server.start()
    log.info("Prefect's temporary server: %s (pid %d), stopped with this process; its "
             "log: %s", server.api_url,
             server.server_process.pid if server.server_process else -1, server_log())
    return True


def api_unreachable(url: str | None = None, timeout: float = 5.0) -> str | None:
    """Why no Prefect API answers at ``url`` (default: ``PREFECT_API_URL`` of the
    environment), or None if one does or none is named (the temporary server will
    be started). Any HTTP answer counts: a server is there. Read from the
    environment, not Prefect's settings, whose import writes ``PREFECT_HOME``."""
    url = url if url is not None else os.environ.get("PREFECT_API_URL")
    return unanswered(url, timeout) if url else None
