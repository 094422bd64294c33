"""Threads that must end before the interpreter finalizes, and a record of the
threads a process leaves alive at its exit.

Why: on Python 3.11 a daemon thread still running when the interpreter finalizes is
ended by ``pthread_exit`` as soon as it asks for the GIL again. When a C++ frame is
on its stack (matplotlib's ft2font reading a font through a Python callback, a torch
op that released the GIL, anything bound with pybind11), the forced unwind reaches a
``noexcept`` frame and ends in ``std::terminate``: "terminate called without an
active exception", SIGABRT, exit status -6, after the process had done all its work
and printed its report (pytorch/pytorch#117762; `workers.group_exit` for the
torch.distributed case). `diloco run` ended this way under load: the train job's
MLflow thread was still drawing the run's plots (and would then have exported the
model with torch) when ``MlflowHooks.close()`` stopped waiting for it, its 15 s
timeout spent, and the command returned.

`join_before_exit` keeps such a thread from outliving the interpreter: an ``atexit``
hook joins it. ``atexit`` hooks run before finalization, the last registered first,
so one registered when its thread is given up on runs before the hooks registered
earlier (MLflow's, Prefect's temporary server's) whose state the thread may still
use. The thread's owner first tells it to start nothing new, so the wait is the rest
of what it is doing (a plot, an export, one request: bounded by the HTTP timeouts).

`record_threads_at_exit`: with ``DILOCO_THREADS_AT_EXIT`` naming a directory, the
threads still alive at the very end of the process (after every other ``atexit``
hook) and their stacks go to ``<dir>/<pid>.json``: what the tests check.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: How long the process's exit waits for a thread given up on before it gives up in
#: turn (and may then abort as above): far more than a plot, an export or a request.
EXIT_JOIN_S = 300.0

#: Where `record_threads_at_exit` writes (a directory); unset: nothing is recorded.
RECORD_ENV = "DILOCO_THREADS_AT_EXIT"


def join_thread(thread: threading.Thread, limit: float = EXIT_JOIN_S) -> bool:
    """Wait (at most ``limit`` seconds) for ``thread`` to end; True if it has."""
    if thread is threading.current_thread() or not thread.is_alive():
        return True
    start = time.monotonic()
    thread.join(limit)
    if thread.is_alive():
        log.warning("thread %s still running %.0f s into the exit; exiting without it",
                    thread.name, time.monotonic() - start)
        return False
    return True


def join_before_exit(thread: threading.Thread, limit: float = EXIT_JOIN_S) -> None:
    """Have the process's exit wait for ``thread`` (at most ``limit`` seconds) before
    the interpreter finalizes. Called from an ``atexit`` hook, where a new hook would
    never run, the caller joins the thread itself (`join_thread`)."""
    if thread.is_alive():
        atexit.register(join_thread, thread, limit)


def python_threads() -> list[dict[str, Any]]:
    """The Python threads alive now, other than the calling one: name, daemon, and
    the files and functions of their stack, innermost last."""
    frames = sys._current_frames()  # noqa: SLF001 - the only way to read another thread's stack
    found = []
    for thread in threading.enumerate():
        if thread is threading.current_thread() or not thread.is_alive():
            continue
        frame = frames.get(thread.ident or -1)
        stack = [f"{s.filename}:{s.lineno} {s.name}"
                 for s in (traceback.extract_stack(frame) if frame is not None else [])]
        found.append({"name": thread.name, "daemon": thread.daemon, "stack": stack})
    return found


def _write_record(where: str) -> None:
    try:
        out = Path(where)
        out.mkdir(parents=True, exist_ok=True)
        body = {"pid": os.getpid(), "argv": sys.argv, "threads": python_threads()}
        (out / f"{os.getpid()}.json").write_text(json.dumps(body, indent=1))
    except Exception as exc:  # noqa: BLE001 - a test aid never changes how a process ends
        print(f"{RECORD_ENV}: {type(exc).__name__}: {exc}", file=sys.stderr)


def record_threads_at_exit() -> None:
    """With ``DILOCO_THREADS_AT_EXIT`` set, record the threads alive at this process's
    exit. Call it early: the first ``atexit`` hook registered is the last run."""
    where = os.environ.get(RECORD_ENV, "").strip()
    if where:
        atexit.register(_write_record, where)
