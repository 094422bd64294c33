"""The jobs' memory policy (workers/memory.py): glibc's mmap threshold is fixed
unless the user chose one in the environment."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from workers.memory import fixed_mmap_threshold


def test_a_threshold_in_the_environment_is_the_users_choice(monkeypatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert fixed_mmap_threshold() is False


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_the_threshold_is_fixed_on_glibc_in_a_fresh_process() -> None:
    """Fixed in a fresh process, and the aggregator job imports it without the model
    (no FSDP, no data pipeline)."""
    code = ("import sys, os; os.environ.pop('MALLOC_MMAP_THRESHOLD_', None); "
            "from workers.memory import fixed_mmap_threshold as f; import flows.aggregator; "
            "print(f(), 'workers.loop' in sys.modules, "
            "'torch.distributed.fsdp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True", "False", "False"]


def test_a_replicated_worker_loads_no_fsdp_nor_dcp() -> None:
    """The training loop imports FSDP2, DTensor and torch DCP only for a sharded island
    (they cost about 47 MiB of every worker process that would never use them)."""
    code = ("import sys; import workers.loop; print(sorted({m.split('.')[2] for m in "
            "sys.modules if m.startswith(('torch.distributed.fsdp', "
            "'torch.distributed.checkpoint', 'torch.distributed.tensor'))}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"
