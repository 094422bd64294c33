"""Checkpoints: named numpy arrays plus metadata, committed once.

Used for the canonical state after each fragment round (``global/frag/{p}/r...``)
and for the initial canonical parameters; worker checkpoints are
torch.distributed.checkpoint (workers/checkpoint.py), which reads this format only for
runs written before. Arrays are stored
losslessly as zarr arrays; a create-only commit record names them, so a checkpoint
either exists whole and verified or does not exist at all.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np

from storage.arrays import read_array, write_array
from storage.errors import CorruptObject, ObjectMissing
from storage.objectstore import ObjectStore


def write_checkpoint(
    store: ObjectStore,
    prefix: str,
    commit_key: str,
    arrays: dict[str, np.ndarray],
    meta: dict[str, Any] | None = None,
) -> bool:
    """Write ``arrays`` under ``prefix`` and commit them at ``commit_key``.

    Returns False (and writes nothing more) if the commit already exists: a
    checkpoint is immutable, and the one committed first is the one in force.
    """
    if store.exists(commit_key):
        return False
    base = f"{prefix}/{uuid.uuid4().hex[:12]}"
    entries = {}
    for name, value in arrays.items():
        value = np.asarray(value)
        if not value.dtype.isnative:
            value = value.astype(value.dtype.newbyteorder("="))
        record, _ = write_array(store, f"{base}/{name}", value)
        entries[name] = {
            "prefix": f"{base}/{name}",
            "objects": record,
            "shape": list(value.shape),
            "dtype": value.dtype.str,
        }
    body = {"arrays": entries, "meta": meta or {}}
    return store.put_if_absent(commit_key, json.dumps(body, sort_keys=True).encode())


def read_checkpoint(
    store: ObjectStore, commit_key: str
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read and verify a committed checkpoint: (arrays, meta). A checkpoint of a
    sharded aggregator names its parts (``parts``: the shards' checkpoint commits,
    in order), whose arrays are concatenated."""
    raw = store.get(commit_key)
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise CorruptObject(f"{store.full_url(commit_key)} is not valid JSON") from exc
    if body.get("parts"):
        pieces = [read_checkpoint(store, key)[0] for key in body["parts"]]
        names = set(pieces[0])
        if any(set(p) != names for p in pieces):
            raise CorruptObject(f"{store.full_url(commit_key)}: its parts hold different arrays")
        return ({n: np.concatenate([p[n] for p in pieces]) for n in sorted(names)},
                body.get("meta", {}))
    arrays = {}
    for name, entry in body["arrays"].items():
        arrays[name] = read_array(
            store,
            entry["prefix"],
            entry["objects"],
            shape=tuple(entry["shape"]),
            dtype=np.dtype(entry["dtype"]),
            what=f"checkpoint {store.full_url(commit_key)} array {name}",
        )
    return arrays, body.get("meta", {})


def has_checkpoint(store: ObjectStore, commit_key: str) -> bool:
    return store.exists(commit_key)


def committed_keys(store: ObjectStore, prefix: str) -> list[str]:
    """Commit records (``*.json``) directly under ``prefix``, sorted."""
    out = []
    for key in store.list(prefix):
        rest = key[len(prefix) + 1 :] if key.startswith(prefix + "/") else key
        if "/" not in rest and rest.endswith(".json"):
            out.append(key)
    return sorted(out)


__all__ = ["write_checkpoint", "read_checkpoint", "has_checkpoint", "committed_keys",
           "ObjectMissing"]
