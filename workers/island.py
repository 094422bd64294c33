"""An FSDP2 island: the processes of one worker shard its model (``train.island: fsdp``).

Inside a region, a worker that is several torchrun processes either replicates the
model on every rank (``replicate``: gradients all-reduced, DDP-like) or shards it with
``torch.distributed.fsdp.fully_shard`` (per transformer block, then the root), so a
model whose parameters, gradients and AdamW state do not fit one device trains.

The outer machinery (the `Synchronizer`, the exchange protocol, the aggregator)
works on whole fragments, so rank 0 keeps a *mirror*: an unsharded float32 copy of
the model on the CPU, which is what the synchroniser reads and writes. Around a step
with a send or merge of fragment p every rank takes part in gathering p's parameters
(``DTensor.full_tensor()``) into the mirror, and after a merge rank 0 scatters the
new values of p back, each rank keeping its shard (``distribute_tensor``). Only the
fragments due at that step move, one parameter at a time, so a device never holds
more than one whole parameter beyond its shards; rank 0's host holds the mirror
beside the outer state (both float32, the model's size each). Why this and not each
rank handling its shards' part of every fragment: that would cut every contribution
into per-rank pieces the store, the aggregator and the codecs would all have to know
about, while the gather is cheap (measured: docs/worker.md, "Islands").

Every island writes its checkpoint's tensors with torch.distributed.checkpoint
(`save_state`, workers/checkpoint.py): a sharded island's ranks each their shards of
the model and the AdamW state, rank 0 adding the rest of the worker's state (outer
state, synchroniser, data position), which it commits after every rank has finished;
any other island, the one process that saves, all of it. A resume reads them back
into any number of ranks, one process included. FSDP2, DTensor and DCP are imported
where they are first used (a sharded island built, a checkpoint saved or loaded), so a
worker does not pay their import at start-up.
"""

from __future__ import annotations

import copy
import logging
import threading
import warnings
from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tenacity import RetryCallState
from torch import nn

from diloco.fragments import FragmentPlan, find_blocks
from diloco.inflight import MergeAbandoned
from diloco.run import load_initial
from diloco.schedule import Schedule
from storage.objectstore import ObjectStore
from storage.retry import OutagePolicy, is_transient
from workers import checkpoint_files

if TYPE_CHECKING:
    from torch.distributed.checkpoint import CheckpointException

log = logging.getLogger(__name__)


class Abandoned(MergeAbandoned):
    """Rank 0 of this island gave up a merge (stopped while waiting for a mean): the
    other ranks end with it, without saving, and resume from the last checkpoint."""

    def __init__(self, rank: int):
        RuntimeError.__init__(self, f"island rank {rank}: rank 0 stopped while waiting "
                                    "for a mean")


# What a rank wants after a step; the island does the highest any rank wants.
GO, STOP, ABANDON = 0, 1, 2


class Island:
    """A replicated island (``train.island: replicate``, or one process): every rank
    holds the whole model; gradients are all-reduced, merged fragments broadcast."""

    def __init__(self, model: nn.Module, plan: FragmentPlan, rank: int, size: int,
                 auto: bool = False):
        self.model, self.plan, self.rank, self.size, self.auto = model, plan, rank, size, auto
        self.mirror: nn.Module = model  # what the synchroniser reads and writes
        # the stop flags travel on the CPU (gloo) even beside NCCL: no device sync per step
        self._flags = (dist.new_group(backend="gloo")
                       if size > 1 and dist.get_backend() != "gloo" else None)

    def agree(self, want: int) -> int:
        """Every rank, once per step: the highest of the ranks' ``want`` (GO, STOP after
        this step, ABANDON the step: rank 0 gave up a merge). A SIGTERM reaches the
        ranks at different steps; deciding together makes them all stop after the same
        step, so no rank waits in a gradient all-reduce or a checkpoint's gather for a
        rank that has gone."""
        if self.size == 1:
            return want
        flag = torch.tensor([want], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._flags)
        return int(flag[0])

    def decide(self, stop: threading.Event, abandoned: MergeAbandoned | None = None) -> bool:
        """Every rank, after a step's merge (rank 0: ``abandoned`` when it gave the merge
        up): True when the whole island stops after this step; raises `MergeAbandoned`
        on every rank when rank 0 gave up, so no rank waits in that merge's scatter."""
        decided = self.agree(ABANDON if abandoned else STOP if stop.is_set() else GO)
        if decided == ABANDON:
            raise abandoned or Abandoned(self.rank)
        return decided == STOP

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def average_gradients(self) -> None:
        """The island's mean gradient on every rank (its ranks' batch slices are equal)."""
        if self.size == 1:
            return
        for p in self.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad.div_(self.size)

    def events(self, schedule: Schedule, step: int, sync) -> tuple[list[int], list[int]]:
        """(fragments with a send or merge at ``step``, fragments merged at it). With
        ``overlap: auto`` only rank 0 (``sync``) knows tau, so it tells the others."""
        tau_of = sync.tau.per_point if sync is not None else None

        def mine() -> tuple[list[int], list[int]]:
            evs = schedule.events(step, tau_of)
            return (sorted({e.fragment for e in evs}),
                    sorted({e.fragment for e in evs if e.kind == "merge"}))
        if self.size == 1 or not self.auto:
            return mine()
        box = [mine() if self.leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def before_sync(self, schedule: Schedule, step: int, sync) -> list[int]:
        """Every rank, after the inner step: the fragments rank 0 will merge now."""
        return [] if self.size == 1 else self.events(schedule, step, sync)[1]

    def gather(self, fragments: Iterable[int]) -> None:
        """Rank 0's mirror is the model itself: nothing to gather."""

    @torch.no_grad()
    def scatter(self, fragments: Iterable[int]) -> None:
        """Every rank takes rank 0's values of these fragments."""
        if self.size == 1:
            return
        named = dict(self.model.named_parameters())
        for name in self._names(fragments):
            dist.broadcast(named[name].data, src=0)

    def finish(self, sync) -> None:
        """Every rank, after the last step: rank 0's synchroniser (``sync``) merges what
        is outstanding of every fragment, gathered whole first and scattered after; if
        rank 0 gives a merge up, every rank raises `MergeAbandoned`."""
        everything = range(len(self.plan))
        self.gather(everything)
        abandoned = None
        try:
            if sync is not None:
                sync.finish()
        except MergeAbandoned as exc:
            abandoned = exc
        self.decide(threading.Event(), abandoned)  # a stop now changes nothing: it is done
        self.scatter(everything)

    def _names(self, fragments: Iterable[int]) -> list[str]:
        """Each parameter of these fragments once (a split tensor moves whole)."""
        return list(dict.fromkeys(s.name for p in fragments for s in self.plan[p].params))

    def load_whole(self, opt: torch.optim.Optimizer, model_sd: dict, opt_sd: dict) -> None:
        """Restore from whole state dicts (a legacy checkpoint's)."""
        self.model.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)

    #: whether every rank writes and reads its own part of a checkpoint (a collective)
    sharded = False

    def _state_dicts(self, opt: torch.optim.Optimizer, optimizer: bool) -> dict:
        """The model's and ``opt``'s state as DCP saves and loads them (keyed by
        parameter name, a sharded island's as DTensors). Before the optimizer's first
        step it has no state and none is saved: ``get_state_dict`` would make some by
        taking a step, and a resume would not be the uninterrupted run."""
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
            get_model_state_dict,
            get_state_dict,
        )

        if not optimizer:
            return {"model": get_model_state_dict(self.model)}
        model_sd, opt_sd = get_state_dict(self.model, opt)
        return {"model": model_sd, "optimizer": opt_sd}

    def save_state(self, opt: torch.optim.Optimizer, store: ObjectStore, key: str,
                   extra: dict[str, torch.Tensor] | None = None) -> dict:
        """The model's and AdamW's state, with ``extra`` (the rest of the worker's
        tensors, from the rank that commits), into the new DCP directory ``key`` of
        ``store``; returns the commit record's ``dcp`` entry (every rank's files with
        their sizes and sha256, on every rank). A sharded island's ranks all call it (a
        collective: when it returns every rank's files and the ``.metadata`` are
        written, or every rank raises); any other island's one saving process alone."""
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        state = self._state_dicts(opt, optimizer=bool(opt.state))
        if extra:
            state["worker"] = extra
        writer = checkpoint_files.new_writer(store, key)
        with _quiet():
            dcp.save(state, storage_writer=writer, no_dist=not self.sharded)
        files = writer.fs.written
        if self.sharded and self.size > 1:  # each rank hashed its own file
            every: list[dict] = [{} for _ in range(self.size)]
            dist.all_gather_object(every, files)
            files = {name: rec for part in every for name, rec in part.items()}
        if self.leader:  # the bill counts them once
            checkpoint_files.count(store, key, files)
        return {"key": key, "ranks": self.size if self.sharded else 1,
                "bytes": sum(rec["size"] for rec in files.values()),
                "files": files, "optimizer": "optimizer" in state}

    def outlast_save(self, opt: torch.optim.Optimizer, store: ObjectStore,
                     new_key: Callable[[], str | None], *,
                     extra: dict[str, torch.Tensor] | None = None, patience_s: float,
                     pause_s: float = 2.0) -> dict | None:
        """Every rank of a sharded island, else the one process that saves: `save_state`
        (with ``extra``) into the directory rank 0's ``new_key()`` names
        (None: nothing to save; returns None), and after a transient failure of any
        rank (a store outage) again into a fresh one, pausing ``pause_s``, for up to
        ``patience_s`` from the first failure (an `OutagePolicy`, as the whole-state
        checkpoint write rides one out); then the last failure is raised.

        Every rank runs the same tenacity ``Retrying``; what could differ between
        the ranks is decided by rank 0 and broadcast: the directory of each attempt
        and whether the patience is spent. Whether a failure is worth another
        attempt is every rank's own verdict on the same `CheckpointException` (DCP
        raises the failures of all ranks on every rank). So every rank tries again
        or every rank raises, and none is left waiting in a collective."""
        tried: list[str] = []  # the directory of each attempt

        collective = self.sharded and self.size > 1  # else this process decides alone

        def attempt() -> dict | None:
            box: list[str | None] = [new_key() if self.leader or not collective else None]
            if collective:
                dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return None
            tried.append(box[0])
            return self.save_state(opt, store, box[0], extra)

        def worth_retrying(exc: BaseException) -> bool:
            from torch.distributed.checkpoint import CheckpointException  # noqa: PLC0415

            return isinstance(exc, CheckpointException) and _transient(exc)

        retrying = OutagePolicy(patience_s=patience_s, pause_s=pause_s).retrying(
            retry_on=worth_retrying, what="island: checkpoint files", log=log)
        spent = retrying.stop  # the policy's deadline, as rank 0's clock sees it

        def together(state: RetryCallState) -> bool:
            box = [spent(state) if self.leader or not collective else None]
            if collective:
                dist.broadcast_object_list(box, src=0)
            return bool(box[0])

        def warn(state: RetryCallState) -> None:
            if self.leader or not collective:
                exc = state.outcome.exception() if state.outcome else None
                log.warning("island: a rank failed to write its checkpoint files into %s "
                            "(attempt %d; retrying for up to %.0f s from the first "
                            "failure): %s", store.full_url(tried[-1]), state.attempt_number,
                            patience_s, _first_failure(exc))

        return retrying.copy(stop=together, before_sleep=warn)(attempt)

    def load_state(self, opt: torch.optim.Optimizer, store: ObjectStore, ref: dict,
                   extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Restore the model and AdamW state from the DCP directory ``ref`` (a
        `save_state` entry; every rank of a sharded island, each reading what it
        holds: the ranks that wrote it may have been more or fewer); ``extra``: empty
        tensors of the rest of the worker's state, returned filled."""
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415
        from torch.distributed.checkpoint import CheckpointException  # noqa: PLC0415
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
            set_model_state_dict,
            set_state_dict,
        )

        with_opt = ref.get("optimizer", True)  # False: saved before the first step
        state = self._state_dicts(opt, optimizer=with_opt)
        if extra:
            state["worker"] = extra
        reader = checkpoint_files.new_reader(store, ref["key"], ref.get("files"))
        try:
            with _quiet():
                dcp.load(state, storage_reader=reader, no_dist=not self.sharded)
        except CheckpointException as exc:
            raise checkpoint_files.store_error(exc) from exc
        if not with_opt:
            set_model_state_dict(self.model, state["model"])
        else:
            set_state_dict(self.model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        return state.get("worker", {})


class ShardedIsland(Island):
    """The sharded model of one island and rank 0's unsharded mirror of it."""

    def __init__(self, model: nn.Module, plan: FragmentPlan, rank: int, initial: list,
                 auto: bool = False):
        """``model``: the plain model, on its device, identical on every rank;
        ``initial``: the run's initial fragments, loaded into it before sharding (so
        every rank starts from the run's parameters, as replicated islands do);
        ``auto``: the run's ``overlap: auto`` (tau known to rank 0 only)."""
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        for p, flat in enumerate(initial):
            plan.scatter(model, p, flat)
        super().__init__(model, plan, rank, dist.get_world_size(), auto)
        self.mirror = copy.deepcopy(model).cpu() if rank == 0 else None
        found = find_blocks(model)
        for block in (found[1] if found else []):
            fully_shard(block)
        fully_shard(model)
        self._named = dict(model.named_parameters())
        self._mirrored = dict(self.mirror.named_parameters()) if self.mirror is not None else {}

    # -- moving fragments between the shards and the mirror ---------------------------
    @torch.no_grad()
    def gather(self, fragments: Iterable[int]) -> None:
        """Every rank: the whole values of these fragments into rank 0's mirror."""
        for name in self._names(fragments):
            full = self._named[name].full_tensor()  # a collective: all ranks, same order
            if self.leader:
                self._mirrored[name].copy_(full)

    @torch.no_grad()
    def scatter(self, fragments: Iterable[int]) -> None:
        """Every rank: take its shard of rank 0's mirror values of these fragments."""
        from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: PLC0415

        for name in self._names(fragments):
            param = self._named[name]
            assert isinstance(param, DTensor)
            if self.leader:
                full = self._mirrored[name].to(param.device, param.dtype)
            else:  # only its shape matters: rank 0 scatters the values
                full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
            shard = distribute_tensor(full, param.device_mesh, param.placements)
            param.to_local().copy_(shard.to_local())

    # -- checkpoints ---------------------------------------------------------------------
    def average_gradients(self) -> None:
        """fully_shard reduce-scatters the mean gradient in backward already."""

    def before_sync(self, schedule: Schedule, step: int, sync) -> list[int]:
        """Every rank, after the inner step: the fragments sent or merged now go whole
        into rank 0's mirror; returns those rank 0 will merge (to `scatter` after)."""
        due, merged = self.events(schedule, step, sync)
        self.gather(due)
        return merged

    sharded = True

    def whole_state(self, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
        """Every rank (a collective): the model's and the inner optimizer's whole state,
        on rank 0's CPU (other ranks get empty dicts), keyed by parameter name (what
        checkpoints held before they were sharded; tests compare with it)."""
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
            StateDictOptions,
            get_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_state_dict(self.model, opt, options=opts)

    def load_whole(self, opt: torch.optim.Optimizer, model_sd: dict, opt_sd: dict) -> None:
        """Every rank: restore the sharded model and optimizer from whole state dicts
        (each rank keeps its shards): a legacy checkpoint from before they were sharded."""
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
            StateDictOptions,
            set_state_dict,
        )

        set_state_dict(self.model, opt, model_state_dict=model_sd, optim_state_dict=opt_sd,
                       options=StateDictOptions(full_state_dict=True))


@contextmanager
def _quiet() -> Generator[None, None, None]:
    """DCP warns at every save and load of one process that it assumes one process:
    here that is the intent, and a worker saves every few minutes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                category=UserWarning)
        yield


def _transient(exc: CheckpointException) -> bool:
    """Every rank's failure in a DCP save is one a retry may fix (`is_transient`)."""
    return all(is_transient(failure) for failure, _ in exc.failures.values())


def _first_failure(exc: CheckpointException) -> str:
    rank, (failure, _) = next(iter(exc.failures.items()))
    return f"rank {rank}: {type(failure).__name__}: {failure}"


def make(model: nn.Module, plan: FragmentPlan, exchange, island: str, rank: int, size: int,
         auto: bool = False) -> Island:
    """The island of this process: sharded for ``train.island: fsdp`` on more than one
    process, else replicated (one process has nothing to shard across)."""
    if island != "fsdp" or size == 1:
        return Island(model, plan, rank, size, auto)
    return ShardedIsland(model, plan, rank, load_initial(exchange, len(plan)), auto)
