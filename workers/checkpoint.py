"""Worker checkpoints in the run's store.

A checkpoint is any nested structure of dicts, lists, numbers, strings and tensors
(model and optimizer state dicts, the synchroniser's state, the data position, RNG
states). Tensors become lossless zarr arrays; the rest becomes the JSON skeleton in
the commit record. Keys: ``workers/{worker}/ckpt/{step:08d}`` plus its commit
``.json``; written once, never overwritten; the newest committed one is loaded.

A sharded (``train.island: fsdp``) island's model and AdamW state are not in the
skeleton: each rank writes its own shards with torch.distributed.checkpoint into
``{step:08d}/dcp-{id}`` (`shards_key`) of the same store, through the store's
fsspec filesystem (`shards_writer`, `shards_reader`), and the skeleton names that
directory. The commit record is written only after every rank finished its shards,
so it stays the one atomic switch: a crash before it leaves the previous checkpoint
the newest, and the orphan directory is what ``diloco gc`` removes as "never
committed". Retention deletes a checkpoint's whole ``{step:08d}`` prefix, shards too.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from storage import layout
from storage.checkpoints import committed_keys, read_checkpoint, write_checkpoint
from storage.objectstore import ObjectStore

if TYPE_CHECKING:  # DCP is imported where used: only sharded islands need it
    from torch.distributed.checkpoint import Metadata
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

log = logging.getLogger(__name__)

_TENSOR = "__tensor__"
_ARRAY = "__ndarray__"
_TUPLE = "__tuple__"
# numpy has no bfloat16: such tensors travel as int16 bits and are viewed back.
_BITS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}


def _flatten(obj: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = f"t{len(arrays)}"
        t = obj.detach().cpu()
        dtype = str(t.dtype).removeprefix("torch.")
        if t.dtype in _BITS:
            t = t.view(_BITS[t.dtype])
        arrays[key] = t.contiguous().numpy()
        return {_TENSOR: key, "dtype": dtype}
    if isinstance(obj, np.ndarray):
        key = f"t{len(arrays)}"
        arrays[key] = np.ascontiguousarray(obj)
        return {_ARRAY: key}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out[str(k) if not isinstance(k, int) else f"__int__{k}"] = _flatten(v, arrays)
        return out
    if isinstance(obj, tuple):
        return {_TUPLE: [_flatten(v, arrays) for v in obj]}
    if isinstance(obj, list):
        return [_flatten(v, arrays) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"cannot checkpoint a value of type {type(obj).__name__}")


def _unflatten(obj: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(obj, dict):
        if _TENSOR in obj:
            t = torch.from_numpy(arrays[obj[_TENSOR]].copy())
            dtype = getattr(torch, obj["dtype"])
            return t.view(dtype) if dtype in _BITS else t
        if _ARRAY in obj:
            return arrays[obj[_ARRAY]].copy()
        if _TUPLE in obj:
            return tuple(_unflatten(v, arrays) for v in obj[_TUPLE])
        out = {}
        for k, v in obj.items():
            key: Any = int(k[len("__int__"):]) if k.startswith("__int__") else k
            out[key] = _unflatten(v, arrays)
        return out
    if isinstance(obj, list):
        return [_unflatten(v, arrays) for v in obj]
    return obj


def _key(worker: str, step: int) -> str:
    return f"{layout.worker_checkpoints(worker)}/{step:08d}"


def exists(store: ObjectStore, worker: str, step: int) -> bool:
    """Whether a checkpoint of ``worker`` after step ``step`` is committed."""
    return store.exists(f"{_key(worker, step)}.json")


def shards_key(worker: str, step: int) -> str:
    """A new directory for one attempt at a sharded checkpoint of ``step`` (fresh per
    attempt, so a crashed attempt's files are never mixed with a later one's)."""
    return f"{_key(worker, step)}/dcp-{uuid.uuid4().hex[:12]}"


def shards_writer(store: ObjectStore, key: str) -> FsspecWriter:
    """A DCP writer into ``key`` of ``store`` on the store's own filesystem (its
    credentials and endpoint): one file per rank plus rank 0's ``.metadata``. Files
    on a local disk are fsynced; an object store's upload is durable once it returns
    (and DCP, finding no file descriptor there, would ``os.sync()`` the whole host)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # noqa: PLC0415

    protocols = store.fs.protocol if isinstance(store.fs.protocol, tuple) else (store.fs.protocol,)
    writer = FsspecWriter(store.fs_path(key), single_file_per_rank=True, overwrite=False,
                          sync_files="file" in protocols)
    writer.fs.fs, writer.path = store.fs, store.fs_path(key)
    return writer


def shards_reader(store: ObjectStore, key: str) -> FsspecReader:
    """A DCP reader of the sharded checkpoint at ``key`` of ``store``."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # noqa: PLC0415

    reader = FsspecReader(store.fs_path(key))
    reader.fs.fs, reader.path = store.fs, store.fs_path(key)
    return reader


def read_shards(store: ObjectStore, ref: dict) -> dict[str, Any]:
    """The whole state a sharded checkpoint (a ``shards`` entry) holds, read into this
    one process (no process group): ``{"model": ..., "optimizer": ...}`` keyed by
    parameter name, as a replicated island's checkpoint holds them; for tools and
    tests (a resume reads only each rank's part: `workers.island.Island.load_shards`)."""
    from torch.distributed.checkpoint.format_utils import (  # noqa: PLC0415
        _EmptyStateDictLoadPlanner,
    )
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # noqa: PLC0415

    state: dict[str, Any] = {}  # filled as torch's dcp_to_torch_save fills it
    _load_state_dict(state, storage_reader=shards_reader(store, ref["key"]),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def count_shards(store: ObjectStore, key: str, metadata: Metadata) -> int:
    """Record the bytes every rank wrote for the sharded checkpoint at ``key`` in
    ``store``'s traffic (DCP writes past `ObjectStore`, and the bill counts
    checkpoint bytes); returns them. ``metadata``: what ``dcp.save`` returned."""
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0),
                                        info.offset + info.length)
    sizes[".metadata"] = store.size(f"{key}/.metadata")
    for name, size in sizes.items():
        store.traffic.record("put", f"{key}/{name}", up=size, stored=True)
    return sum(sizes.values())


def save(store: ObjectStore, worker: str, step: int, state: dict[str, Any], keep: int = 1) -> bool:
    """Write the checkpoint of ``worker`` after inner step ``step``; keep the newest
    ``keep`` checkpoints. Returns False if one for that step exists already."""
    arrays: dict[str, np.ndarray] = {}
    skeleton = _flatten(state, arrays)
    created = write_checkpoint(
        store, _key(worker, step), f"{_key(worker, step)}.json", arrays,
        {"worker": worker, "step": step, "state": skeleton},
    )
    if keep > 0:
        old = committed_keys(store, layout.worker_checkpoints(worker))[:-keep]
        for commit in old:  # the commit first: a half-deleted checkpoint is never "newest"
            store.delete(commit)
            store.delete_prefix(commit[: -len(".json")])
    return created


def latest_step(store: ObjectStore, worker: str) -> int | None:
    """The step of the newest committed checkpoint of ``worker``, if any."""
    keys = committed_keys(store, layout.worker_checkpoints(worker))
    if not keys:
        return None
    return int(keys[-1].rsplit("/", 1)[-1][: -len(".json")])


def load(store: ObjectStore, worker: str, step: int | None = None) -> tuple[int, dict] | None:
    """(step, state) of the newest (or the given) checkpoint of ``worker``, or None."""
    if step is None:
        step = latest_step(store, worker)
        if step is None:
            return None
    arrays, meta = read_checkpoint(store, f"{_key(worker, step)}.json")
    return step, _unflatten(meta["state"], arrays)
