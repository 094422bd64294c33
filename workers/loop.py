"""The inner loop of one worker (one training island in one region).

AdamW with linear warmup and cosine decay, gradient clipping and accumulation, bf16
autocast on GPU (float32 on CPU), evaluation every N steps, the synchroniser called
after every inner step, checkpoints every K steps and on SIGTERM, metrics through a
callback (no MLflow here).

Two strategies:
- ``diloco``: Streaming DiLoCo through the run's store (the product).
- ``data_parallel``: the baseline users would otherwise pick: the same model, data
  and token budget, gradients all-reduced every step through torch.distributed
  (gloo on CPU, NCCL on GPU), one process per worker.

An island may be several processes under torchrun doing data parallel inside the
region: every rank computes its slice of the island's batch, gradients are
averaged inside the island, and rank 0 alone talks to the store, broadcasting each
fragment after it merges.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from diloco.run import load_initial, open_run, plan_for
from diloco.schedule import Schedule
from diloco.synchronizer import Behind, MergeAbandoned, Synchronizer
from storage.objectstore import ObjectStore
from workers import checkpoint, elastic, report
from workers.config import RunConfig
from workers.data.streams import WorkerStream, open_dataset, val_batches
from workers.inner import (
    evaluate,
    inner_step,
    lr_at,
    make_optimizer,
    pick_device,
    to_device,
)
from workers.island import ShardedIsland
from workers.island import make as make_island
from workers.losslog import LossLog
from workers.memory import fixed_mmap_threshold
from workers.model import build_model, describe
from workers.status import StatusBoard

log = logging.getLogger(__name__)

Metrics = Callable[[dict[str, Any]], None]
#: steps whose seconds give a worker's usual step (its status's ``step_s``)
PACE_STEPS = 32


class Interrupted(Exception):
    """The worker was asked to stop (SIGTERM). ``step`` is the step it resumes from:
    the checkpoint it saved on the way out, or, when it was stopped while blocked on
    a mean (``saved`` is False), its last periodic checkpoint."""

    def __init__(self, step: int, saved: bool = True):
        super().__init__(f"stopped after step {step}; checkpoint saved" if saved else
                         f"stopped while waiting for a mean; resumes from step {step}")
        self.step = step
        self.saved = saved


@dataclass
class WorkerResult:
    worker: str
    steps: int
    tokens: int
    seconds: float
    final_loss: float
    eval_loss: float | None
    wait_seconds: float
    bytes_up: int
    bytes_down: int
    resumed_from: int | None
    losses: list[float] = field(default_factory=list)
    state: str = "finished"  # or "left"
    rebases: int = 0

    def to_dict(self) -> dict[str, Any]:  # strict JSON: no NaN (a worker that trained no step)
        d = asdict(self)
        d.pop("losses")
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in d.items()}


@dataclass(frozen=True)
class Group:
    """This process's place in its group: the island (diloco) or all workers
    (data_parallel). ``size`` 1 means no torch.distributed."""

    rank: int = 0
    size: int = 1

    @classmethod
    def from_env(cls) -> Group:
        return cls(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))

    @property
    def leader(self) -> bool:
        return self.rank == 0


class WorkerLoop:
    """One worker's training, from a run in the store to its final rounds."""

    def __init__(
        self,
        run_url: str,
        worker: str,
        *,
        storage_options: dict | None = None,
        metrics: Metrics | None = None,
        stop: threading.Event | None = None,
        group: Group | None = None,
        stop_patience_s: float = 10.0,
        join: bool = False,
        claim: str | None = None,
    ):
        """``join``: the worker is not one of the manifest's workers and joins the
        running run (``claim``: the id of its membership record, so a relaunch of
        the same join is told from a second joiner taking the name)."""
        # Exchange traffic is what the product reports; checkpoints go through their
        # own client so that their bytes are counted apart.
        self.group = group or Group()
        if worker == "auto":  # the data-parallel baseline: rank i is worker i
            worker = open_run(
                ObjectStore(run_url, storage_options=storage_options)
            ).manifest.workers[self.group.rank]
        self.store = ObjectStore(run_url, storage_options=storage_options, name=worker)
        self.ckpt_store = ObjectStore(run_url, storage_options=storage_options,
                                      name=f"{worker}-checkpoints")
        self.exchange = open_run(self.store)
        manifest = self.exchange.manifest
        self.cfg = RunConfig.stored(manifest.config)
        self.status = StatusBoard(
            ObjectStore(run_url, storage_options=storage_options, name=f"{worker}-status"),
            worker, background=True, renew_s=max(0.5, self.cfg.sync.liveness.lease_s / 4))
        self.meter = report.party_meter(self.cfg, worker, [self.store, self.ckpt_store], self.status)
        self.moved_before = report.moved_before(self.status)  # a restart's bytes add on
        self.worker = worker
        self.sync: Synchronizer | None = None
        self.step, self.tokens, self.from_step = 0, 0, 0
        #: seconds of the recent steps, without their exchange (a merge's wait for a
        #: mean is the others' pace, not this worker's): their median, the usual step,
        #: is what the aggregator compares members by
        self.pace: deque[float] = deque(maxlen=PACE_STEPS)
        self.warm_from: int | None = None
        self.metrics = metrics or (lambda m: None)
        self.stop = stop or threading.Event()
        self.stop_patience_s = stop_patience_s
        self.device = pick_device(self.cfg)
        fixed_mmap_threshold()
        if self.cfg.train.threads:
            torch.set_num_threads(self.cfg.train.threads)

        # first: a worker that is not a member fails in one line, before any work
        self.seat = elastic.take_seat(
            self.store, manifest, self.cfg, worker, join=join, claim=claim,
            on_wait=lambda: self._status("joining", force=True, note="waiting for admission"))
        self.dataset = open_dataset(self.cfg.dataset_url(run_url), storage_options)
        mcfg = self.cfg.model_config_resolved
        if self.dataset.vocab_size > mcfg.vocab_size:
            raise ValueError(
                f"the dataset's vocabulary ({self.dataset.vocab_size}) is larger than the "
                f"model's vocab_size ({mcfg.vocab_size})"
            )
        self.model = build_model(mcfg, seed=self.cfg.train.seed).to(self.device)
        self.plan = plan_for(self.model, self.cfg.sync)
        self.plan.check_against([f.model_dump() for f in manifest.fragments])
        if self.group.leader:
            log.info("worker %s: model %s", worker, describe(self.model))
            for frag in self.plan.fragments:
                log.info("worker %s: fragment %d: %d parameters in %d tensors (%s ...)",
                         worker, frag.index, frag.numel, len(frag.params),
                         ", ".join(frag.names[:3]))
        # train.island fsdp: the model is sharded over the island's ranks from here on
        self.island = make_island(self.model, self.plan, self.exchange,
                                  self.cfg.train.island if self._uses_sync() else "replicate",
                                  self.group.rank, self.group.size, self.cfg.sync.schedule.auto)

        b, size = self.seat.batch_size, self.group.size
        dp = self.cfg.train.strategy == "data_parallel"
        if dp and self.group.size not in (1, len(manifest.workers)):
            raise ValueError(
                f"train.strategy data_parallel runs one process per worker: "
                f"{len(manifest.workers)} workers but {self.group.size} processes"
            )
        if not dp and b % size:
            raise ValueError(
                f"data.batch_size = {b} must be divisible by the island's {size} processes"
            )
        stream_index, stream_count = self.seat.slot, self.seat.slots
        if dp:  # the baseline: rank i of M reads share i of M
            stream_index, stream_count = manifest.workers.index(worker), len(manifest.workers)
        self.stream = WorkerStream(
            self.dataset, stream_index, stream_count, split=self.cfg.data.split,
            seq_len=self.cfg.data.seq_len, batch_size=b, seed=self.cfg.train.seed,
        )
        self.val = val_batches(self.dataset, seq_len=self.cfg.data.seq_len, batch_size=b,
                               num_batches=self.cfg.train.eval_batches)
        self.opt = make_optimizer(self.model, self.cfg)
        self.schedule = Schedule.of(self.cfg.sync.schedule)
        self.resumed_from: int | None = None
        self._restore()

    # -- state ---------------------------------------------------------------------
    def _uses_sync(self) -> bool:
        return self.cfg.train.strategy == "diloco"

    def _restore(self) -> None:
        saved = checkpoint.latest(self.ckpt_store, self.worker)
        if self._uses_sync() and self.group.leader:
            self.sync = Synchronizer(self.island.mirror, self.exchange, self.worker, self.plan,
                                     initialise=saved is None, stop=self.stop,
                                     stop_patience_s=self.stop_patience_s,
                                     on_stall=self._waiting, joined=self.seat.joined,
                                     heal=self.group.size == 1)
        elif not isinstance(self.island, ShardedIsland):  # it loaded them already
            # followers and the baseline start from the run's initial parameters too
            for p, v in enumerate(load_initial(self.exchange, len(self.plan))):
                self.plan.scatter(self.model, p, v)
        if saved is None:
            if self.sync is not None and self.group.size == 1 and (
                    self.seat.joined or elastic.behind(self)):
                elastic.catch_up(self, fresh=True, reason="starting behind the run")
            return
        step = saved.step
        state = checkpoint.restore(self.ckpt_store, saved, self.island, self.opt)
        self.stream.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"])
        if self.sync is not None:
            self.sync.load_state_dict(state["sync"])
        self.step, self.tokens = step, int(state["tokens"])
        self.from_step = int(state.get("from_step", 0))
        self.warm_from = state.get("warm_from")
        self.resumed_from = step
        log.info("worker %s: resumed from the checkpoint of step %d", self.worker, step)
        if self.sync is not None and self.group.size == 1 and elastic.behind(self):
            elastic.catch_up(self, fresh=False, reason="resumed behind the run")

    def save(self) -> None:
        """The checkpoint of this step: rank 0 of an island (every rank of an fsdp
        island writes its shards too), each worker in the baseline. A store outage is
        ridden out for up to ``sync.liveness.outage_s``; a failed write raises and the newest
        committed checkpoint stays in force."""
        commits = self.group.leader or self.cfg.train.strategy == "data_parallel"
        if not (commits or self.island.sharded):
            return
        rest = {
            "data": self.stream.state_dict(),
            "rng": torch.get_rng_state(),
            "tokens": self.tokens,
            "from_step": self.from_step,
            "warm_from": self.warm_from,
            # not copied: nothing changes them until the checkpoint is written below
            "sync": self.sync.state_dict(copy=False) if self.sync is not None else None,
        } if commits else None
        if checkpoint.save(self.ckpt_store, self.worker, self.step, self.island, self.opt, rest,
                           keep=self.cfg.retention.worker_checkpoints,
                           patience_s=self.cfg.sync.liveness.outage_s):
            log.info("worker %s: checkpoint at step %d", self.worker, self.step)

    # -- the loop ------------------------------------------------------------------
    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.stream.next_batch()
        if self.group.size > 1 and self.cfg.train.strategy == "diloco":  # an island
            n = x.shape[0] // self.group.size
            lo = self.group.rank * n
            x, y = x[lo : lo + n], y[lo : lo + n]
        return to_device(x, self.device), to_device(y, self.device)

    def _island_average(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """An island's ranks average their gradients (and losses) before the clip."""
        if self.group.size > 1:
            self.island.average_gradients()
            dist.all_reduce(loss_sum)
            loss_sum /= self.group.size
        return loss_sum

    def run(self) -> WorkerResult:
        """Train to the end; the status board says ``failed`` if anything raises."""
        try:
            return self._run()
        except Interrupted:
            raise
        except elastic.RunFinished as exc:  # a straggler or late restart: nothing left
            log.info("worker %s: %s", self.worker, exc)
            self._status("finished", force=True, note=str(exc))
            return self._result(time.perf_counter(), [], None)
        except MergeAbandoned as exc:
            # between an inner step and its merge: nothing consistent to save
            saved = checkpoint.latest_step(self.ckpt_store, self.worker) or 0
            log.warning("%s; resumes from step %d", exc, saved)
            self._status("interrupted", force=True, error=None, resumes_from=saved,
                         note=f"stopped while waiting for a mean; resumes from step {saved}")
            raise Interrupted(saved, saved=False) from exc
        except BaseException as exc:
            self._status("failed", force=True, error=f"{type(exc).__name__}: {exc}")
            raise

    def _run(self) -> WorkerResult:
        cfg, total = self.cfg, self.cfg.train.steps
        accum = cfg.optim.grad_accum
        island = self.group.size if cfg.train.strategy == "diloco" else 1
        # tokens this worker (island) processes per inner step; the baseline's workers
        # each draw their own batch too, so both strategies see the same tokens
        tokens_per_step = self.seat.batch_size * cfg.data.seq_len * accum
        losses = LossLog()
        start = time.perf_counter()
        window_start, window_tokens = start, 0
        eval_loss = None
        self.model.train()
        if self.group.leader or cfg.train.strategy == "data_parallel":
            self.status.register(total_steps=total, strategy=cfg.train.strategy,
                                 island=self.group.size if island > 1 else 1)
        else:
            self.status = None  # followers of an island stay silent
        if elastic.leaving(self):
            return self._leave(start, losses)
        halt = False  # an island stops together: the ranks decide after every step
        began, synced = None, 0.0
        while self.step < total:
            now = time.perf_counter()  # the step before, but its exchange (its waits)
            if began is not None:
                self.pace.append(now - began - synced)
            began, synced = now, 0.0
            if halt or (self.group.size == 1 and self.stop.is_set()):
                losses.flush()
                self.save()
                self._status("interrupted", force=True, loss=losses[-1] if losses else None,
                             resumes_from=self.step)
                raise Interrupted(self.step)
            step = self.step + 1
            lr = lr_at(step, cfg, self.warm_from)
            for group in self.opt.param_groups:
                group["lr"] = lr
            loss_sum = inner_step(self.model, self.opt, self._batch, accum, cfg.optim.grad_clip,
                                  self.device, between=self._island_average)
            sync_from = time.perf_counter()
            merged = self.island.before_sync(self.schedule, step, self.sync) if island > 1 else []
            abandoned = None
            if self.sync is not None:
                try:
                    self.sync.step(tokens=tokens_per_step)
                except Behind as exc:
                    log.warning("%s", exc)
                    if elastic.catch_up(self, fresh=False, reason="fell behind"):
                        continue  # this step's work is superseded by the canonical state
                    self.sync.step(tokens=tokens_per_step, heal=False)
                except MergeAbandoned as exc:  # in an island every rank gives it up
                    if self.group.size == 1:
                        raise
                    abandoned = exc
            synced = time.perf_counter() - sync_from
            halt = self.island.decide(self.stop, abandoned)
            self.step = step
            self.tokens += tokens_per_step
            window_tokens += tokens_per_step
            self.island.scatter(merged)  # every rank takes the fragments rank 0 merged
            losses.add(loss_sum)

            if step % cfg.train.log_every == 0 or step == total:
                loss_sum = losses.flush()[-1]
                now = time.perf_counter()
                self._report(step, loss_sum, lr, window_tokens / max(1e-9, now - window_start))
                window_start, window_tokens = now, 0
                self._status("running", loss=loss_sum, eval_loss=eval_loss)
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != total:
                eval_loss = evaluate(self.model, self.val, self.device)
                self.metrics({"worker": self.worker, "step": step, "eval_loss": eval_loss})
            if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0:
                self.save()
            if elastic.leaving(self, step):
                return self._leave(start, losses)

        if island > 1:  # every fragment: finish merges whatever was outstanding
            self.island.finish(self.sync)
        elif self.sync is not None:
            self.sync.finish()
        eval_loss = evaluate(self.model, self.val, self.device)
        self.metrics({"worker": self.worker, "step": self.step, "eval_loss": eval_loss,
                      "final": True})
        self._status("finished", force=True, loss=losses.flush()[-1] if losses else None,
                     eval_loss=eval_loss)
        return self._result(start, losses, eval_loss)

    def _result(self, start: float, losses: list[float], eval_loss: float | None,
                state: str = "finished") -> WorkerResult:
        up, down = self.moved()
        return WorkerResult(
            worker=self.worker, steps=self.step, tokens=self.tokens,
            seconds=time.perf_counter() - start,
            final_loss=losses[-1] if losses else float("nan"), eval_loss=eval_loss,
            wait_seconds=self.sync.stats.wait_seconds if self.sync else 0.0,
            bytes_up=up, bytes_down=down, resumed_from=self.resumed_from,
            losses=losses, state=state,
            rebases=self.sync.stats.rebases if self.sync else 0,
        )

    def _leave(self, start: float, losses: LossLog) -> WorkerResult:
        """``diloco leave``: at a merge point, commit, record, stop."""
        elastic.leave(self)
        losses.flush()
        self._status("left", force=True, loss=losses[-1] if losses else None)
        if self.sync is not None:  # an island's other ranks have none
            self.sync.close()
        return self._result(start, losses, None, state="left")

    def _waiting(self, p: int, r: int, seconds: float) -> None:
        """A merge has waited long for a mean: the status says which and how long."""
        self._status("running", force=True,
                     waiting={"fragment": p, "round": r, "waited_s": round(seconds, 1)})

    def _status(self, state: str, force: bool = False, **fields: Any) -> None:
        if self.status is None:
            return
        (up, down), bill = self.moved(), self.meter.figures()  # exchange bytes; the bill: all
        self.status.update(
            state, force=force, step=self.step, total_steps=self.cfg.train.steps,
            tokens=self.tokens, bytes_up=up, bytes_down=down, **bill,
            wait_s=self.sync.stats.wait_seconds if self.sync else 0.0, **report.taus(self.sync),
            from_step=self.from_step, slot=getattr(getattr(self, "seat", None), "slot", None),
            step_s=self.usual_step_s(),
            rebases=self.sync.stats.rebases if self.sync else 0, **fields,
        )

    def usual_step_s(self) -> float | None:
        """The median of the recent steps' seconds, their exchange left out (None
        before ``PACE_STEPS // 2`` steps: a straggler is judged over many steps, not a
        few noisy ones)."""
        if len(self.pace) < PACE_STEPS // 2:
            return None
        return round(statistics.median(self.pace), 4)

    def _report(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        m: dict[str, Any] = {
            "worker": self.worker, "step": step, "loss": loss, "lr": lr,
            "tokens_per_s": tokens_per_s, "tokens": self.tokens, **self.meter.figures(),
            **dict(zip(("bytes_up", "bytes_down"), self.moved(), strict=True)),
        }
        if self.sync is not None:
            st = self.sync.stats
            m["wait_s"] = st.wait_seconds
            m["staleness"] = (sum(st.staleness) / len(st.staleness)) if st.staleness else 0.0
            m["late_means"] = st.late_means
            m.update(report.taus(self.sync, metrics=True))
        self.metrics(m)

    def moved(self) -> tuple[int, int]:
        """Exchange bytes up and down over every life of this worker (not checkpoints)."""
        t, (up, down) = self.store.traffic, self.moved_before
        return up + t.bytes_up, down + t.bytes_down

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
