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
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from diloco.run import load_initial
from diloco.synchronizer import Behind, MergeAbandoned, Synchronizer
from workers import checkpoint, elastic, report
from workers.group import Group
from workers.inner import evaluate, inner_step, lr_at, to_device
from workers.island import ShardedIsland
from workers.losslog import LossLog
from workers.parts import Parts
from workers.parts import build as build_parts
from workers.progress import Position
from workers.status import StatusBoard

log = logging.getLogger(__name__)

Metrics = Callable[[dict[str, Any]], None]


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


class WorkerLoop:
    """One worker's training, from a run in the store to its final rounds.

    It trains with the parts `workers.parts.build` made (`open` builds them and the
    loop in one call) and keeps the worker's progress in one `Position`, which elastic
    membership moves through the narrow `elastic.Member` view, never the loop."""

    def __init__(self, parts: Parts, *, metrics: Metrics | None = None,
                 stop: threading.Event | None = None, stop_patience_s: float = 10.0):
        self.worker, self.group, self.cfg = parts.worker, parts.group, parts.cfg
        self.store, self.ckpt_store, self.exchange = parts.store, parts.ckpt_store, parts.exchange
        self.seat, self.device, self.model, self.plan = (
            parts.seat, parts.device, parts.model, parts.plan)
        self.island, self.stream, self.val, self.opt = (
            parts.island, parts.stream, parts.val, parts.opt)
        self.schedule, self.reporter = parts.schedule, parts.reporter
        self.position = Position(parts.stream, self.cfg.optim.grad_accum)
        self.sync: Synchronizer | None = None
        self.metrics = metrics or (lambda m: None)
        self.stop = stop or threading.Event()
        self.stop_patience_s = stop_patience_s
        self.speaks = True  # an island's followers fall silent when training starts
        self.member = elastic.Member(
            worker=self.worker, group=self.group, cfg=self.cfg, store=self.store,
            exchange=self.exchange, island=self.island, schedule=self.schedule, stop=self.stop,
            status=self.status)
        self.resumed_from: int | None = None
        self._restore()

    @classmethod
    def open(cls, run_url: str, worker: str, *, storage_options: dict | None = None,
             metrics: Metrics | None = None, stop: threading.Event | None = None,
             group: Group | None = None, stop_patience_s: float = 10.0, join: bool = False,
             claim: str | None = None) -> WorkerLoop:
        """Build ``worker``'s parts in run ``run_url`` (`workers.parts.build`: ``join``
        and ``claim`` are a joiner's) and the loop that trains them, restored from the
        worker's newest checkpoint if it has one."""
        parts = build_parts(run_url, worker, storage_options=storage_options, group=group,
                            join=join, claim=claim)
        return cls(parts, metrics=metrics, stop=stop, stop_patience_s=stop_patience_s)

    @property
    def step(self) -> int:
        """Inner steps done (`Position.step`)."""
        return self.position.step

    @property
    def tokens(self) -> int:
        """Tokens trained on (`Position.tokens`)."""
        return self.position.tokens

    @property
    def board(self) -> StatusBoard:
        """The worker's status board (its lease and what ``diloco status`` shows)."""
        return self.reporter.board

    # -- state ---------------------------------------------------------------------
    def _restore(self) -> None:
        saved = checkpoint.latest(self.ckpt_store, self.worker)
        if self.member.uses_sync and self.group.leader:
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
                    self.seat.joined or elastic.behind(self.member, self.sync)):
                elastic.catch_up(self.member, self.sync, self.position, fresh=True,
                                 reason="starting behind the run")
            return
        step = saved.step
        state = checkpoint.restore(self.ckpt_store, saved, self.island, self.opt)
        self.stream.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"])
        if self.sync is not None:
            self.sync.load_state_dict(state["sync"])
        pos = self.position
        pos.step, pos.tokens = step, int(state["tokens"])
        pos.from_step = int(state.get("from_step", 0))
        pos.warm_from = state.get("warm_from")
        self.resumed_from = step
        log.info("worker %s: resumed from the checkpoint of step %d", self.worker, step)
        if self.sync is not None and self.group.size == 1 and elastic.behind(self.member,
                                                                             self.sync):
            elastic.catch_up(self.member, self.sync, self.position, fresh=False,
                             reason="resumed behind the run")

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
            "tokens": self.position.tokens,
            "from_step": self.position.from_step,
            "warm_from": self.position.warm_from,
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
            self.status("finished", force=True, note=str(exc))
            return self._result(time.perf_counter(), [], None)
        except MergeAbandoned as exc:
            # between an inner step and its merge: nothing consistent to save
            saved = checkpoint.latest_step(self.ckpt_store, self.worker) or 0
            log.warning("%s; resumes from step %d", exc, saved)
            self.status("interrupted", force=True, error=None, resumes_from=saved,
                         note=f"stopped while waiting for a mean; resumes from step {saved}")
            raise Interrupted(saved, saved=False) from exc
        except BaseException as exc:
            self.status("failed", force=True, error=f"{type(exc).__name__}: {exc}")
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
            self.board.register(total_steps=total, strategy=cfg.train.strategy,
                                island=self.group.size if island > 1 else 1)
        else:
            self.speaks = False  # followers of an island stay silent
        pos = self.position
        if elastic.leaving(self.member, self.sync):
            return self._leave(start, losses)
        halt = False  # an island stops together: the ranks decide after every step
        began, synced = None, 0.0
        while pos.step < total:
            now = time.perf_counter()  # the step before, but its exchange (its waits)
            if began is not None:
                self.reporter.pace.append(now - began - synced)
            began, synced = now, 0.0
            if halt or (self.group.size == 1 and self.stop.is_set()):
                losses.flush()
                self.save()
                self.status("interrupted", force=True, loss=losses[-1] if losses else None,
                            resumes_from=pos.step)
                raise Interrupted(pos.step)
            step = pos.step + 1
            lr = lr_at(step, cfg, pos.warm_from)
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
                    if elastic.catch_up(self.member, self.sync, pos, fresh=False,
                                        reason="fell behind"):
                        continue  # this step's work is superseded by the canonical state
                    self.sync.step(tokens=tokens_per_step, heal=False)
                except MergeAbandoned as exc:  # in an island every rank gives it up
                    if self.group.size == 1:
                        raise
                    abandoned = exc
            synced = time.perf_counter() - sync_from
            halt = self.island.decide(self.stop, abandoned)
            pos.step = step
            pos.tokens += tokens_per_step
            window_tokens += tokens_per_step
            self.island.scatter(merged)  # every rank takes the fragments rank 0 merged
            losses.add(loss_sum)

            if step % cfg.train.log_every == 0 or step == total:
                loss_sum = losses.flush()[-1]
                now = time.perf_counter()
                self._report(step, loss_sum, lr, window_tokens / max(1e-9, now - window_start))
                window_start, window_tokens = now, 0
                self.status("running", loss=loss_sum, eval_loss=eval_loss)
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != total:
                eval_loss = evaluate(self.model, self.val, self.device)
                self.metrics({"worker": self.worker, "step": step, "eval_loss": eval_loss})
            if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0:
                self.save()
            if elastic.leaving(self.member, self.sync, step):
                return self._leave(start, losses)

        if island > 1:  # every fragment: finish merges whatever was outstanding
            self.island.finish(self.sync)
        elif self.sync is not None:
            self.sync.finish()
        eval_loss = evaluate(self.model, self.val, self.device)
        self.metrics({"worker": self.worker, "step": self.step, "eval_loss": eval_loss,
                      "final": True})
        self.status("finished", force=True, loss=losses.flush()[-1] if losses else None,
                    eval_loss=eval_loss)
        return self._result(start, losses, eval_loss)

    def _result(self, start: float, losses: list[float], eval_loss: float | None,
                state: str = "finished") -> WorkerResult:
        up, down = self.reporter.moved()
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
        elastic.leave(self.member, self.sync, self.step)
        losses.flush()
        self.status("left", force=True, loss=losses[-1] if losses else None)
        if self.sync is not None:  # an island's other ranks have none
            self.sync.close()
        return self._result(start, losses, None, state="left")

    def _waiting(self, p: int, r: int, seconds: float) -> None:
        """A merge has waited long for a mean: the status says which and how long."""
        self.status("running", force=True,
                    waiting={"fragment": p, "round": r, "waited_s": round(seconds, 1)})

    def status(self, state: str, force: bool = False, **fields: Any) -> None:
        """Write this worker's status (``state``, its position and figures, and
        ``fields``); nothing from an island's followers once training started (rank 0
        speaks for the island). Elastic membership writes through it too."""
        if self.speaks:
            self.reporter.status(state, position=self.position, sync=self.sync,
                                 slot=self.seat.slot, force=force, **fields)

    def _report(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        m: dict[str, Any] = {
            "worker": self.worker, "step": step, "loss": loss, "lr": lr,
            "tokens_per_s": tokens_per_s, "tokens": self.tokens,
            **self.reporter.meter.figures(),
            **dict(zip(("bytes_up", "bytes_down"), self.reporter.moved(), strict=True)),
        }
        if self.sync is not None:
            st = self.sync.stats
            m["wait_s"] = st.wait_seconds
            m["staleness"] = (sum(st.staleness) / len(st.staleness)) if st.staleness else 0.0
            m["late_means"] = st.late_means
            m.update(report.taus(self.sync, metrics=True))
        self.metrics(m)

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
