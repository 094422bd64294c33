"""Streaming DiLoCo with eager updates, exchanged through object storage.

The public API, usable from any PyTorch training loop::

    from diloco import SyncConfig, Synchronizer, Aggregator, new_run, open_run, plan_for

    cfg = SyncConfig(mode="streaming", sync_every=50, fragments=2, overlap=1,
                     codec_up="int4", codec_down="int8")
    new_run("s3://bucket/runs/r1", model, cfg, workers=["eu", "us"], total_steps=1000)

    # in each region
    ex = open_run("s3://bucket/runs/r1")
    sync = Synchronizer(model, ex, "eu", plan_for(model, cfg))
    for batch in data:
        loss = model(batch).loss; loss.backward(); opt.step(); opt.zero_grad()
        sync.step(tokens=batch.numel())
    sync.finish()

    # anywhere
    Aggregator(open_run("s3://bucket/runs/r1")).run()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: The public names and the module of each, imported on first use: a submodule
#: such as ``diloco.arithmetic`` (the ``diloco estimate`` command's) then loads
#: without torch, which the names below need.
_PUBLIC = {
    "Aggregator": "diloco.aggregator",
    "FragmentPlan": "diloco.fragments",
    "Schedule": "diloco.schedule",
    "SyncConfig": "diloco.config",
    "Synchronizer": "diloco.synchronizer",
    "load_canonical": "diloco.run",
    "new_run": "diloco.run",
    "open_run": "diloco.run",
    "plan_for": "diloco.run",
    "plan_fragments": "diloco.fragments",
}

if TYPE_CHECKING:
    from diloco.aggregator import Aggregator
    from diloco.config import SyncConfig
    from diloco.fragments import FragmentPlan, plan_fragments
    from diloco.run import load_canonical, new_run, open_run, plan_for
    from diloco.schedule import Schedule
    from diloco.synchronizer import Synchronizer


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'diloco' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "Aggregator",
    "FragmentPlan",
    "Schedule",
    "SyncConfig",
    "Synchronizer",
    "load_canonical",
    "new_run",
    "open_run",
    "plan_for",
    "plan_fragments",
]
