"""Streaming DiLoCo with eager updates, exchanged through object storage.

The public API, usable from any PyTorch training loop::

    from diloco import SyncConfig, Synchronizer, Aggregator, new_run, open_exchange, plan_for

    cfg = SyncConfig(mode="streaming", sync_every=50, fragments=2, overlap=1,
                     codec_up="int4", codec_down="int8")
    new_run("s3://bucket/runs/r1", model, cfg, workers=["eu", "us"], total_steps=1000)

    # in each region
    ex = open_exchange("s3://bucket/runs/r1")
    sync = Synchronizer(model, ex, "eu", plan_for(model, cfg))
    for batch in data:
        loss = model(batch).loss; loss.backward(); opt.step(); opt.zero_grad()
        sync.step(tokens=batch.numel())
    sync.finish()

    # anywhere
    Aggregator(open_exchange("s3://bucket/runs/r1")).run()
"""

from diloco.aggregator import Aggregator
from diloco.config import SyncConfig
from diloco.fragments import FragmentPlan, plan_fragments
from diloco.replica import Synchronizer
from diloco.run import load_canonical, new_run, open_exchange, plan_for
from diloco.schedule import Schedule

__all__ = [
    "Aggregator",
    "FragmentPlan",
    "Schedule",
    "SyncConfig",
    "Synchronizer",
    "load_canonical",
    "new_run",
    "open_exchange",
    "plan_for",
    "plan_fragments",
]
