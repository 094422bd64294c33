"""A process's memory policy: what the worker and the aggregator jobs set at start.

Kept apart from the training code so the aggregator job can use it without
importing the model, the data pipeline or torch's FSDP and checkpoint machinery.
"""

from __future__ import annotations

import ctypes
import os

#: glibc's M_MMAP_THRESHOLD, and the value a worker sets (`fixed_mmap_threshold`)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 8 << 20


def fixed_mmap_threshold(size: int = MMAP_THRESHOLD) -> bool:
    """Give every allocation of ``size`` bytes or more pages of its own, returned to
    the system when it is freed (glibc; elsewhere nothing happens, and False).

    glibc raises its threshold to the size of any large block freed (up to 32 MiB),
    after which fragment-sized arrays (a send's delta and decoded value, a mean,
    allocated by the encoder and poller threads in arenas of their own) come from
    heaps that keep their pages once freed, and a worker's peak RSS holds several
    times the model's size of freed memory (measured: docs/worker.md, Memory). A
    fixed threshold keeps the small tensors of
    a training step on the heap (reused step after step, no page faults) and sends
    the fragment-sized ones to the system. A ``MALLOC_MMAP_THRESHOLD_`` in the
    environment is the user's choice and wins."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, size))
