"""Worker checkpoints in the run's store.

A checkpoint is any nested structure of dicts, lists, numbers, strings and tensors
(model and optimizer state dicts, the synchroniser's state, the data position, RNG
states). Tensors become lossless zarr arrays; the rest becomes the JSON skeleton in
the commit record. Keys: ``workers/{worker}/ckpt/{step:08d}`` plus its commit
``.json``; written once, never overwritten; the newest committed one is loaded.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from storage import layout
from storage.checkpoints import committed_keys, read_checkpoint, write_checkpoint
from storage.objectstore import ObjectStore

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
