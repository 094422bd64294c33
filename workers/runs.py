"""Creating a training run from a RunConfig: data, model, manifest; and continuing one.

The dataset is prepared from ``data.sources`` when it does not exist yet (the
embedded default reads the installed Shakespeare corpus), the model is built from
its seed, and the run manifest stores the whole resolved config, so that a worker
needs nothing but the run's URL to train.

Continuing a run for more steps (what a schedule does) creates a NEW run whose
initial parameters are the canonical model of the old one (a run's length is fixed
in its manifest): `continuation` gives its config, `latest_run` finds the newest
finished run of a name, and ``create_run(init_from=...)`` starts from it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from diloco.run import load_canonical, new_run, open_run, plan_for
from storage import layout
from storage.exchange import Exchange
from storage.objectstore import ObjectStore
from storage.reach import REACH_POLICY
from workers.config import ConfigError, RunConfig, load_config
from workers.data.errors import DatasetMissing
from workers.data.prepare import prepare_data
from workers.data.streams import TokenDataset, WorkerStream, check_val, open_dataset
from workers.hf_weights import load_hf_state_dict, read_safetensors
from workers.locate import absolute
from workers.model import Transformer, build_model, describe
from workers.report import snapshot
from workers.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


def ensure_dataset(
    cfg: RunConfig,
    run_url: str,
    *,
    storage_options: dict | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> str:
    """The dataset URL of the run, preparing the dataset from the sources if absent
    (token shards are indexed where they are, see `workers.data`). The tokenizer's
    vocabulary must fit the model's, checked before anything is written; a shard
    shorter than one sequence is refused by the preparation, before it writes."""
    url = cfg.dataset_url(run_url)
    vocab = cfg.model_config_resolved.vocab_size
    try:
        dataset = open_dataset(url, storage_options)
    except DatasetMissing:
        tok = load_tokenizer(cfg.data.tokenizer)
        _fits(tok.vocab_size, f"data.tokenizer {tok.name}", vocab)
        log.info("preparing the dataset at %s from %s", url, ", ".join(cfg.data.sources))
        prepare_data(cfg.data.sources, url, tokenizer=cfg.data.tokenizer,
                     val_fraction=cfg.data.val_fraction, storage_options=storage_options,
                     progress=progress, dtype=cfg.data.dtype, column=cfg.data.column,
                     min_tokens=cfg.data.seq_len + 1)
        try:
            _usable(open_dataset(url, storage_options), cfg)
        except ConfigError:
            if cfg.data.dataset is None:  # the run's own, just prepared: leave no half run
                ObjectStore(run_url, storage_options=storage_options).delete_prefix(
                    layout.DATASET)
            raise
    else:
        _fits(dataset.vocab_size, f"the dataset at {url} (tokenizer {dataset.tokenizer_spec})",
              vocab)
        _usable(dataset, cfg)
    return url


def _usable(dataset: TokenDataset, cfg: RunConfig) -> None:
    """Every data slot and the val split hold a sequence: checked before the run is
    created, since the jobs would otherwise fail as they start. Sizes only: no
    token is read."""
    seq, split = cfg.data.seq_len, cfg.data.split
    slots = (len(cfg.workers) if cfg.train.strategy == "data_parallel"
             else cfg.data.slot_count(len(cfg.workers)))
    try:
        for slot in range(slots):
            WorkerStream(dataset, slot, slots, split=split, seq_len=seq, batch_size=1,
                         blocks=cfg.data.slot_blocks)
        check_val(dataset, seq)
    except ValueError as exc:
        raise ConfigError(f"data: {exc}") from None


def _fits(data_vocab: int, what: str, model_vocab: int) -> None:
    if data_vocab > model_vocab:
        raise ConfigError(
            f"{what} has a vocabulary of {data_vocab} ids, more than the model's vocab_size "
            f"{model_vocab}: set model vocab_size >= {data_vocab} (model.overrides or the "
            "hf_config), or use the tokenizer the model was made for")


def create_run(
    cfg: RunConfig,
    run_url: str,
    *,
    storage_options: dict | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    model: Transformer | None = None,
    init_from: str | None = None,
) -> Exchange:
    """Create the run at ``run_url`` (RunExists if one is there already).

    The initial parameters are those of ``model`` when given, else the canonical
    model of the run at ``init_from`` (a continuation), else the pretrained weights
    of ``model.init_from`` (read and checked before anything is written), else a
    fresh model from ``train.seed``.
    """
    built = model is None
    if model is None:
        model = build_model(cfg.model_config_resolved, seed=cfg.train.seed)
        if not init_from and cfg.model.init_from:
            _load_pretrained(model, cfg.model.init_from, storage_options)
    ensure_dataset(cfg, run_url, storage_options=storage_options, progress=progress)
    if built and init_from:
        parent = open_run(init_from, storage_options, retry=REACH_POLICY)
        # the parent's own fragments (its P, or whole tensors for a run from before
        # fragments could split them), which the continuation may change
        parent_sync = RunConfig.stored(parent.manifest.config).sync
        applied = load_canonical(parent, plan_for(model, parent_sync), model)
        log.info("starting from the canonical model of %s (rounds per fragment: %s)",
                 init_from, applied)
    plan = plan_for(model, cfg.sync)
    log.info("model: %s", describe(model))
    for frag in plan.fragments:
        log.info("fragment %d: %d parameters in %d tensors", frag.index, frag.numel,
                 len(frag.params))
    store = ObjectStore(run_url, storage_options=storage_options)
    return new_run(store, model, cfg.sync, workers=cfg.workers, total_steps=cfg.train.steps,
                   plan=plan, user_config=cfg.model_dump(mode="json"))


def _load_pretrained(model: Transformer, url: str, storage_options: dict | None) -> None:
    """Load Hugging Face safetensors at ``url`` into ``model``; ConfigError naming
    ``model.init_from`` when they cannot be read or do not fit the config."""
    try:
        load_hf_state_dict(model, read_safetensors(url, storage_options), source=url)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.{exc}" if str(exc).startswith("init_from") else
                          f"model.init_from {url}: {exc}") from None
    log.info("starting from the pretrained weights at %s", url)


def latest_run(store: str, name: str, storage_options: dict | None = None) -> str:
    """The newest run ``<store>/<name>-<time>`` whose aggregator finished."""
    root = ObjectStore(absolute(store), storage_options=storage_options)
    pattern = re.compile(rf"^{re.escape(name)}-\d{{8}}-\d{{6}}(-\d+)?$")
    base = root.fs_path("run.json").rsplit("/", 1)[0]  # the root's path in its filesystem
    try:
        entries = root.fs.ls(base, detail=False)
    except FileNotFoundError:
        entries = []
    names = sorted((e.rstrip("/").rsplit("/", 1)[-1] for e in entries), reverse=True)
    for candidate in (n for n in names if pattern.match(n)):
        url = f"{root.url.rstrip('/')}/{candidate}"
        try:
            snap = snapshot(open_run(url, storage_options, retry=REACH_POLICY))
        except Exception:  # noqa: BLE001 - not a run, or half-created
            continue
        if snap["aggregator"].get("state") == "finished":
            return url
    raise ConfigError(f"resume_run=latest: no finished run named {name}-<time> under {store}")


def continuation(parent_url: str, overrides: list[str] | None = None,
                 extra_steps: int | None = None,
                 storage_options: dict | None = None) -> RunConfig:
    """The config of a run continuing ``parent_url``: its config, the overrides,
    ``train.steps = extra_steps``, its dataset, and a new data seed."""
    parent = open_run(parent_url, storage_options, retry=REACH_POLICY)
    # the parent's values in force (an old run's flat sync keys nested), so an
    # override names the new keys; dependent defaults are the parent's, not redone
    cfg_parent = RunConfig.stored(parent.manifest.config)
    tree = cfg_parent.model_dump(mode="json")
    items = list(overrides or [])
    if extra_steps is not None:
        items.append(f"train.steps={int(extra_steps)}")
    if not any(o.split("=", 1)[0].strip() == "train.seed" for o in items):
        items.append(f"train.seed={cfg_parent.train.seed + 1}")  # new batches, same data
    if not any(o.split("=", 1)[0].strip() == "data.dataset" for o in items):
        items.append(f"data.dataset={cfg_parent.dataset_url(parent_url)}")
    items.append(f"parent_run={parent_url}")
    return load_config({k: v for k, v in tree.items() if k != "parent_run"}, items)
