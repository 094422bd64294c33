"""The parts one worker trains with, opened and built in one place.

`build` opens the run's stores and exchange, reads the run's config, takes the
worker's seat (a joiner waits for admission here), builds the model, its fragment
plan and its island, the data stream and validation batches, the inner optimizer and
the schedule, and returns them as one frozen `Parts`. The training loop
(`workers.loop.WorkerLoop`) takes them as given, so a reader sees in one screen what
a worker is made of and in what order it is built, apart from how it trains.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from diloco.fragments import FragmentPlan
from diloco.run import open_run, plan_for
from diloco.schedule import Schedule
from storage.exchange import Exchange
from storage.objectstore import ObjectStore
from workers import elastic, report
from workers.config import RunConfig
from workers.data.streams import WorkerStream, open_dataset, val_batches
from workers.group import Group
from workers.inner import make_optimizer, pick_device
from workers.island import Island
from workers.island import make as make_island
from workers.memory import fixed_mmap_threshold
from workers.model import build_model, describe
from workers.progress import Reporter
from workers.status import StatusBoard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Parts:
    """One worker's parts. The objects are live (the model trains, the stream
    advances); which objects they are does not change once built.

    ``store`` carries the exchange traffic the product reports; ``ckpt_store`` the
    worker's checkpoints, through its own client so that their bytes are counted
    apart."""

    worker: str
    group: Group
    cfg: RunConfig
    store: ObjectStore
    ckpt_store: ObjectStore
    exchange: Exchange
    reporter: Reporter
    seat: elastic.Seat
    device: torch.device
    model: torch.nn.Module
    plan: FragmentPlan
    island: Island
    stream: WorkerStream
    val: list[tuple[torch.Tensor, torch.Tensor]]
    opt: torch.optim.Optimizer
    schedule: Schedule


def build(run_url: str, worker: str, *, storage_options: dict | None = None,
          group: Group | None = None, join: bool = False, claim: str | None = None) -> Parts:
    """Open and build ``worker``'s parts in run ``run_url``.

    ``worker`` "auto": the data-parallel baseline, where rank i is the manifest's
    worker i. ``join``: the worker is not one of the manifest's workers and joins the
    running run (``claim``: the id of its membership record, so a relaunch of the same
    join is told from a second joiner taking the name). A worker that is not a member
    fails in one line before the dataset is opened or the model built."""
    group = group or Group()
    if worker == "auto":
        worker = open_run(
            ObjectStore(run_url, storage_options=storage_options)
        ).manifest.workers[group.rank]
    store = ObjectStore(run_url, storage_options=storage_options, name=worker)
    ckpt_store = ObjectStore(run_url, storage_options=storage_options,
                             name=f"{worker}-checkpoints")
    exchange = open_run(store)
    manifest = exchange.manifest
    cfg = RunConfig.stored(manifest.config)
    board = StatusBoard(
        ObjectStore(run_url, storage_options=storage_options, name=f"{worker}-status"),
        worker, background=True, renew_s=max(0.5, cfg.sync.liveness.lease_s / 4))
    reporter = Reporter(board, report.party_meter(cfg, worker, [store, ckpt_store], board),
                        store, cfg)
    device = pick_device(cfg)
    fixed_mmap_threshold()
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)

    seat = elastic.take_seat(
        store, manifest, cfg, worker, join=join, claim=claim,
        on_wait=lambda: reporter.status("joining", force=True, note="waiting for admission"))
    dataset = open_dataset(cfg.dataset_url(run_url), storage_options)
    mcfg = cfg.model_config_resolved
    if dataset.vocab_size > mcfg.vocab_size:
        raise ValueError(
            f"the dataset's vocabulary ({dataset.vocab_size}) is larger than the "
            f"model's vocab_size ({mcfg.vocab_size})"
        )
    model = build_model(mcfg, seed=cfg.train.seed).to(device)
    plan = plan_for(model, cfg.sync)
    plan.check_against([f.model_dump() for f in manifest.fragments])
    if group.leader:
        log.info("worker %s: model %s", worker, describe(model))
        for frag in plan.fragments:
            log.info("worker %s: fragment %d: %d parameters in %d tensors (%s ...)",
                     worker, frag.index, frag.numel, len(frag.params),
                     ", ".join(frag.names[:3]))
    # train.island fsdp: the model is sharded over the island's ranks from here on
    island = make_island(model, plan, exchange,
                         cfg.train.island if cfg.train.strategy == "diloco" else "replicate",
                         group.rank, group.size, cfg.sync.schedule.auto)

    b, size = seat.batch_size, group.size
    dp = cfg.train.strategy == "data_parallel"
    if dp and size not in (1, len(manifest.workers)):
        raise ValueError(
            f"train.strategy data_parallel runs one process per worker: "
            f"{len(manifest.workers)} workers but {size} processes"
        )
    if not dp and b % size:
        raise ValueError(
            f"data.batch_size = {b} must be divisible by the island's {size} processes"
        )
    stream_index, stream_count = seat.slot, seat.slots
    if dp:  # the baseline: rank i of M reads share i of M
        stream_index, stream_count = manifest.workers.index(worker), len(manifest.workers)
    stream = WorkerStream(
        dataset, stream_index, stream_count, split=cfg.data.split,
        seq_len=cfg.data.seq_len, batch_size=b, seed=cfg.train.seed,
        blocks=cfg.data.slot_blocks,
    )
    val = val_batches(dataset, seq_len=cfg.data.seq_len, batch_size=b,
                      num_batches=cfg.train.eval_batches)
    return Parts(
        worker=worker, group=group, cfg=cfg, store=store, ckpt_store=ckpt_store,
        exchange=exchange, reporter=reporter, seat=seat, device=device, model=model,
        plan=plan, island=island, stream=stream, val=val, opt=make_optimizer(model, cfg),
        schedule=Schedule.of(cfg.sync.schedule),
    )
