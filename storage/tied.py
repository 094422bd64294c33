"""Child processes that die with the process that launched them.

A server a test or a command starts for itself (SeaweedFS, Prefect's temporary API
server) must not outlive a launcher killed with SIGKILL, which runs no cleanup. On
Linux the kernel sends a signal of the child's choosing when its parent dies
(``prctl(PR_SET_PDEATHSIG)``); the setting survives ``execv``.

`tied` wraps a command so that the new process asks for that signal itself, exits if
its launcher already died before it asked, then becomes the command. No Python code
of the launcher runs between fork and exec, which a ``preexec_fn`` would do (unsafe
while other threads run: the live progress display has one). `death_signal_preexec`
is the ``preexec_fn`` form, for a caller that cannot rewrite the command.

The signal is sent when the *thread* that started the child ends, so a launcher
starts tied children from its main thread.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable, Sequence

PR_SET_PDEATHSIG = 1

#: ``python -c BOOT PARENT PROGRAM ARGS...``
_BOOT = (
    "import ctypes, os, signal, sys\n"
    f"ctypes.CDLL(None, use_errno=True).prctl({PR_SET_PDEATHSIG}, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def tied(argv: Sequence[str], parent: int | None = None) -> list[str]:
    """``argv`` (its program a path) as a command that gets SIGTERM when ``parent``
    (default: this process) dies."""
    return [sys.executable, "-c", _BOOT, str(parent or os.getpid()), *argv]


def death_signal_preexec(parent: int) -> Callable[[], None]:
    """A ``preexec_fn`` doing what `tied` does (libc is looked up here, before the
    fork: the child only calls it)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return preexec
