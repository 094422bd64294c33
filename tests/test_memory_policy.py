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


_LOADED = ("sorted({m.split('.')[2] for m in sys.modules if m.startswith(("
           "'torch.distributed.fsdp', 'torch.distributed.checkpoint', "
           "'torch.distributed.tensor'))})")


def test_a_worker_loads_fsdp_and_dcp_at_its_first_checkpoint() -> None:
    """Importing the training loop (and workers.checkpoint, workers.island) imports no
    FSDP2, DTensor or torch DCP: a worker pays for them (about 47 MiB and 0.75 s of
    start-up) at its first checkpoint save or load, or when it builds a sharded
    island, not before. Then, in the same fresh process, one small checkpoint saved
    through workers.checkpoint does load DCP (so this cannot pass by never saving)."""
    code = ("import sys; import workers.loop, workers.checkpoint, workers.island; "
            f"print({_LOADED}); "
            "import torch; from storage.objectstore import ObjectStore; "
            "from workers import checkpoint; from workers.island import Island; "
            "model = torch.nn.Linear(2, 2); opt = torch.optim.AdamW(model.parameters()); "
            "store = ObjectStore('memory://diloco-test-memory-policy'); "
            "saved = checkpoint.save(store, 'solo', 1, Island(model, None, 0, 1), opt, "
            "{'tokens': 1}); "
            f"print(saved, {_LOADED})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == "[]"
    saved, loaded = out[1].split(" ", 1)
    assert saved == "True" and "'checkpoint'" in loaded  # DCP (it pulls in the other two)
