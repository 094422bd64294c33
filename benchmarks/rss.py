"""A process's resident memory, read from ``/proc`` (Linux): the current size, the
peak, and a reset of the peak, so a benchmark phase measures only its own peak (the
objects it made to measure with are not the store's)."""

from __future__ import annotations


def status(field: str) -> int:
    """A size field of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


def reset_peak() -> int:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS, which it returns."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")
