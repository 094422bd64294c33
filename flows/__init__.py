"""flows: orchestration (Prefect): the train, worker and aggregator jobs and flows,
the launchers, the cancel request.

A job a local launcher starts (``python -m flows.worker ... --exit-with-parent``)
must not outlive it. Python imports this package before the job's own module, so
the launcher's pid is noted here, before Prefect, torch and MLflow take seconds to
import: a launcher that dies during those imports is still noticed. The launcher
passes its pid in ``DILOCO_LAUNCHER_PID``; if the parent is another process (or
init, when no pid was passed) already, the launcher died before the job even
started, and the job exits at once with status 143 (stopped), having written
nothing. A launcher may itself be pid 1: `docker run IMAGE diloco run`, or a
container of a docker work pool running its flow run.
"""

from __future__ import annotations

import os
import sys

#: Exit status of a job whose launcher was gone before it started (as stopped).
EXIT_ORPHANED = 143


def _note_launcher() -> int | None:
    """The launcher's pid if this process is a job started with --exit-with-parent."""
    if "--exit-with-parent" not in sys.argv[1:]:
        return None
    parent = os.getppid()
    expected = os.environ.pop("DILOCO_LAUNCHER_PID", "")
    orphaned = int(expected) != parent if expected.isdigit() else parent == 1
    if orphaned:
        sys.stderr.write(f"the launcher (pid {expected or '?'}) is gone before this job "
                         f"started; exiting\n")
        sys.stderr.flush()
        os._exit(EXIT_ORPHANED)
    return parent


#: The pid of the process that launched this job, noted before any slow import
#: (None unless this process was started with --exit-with-parent).
LAUNCHER_PID: int | None = _note_launcher()


def launcher_gone() -> bool:
    """True if this job was started with --exit-with-parent and its launcher died."""
    return LAUNCHER_PID is not None and os.getppid() != LAUNCHER_PID
