"""The canonical model evaluated on the run's validation batches, for the aggregator
job: what each round's report and MLflow show as the run's eval loss."""

from __future__ import annotations

import torch

from diloco.aggregator import Aggregator
from diloco.run import plan_for
from storage import layout
from storage.checkpoints import read_checkpoint
from storage.exchange import Exchange
from storage.objectstore import ObjectStore
from workers.config import RunConfig
from workers.data.streams import open_dataset, val_batches
from workers.inner import evaluate
from workers.model import build_model


class CanonicalEval:
    """The canonical model on the run's validation batches: the aggregator's own
    (K = 1), or, with a sharded aggregator (each shard holds a slice), the whole
    canonical checkpoints shard 0 assembles from the K parts (`at`)."""

    def __init__(self, exchange: Exchange, run_url: str, storage_options: dict | None):
        cfg = RunConfig.stored(exchange.manifest.config)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.model = build_model(cfg.model_config_resolved, seed=cfg.train.seed)
        self.plan = plan_for(self.model, cfg.sync)
        self.plan.check_against([f.model_dump() for f in exchange.manifest.fragments])
        dataset = open_dataset(cfg.dataset_url(run_url), storage_options)
        self.val = val_batches(dataset, seq_len=cfg.data.seq_len,
                               batch_size=cfg.data.batch_size,
                               num_batches=cfg.train.eval_batches)

    def __call__(self, agg: Aggregator) -> float:
        return self.of([agg.canonical(p) for p in range(len(self.plan))])

    def of(self, fragments: list) -> float:
        """The eval loss of the model made of these fragments (flat float32 each)."""
        for p, flat in enumerate(fragments):
            self.plan.scatter(self.model, p, torch.as_tensor(flat))
        return evaluate(self.model, self.val, torch.device("cpu"))

    def at(self, store: ObjectStore, rounds: list[int]) -> float | None:
        """The eval loss of the canonical model after round ``rounds[p]`` of every
        fragment ``p``, read from its whole checkpoints (None while one is not
        committed, or when retention deleted it)."""
        keys = [layout.global_commit(p, r) for p, r in enumerate(rounds)]
        if not all(store.exists(k) for k in keys):
            return None
        return self.of([read_checkpoint(store, k)[0]["params"] for k in keys])
