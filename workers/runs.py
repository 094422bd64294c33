"""Creating a training run from a RunConfig: data, model, manifest.

The dataset is prepared from ``data.sources`` when it does not exist yet (the
embedded default reads the installed Shakespeare corpus), the model is built from
its seed, and the run manifest stores the whole resolved config, so that a worker
needs nothing but the run's URL to train.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from diloco.run import new_run, plan_for
from storage.exchange import Exchange
from storage.objectstore import ObjectStore
from workers.config import RunConfig
from workers.data.errors import DatasetMissing
from workers.data.prepare import prepare_data
from workers.data.streams import open_dataset
from workers.model import Transformer, build_model, describe

log = logging.getLogger(__name__)


def ensure_dataset(
    cfg: RunConfig,
    run_url: str,
    *,
    storage_options: dict | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> str:
    """The dataset URL of the run, preparing the dataset from the sources if absent."""
    url = cfg.dataset_url(run_url)
    try:
        open_dataset(url, storage_options)
    except DatasetMissing:
        log.info("preparing the dataset at %s from %s", url, ", ".join(cfg.data.sources))
        prepare_data(cfg.data.sources, url, tokenizer=cfg.data.tokenizer,
                     val_fraction=cfg.data.val_fraction, storage_options=storage_options,
                     progress=progress)
    return url


def create_run(
    cfg: RunConfig,
    run_url: str,
    *,
    storage_options: dict | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    model: Transformer | None = None,
) -> Exchange:
    """Create the run at ``run_url`` (RunExists if one is there already).

    The initial parameters are those of ``model`` when given (a continuation starts
    from another run's canonical model), else of a fresh model from ``train.seed``.
    """
    ensure_dataset(cfg, run_url, storage_options=storage_options, progress=progress)
    if model is None:
        model = build_model(cfg.model_config_resolved, seed=cfg.train.seed)
    plan = plan_for(model, cfg.sync)
    log.info("model: %s", describe(model))
    for frag in plan.fragments:
        log.info("fragment %d: %d parameters in %d tensors", frag.index, frag.numel,
                 len(frag.params))
    store = ObjectStore(run_url, storage_options=storage_options)
    return new_run(store, model, cfg.sync, workers=cfg.workers, total_steps=cfg.train.steps,
                   plan=plan, user_config=cfg.model_dump(mode="json"))
