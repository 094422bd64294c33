"""Worker checkpoints in the run's store: one format, torch.distributed.checkpoint.

A worker checkpoint is the model's and the inner optimizer's state plus the rest of
the worker's state (the synchroniser's, the data position, the RNG, counters: any
nest of dicts, lists, tuples, numbers, strings, tensors and numpy arrays). Every
tensor of it is written with torch.distributed.checkpoint (DCP) into a fresh
directory ``workers/{worker}/ckpt/{step:08d}/dcp-{id}``, through the store's own
filesystem (`workers.checkpoint_files`): by every rank of a sharded (``train.island:
fsdp``) island, each its shards, or by the one process that holds the whole state.
One code path for both (`workers.island.Island.save_state`): DCP resharding is what
lets a checkpoint be read back by any number of ranks, so it is the format for all.

The rest's tensors go into the directory as ``worker.t{i}``; everything else of it is
a JSON skeleton in the commit record ``{step:08d}.json``. That record is written
create-only after the whole directory is written, the one atomic switch: a crash
before it leaves the previous checkpoint the newest, and the orphan directory is what
``diloco gc`` removes as "never committed". Retention deletes a checkpoint's whole
``{step:08d}`` prefix. The record pins each file of the directory by size and sha256
(hashed as it was written); a load refuses a missing, truncated or altered file in
one line.

Checkpoints written before this format (tensors as zarr arrays named in the commit
record, and a sharded island's model and AdamW in DCP beside them) are still read,
so such a run resumes: `_read_legacy` and `_restore_legacy`, nothing else.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from storage import layout
from storage.checkpoints import committed_keys, read_checkpoint
from storage.errors import CorruptObject
from storage.objectstore import ObjectStore
from storage.retry import outlast
from workers import checkpoint_files

if TYPE_CHECKING:
    from workers.island import Island

log = logging.getLogger(__name__)

#: what a commit record's ``format`` says its tensors are in
FORMAT = "torch.distributed.checkpoint"
_TENSOR = "__tensor__"
_ARRAY = "__ndarray__"
_TUPLE = "__tuple__"
_INT = "__int__"
# the legacy format's numpy had no bfloat16 or float8: such tensors were their bits
_BITS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}


# -- the rest of a worker's state: a JSON skeleton and its tensors -----------------------
def split(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(skeleton, tensors): ``state`` with each tensor and numpy array replaced by a
    reference to ``tensors[f"t{i}"]`` (numpy arrays become tensors sharing their
    memory); the skeleton is JSON. The tensors are not copied: write them before
    changing them."""
    tensors: dict[str, torch.Tensor] = {}
    return _skeleton(state, tensors), tensors


def _skeleton(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, np.ndarray):
        key, arr = f"t{len(tensors)}", np.ascontiguousarray(obj, obj.dtype.newbyteorder("="))
        tensors[key] = torch.from_numpy(arr)
        return {_ARRAY: key, "dtype": arr.dtype.str, "shape": list(arr.shape)}
    if isinstance(obj, torch.Tensor):
        key, t = f"t{len(tensors)}", obj.detach().cpu().contiguous()
        tensors[key] = t
        return {_TENSOR: key, "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape)}
    if isinstance(obj, dict):
        return {(f"{_INT}{k}" if isinstance(k, int) else str(k)): _skeleton(v, tensors)
                for k, v in obj.items()}
    if isinstance(obj, tuple):
        return {_TUPLE: [_skeleton(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_skeleton(v, tensors) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"cannot checkpoint a value of type {type(obj).__name__}")


def targets(skeleton: Any, out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Empty tensors of the skeleton's shapes and dtypes, for DCP to read into."""
    out = {} if out is None else out
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            out[skeleton[_TENSOR]] = torch.empty(skeleton["shape"],
                                                 dtype=getattr(torch, skeleton["dtype"]))
        elif _ARRAY in skeleton:
            out[skeleton[_ARRAY]] = torch.from_numpy(
                np.empty(skeleton["shape"], dtype=np.dtype(skeleton["dtype"])))
        else:
            for v in skeleton.get(_TUPLE, skeleton.values()):
                targets(v, out)
    elif isinstance(skeleton, list):
        for v in skeleton:
            targets(v, out)
    return out


def join(skeleton: Any, tensors: dict[str, Any]) -> Any:
    """The state `split` took apart (``tensors`` as read back)."""
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            t = tensors[skeleton[_TENSOR]]
            if isinstance(t, np.ndarray):  # a legacy checkpoint's zarr array
                t = torch.from_numpy(t.copy())
                dtype = getattr(torch, skeleton["dtype"])
                return t.view(dtype) if dtype in _BITS else t
            return t
        if _ARRAY in skeleton:
            a = tensors[skeleton[_ARRAY]]
            return a.copy() if isinstance(a, np.ndarray) else a.numpy()
        if _TUPLE in skeleton:
            return tuple(join(v, tensors) for v in skeleton[_TUPLE])
        return {(int(k[len(_INT):]) if k.startswith(_INT) else k): join(v, tensors)
                for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [join(v, tensors) for v in skeleton]
    return skeleton


# -- keys and commit records ---------------------------------------------------------------
def _key(worker: str, step: int) -> str:
    return f"{layout.worker_checkpoints(worker)}/{step:08d}"


def exists(store: ObjectStore, worker: str, step: int) -> bool:
    """Whether a checkpoint of ``worker`` after step ``step`` is committed."""
    return store.exists(f"{_key(worker, step)}.json")


def dcp_key(worker: str, step: int) -> str:
    """A new directory for one attempt at the checkpoint of ``step`` (fresh per
    attempt, so a failed attempt's files are never mixed with a later one's)."""
    return f"{_key(worker, step)}/dcp-{uuid.uuid4().hex[:12]}"


def latest_step(store: ObjectStore, worker: str) -> int | None:
    """The step of the newest committed checkpoint of ``worker``, if any."""
    keys = committed_keys(store, layout.worker_checkpoints(worker))
    if not keys:
        return None
    return int(keys[-1].rsplit("/", 1)[-1][: -len(".json")])


@dataclass(frozen=True)
class Saved:
    """A committed checkpoint's record: its step, the skeleton of the rest of the
    state and the DCP directory (``dcp``: key, files, ranks, bytes); or, for a legacy
    checkpoint, ``legacy``: its whole state as read."""

    step: int
    skeleton: Any = None
    dcp: dict | None = None
    legacy: dict | None = None


def latest(store: ObjectStore, worker: str, step: int | None = None) -> Saved | None:
    """The record of the newest (or the given) committed checkpoint of ``worker``, or
    None; the tensors are not read yet (`restore`, `load`)."""
    if step is None:
        step = latest_step(store, worker)
        if step is None:
            return None
    key = f"{_key(worker, step)}.json"
    try:
        body = json.loads(store.get(key))
    except ValueError as exc:
        raise CorruptObject(f"{store.full_url(key)} is not valid JSON") from exc
    if "arrays" in body:
        return Saved(step, legacy=_read_legacy(store, key))
    if body.get("format") != FORMAT:
        raise CorruptObject(f"{store.full_url(key)}: checkpoint format "
                            f"{body.get('format')!r} is not {FORMAT!r}")
    return Saved(step, skeleton=body["state"], dcp=body["dcp"])


def commit(store: ObjectStore, worker: str, step: int, skeleton: Any, dcp: dict,
           keep: int = 1) -> bool:
    """Commit the checkpoint whose tensors are in the DCP directory ``dcp`` (an
    `Island.save_state` entry); keep the newest ``keep`` checkpoints. False if one
    for that step was committed first (a checkpoint is immutable)."""
    body = {"format": FORMAT, "worker": worker, "step": step, "dcp": dcp, "state": skeleton}
    created = store.put_if_absent(f"{_key(worker, step)}.json",
                                  json.dumps(body, sort_keys=True).encode())
    if keep > 0:
        old = committed_keys(store, layout.worker_checkpoints(worker))[:-keep]
        for key in old:  # the commit first: a half-deleted checkpoint is never "newest"
            store.delete(key)
            store.delete_prefix(key[: -len(".json")])
    return created


# -- saving and restoring a worker ---------------------------------------------------------
def save(store: ObjectStore, worker: str, step: int, island: Island, opt: torch.optim.Optimizer,
         rest: dict | None, *, keep: int = 1, patience_s: float = 0.0) -> bool:
    """Write the checkpoint of ``worker`` after inner step ``step``: the model's and
    ``opt``'s state from ``island`` and ``rest`` (the rest of the worker's state), then
    the commit record. Called by every rank of a sharded island (each writes its
    shards; only the one with ``rest`` commits), else by the one process that saves.
    A store outage is ridden out for up to ``patience_s``. False if nothing was
    committed here (a follower, or that step's checkpoint exists)."""
    skeleton, tensors = split(rest) if rest is not None else (None, None)

    def new_key() -> str | None:
        return None if exists(store, worker, step) else dcp_key(worker, step)
    dcp = island.outlast_save(opt, store, new_key, extra=tensors, patience_s=patience_s)
    if dcp is None or rest is None:
        return False
    return outlast(lambda: commit(store, worker, step, skeleton, dcp, keep),
                   patience_s=patience_s, log=log, pause_s=2.0,
                   what=f"worker {worker}: checkpoint at step {step}")


def restore(store: ObjectStore, saved: Saved, island: Island, opt: torch.optim.Optimizer) -> dict:
    """Every rank: load the checkpoint ``saved`` into ``island``'s model and ``opt``;
    returns the rest of the worker's state."""
    if saved.legacy is not None:
        return _restore_legacy(store, saved.legacy, island, opt)
    return join(saved.skeleton, island.load_state(opt, store, saved.dcp, targets(saved.skeleton)))


def load(store: ObjectStore, worker: str, step: int | None = None) -> tuple[int, dict] | None:
    """(step, state) of the newest (or the given) checkpoint of ``worker``, all of it
    read into this one process (no process group): the rest of the state with
    ``model`` and ``optimizer`` beside it, keyed by parameter name; for tools and
    tests (a worker resumes with `restore`)."""
    saved = latest(store, worker, step)
    if saved is None:
        return None
    if saved.legacy is not None:
        return saved.step, saved.legacy
    whole = read_dcp(store, saved.dcp)
    state = join(saved.skeleton, whole.get("worker", {}))
    state.update(model=whole["model"], optimizer=whole.get("optimizer"))
    return saved.step, state


def read_dcp(store: ObjectStore, dcp: dict) -> dict[str, Any]:
    """Everything a checkpoint's DCP directory holds, read into this one process:
    ``{"model": ..., "optimizer": ..., "worker": ...}``, whatever ranks wrote it."""
    from torch.distributed.checkpoint import CheckpointException  # noqa: PLC0415
    from torch.distributed.checkpoint.format_utils import (  # noqa: PLC0415
        _EmptyStateDictLoadPlanner,
    )
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # noqa: PLC0415

    state: dict[str, Any] = {}  # filled as torch's dcp_to_torch_save fills it
    reader = checkpoint_files.new_reader(store, dcp["key"], dcp.get("files"))
    try:
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)  # the private loader: the public one needs targets
    except CheckpointException as exc:
        raise checkpoint_files.store_error(exc) from exc
    return state


# -- checkpoints written before this format (read only) -------------------------------------
def _read_legacy(store: ObjectStore, commit_key: str) -> dict:
    """The state of a checkpoint in the format before this one (its tensors zarr
    arrays named in the commit record, verified by sha256), read whole."""
    arrays, meta = read_checkpoint(store, commit_key)
    return join(meta["state"], arrays)


def _restore_legacy(store: ObjectStore, state: dict, island: Island,
                    opt: torch.optim.Optimizer) -> dict:
    """Load a legacy checkpoint's model and optimizer: the whole state dicts, or a
    sharded island's DCP directory (its ``shards``, files not pinned then)."""
    if state.get("shards") is not None:
        island.load_state(opt, store, state["shards"])
    else:
        island.load_whole(opt, state["model"], state["optimizer"])
    return state

