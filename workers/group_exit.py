"""How a process that belonged to a torch.distributed group ends.

A rank of an island (or of the data-parallel baseline) that has finished, and
destroyed its process group, can still be killed by SIGABRT on its way out: the
group's C++ objects live on while Python objects refer to them (an FSDP model's
device mesh, an island's flag group), so their worker threads are still there when
the interpreter finalizes, and a thread that drops its last reference to a finished
collective then takes the GIL, which finalization answers with ``pthread_exit``; the
forced unwind through a C++ frame ends in ``std::terminate`` ("terminate called
without an active exception"). The process's result was already printed, but its
exit status says it crashed, and torchrun, a launcher and Prefect believe it. (Seen
once in CI in a two-rank gloo test; the same race is reported against torch for
gloo workers at exit.)

Such a process has nothing left to finalize once its output is flushed, so it leaves
with ``os._exit`` instead: no interpreter teardown, so no race. Only processes that
initialised a group do this; every other exit stays ordinary.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn


def exit_after_group(code: int) -> NoReturn:
    """Flush stdout, stderr and the logging handlers, then end the process with
    ``code`` without interpreter finalization (see the module docstring)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing to say
            stream.flush()
    os._exit(code)


def in_group() -> bool:
    """Whether this process was started as one rank of several (torchrun's env)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def leave(status: int) -> NoReturn:
    """End a command-line job with ``status``: through `exit_after_group` when it is
    a rank of a group, else as any program exits."""
    if in_group():
        exit_after_group(status)
    sys.exit(status)
