"""The store side of a sharded aggregator (``aggregator.shards: K`` > 1).

Shard s of K owns a contiguous range of the zarr chunks of every fragment's vectors
(workers cut their deltas into a multiple of K chunks, `storage.arrays.chunk_grid`):
it reads only those chunk objects of each contribution and publishes its part of
each mean and of the canonical state. Per (fragment, round), all create-only:

- ``check/{s}/{worker}.json`` (s >= 1): shard s's verdict on its chunks of a
  contribution: their float64 sum of squares, or why they are bad;
- ``decision.json``: shard 0's decision (weights, rejected, late, owed, norms), made
  once every shard's check of a contribution is in: a contribution counts only if
  all its chunks are good, and its norm is the square root of the summed sums of
  squares, so the norm guard sees the whole vector;
- ``part/{s}.json``: shard s's part of the mean, reduced with the decision's
  weights (with ``mean_from: peers`` it carries no payload, as the mean does not);
- ``mean.json``: written by shard 0 last, once every part is committed, so "the
  mean exists" still means it can be read whole (`read_sharded_mean` assembles it).

K = 1 writes none of these: today's layout, bit for bit.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from storage import layout
from storage.arrays import Coded, chunk_grid, hold_vector, read_array, write_array
from storage.checkpoints import committed_keys
from storage.codecs import CodecSpec
from storage.errors import CorruptObject, MisboundRecord, ObjectMissing, PartialObject

#: a storage.exchange.Exchange (not imported: it imports this module for its read path)
Exchange = Any


def shard_count(config: Mapping[str, Any]) -> int:
    """K of a run's config (``aggregator.shards``, default 1)."""
    section = config.get("aggregator") or {}
    k = section.get("shards", 1) if isinstance(section, Mapping) else 1
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"aggregator.shards must be an integer >= 1, got {k!r}")
    return k


def shard_align(down: CodecSpec) -> int:
    """Values a shard boundary is a multiple of: 64 (whole vector lanes of the outer
    step) and the blocks of the codec the mean goes down with, so each part encodes
    to the bits the whole mean would."""
    b = down.chunk if down.is_sparse else down.block_size
    return math.lcm(64, b)


@dataclass(frozen=True)
class Span:
    """What shard ``shard`` owns of a fragment: chunks ``chunks`` of ``chunk_len``
    values, i.e. the values ``lo:hi``."""

    shard: int
    chunks: range
    chunk_len: int
    lo: int
    hi: int


def span(exchange: Exchange, fragment: int, shard: int) -> Span:
    """Shard ``shard``'s chunks of ``fragment`` (an even split of the chunk count)."""
    n, k = exchange.manifest.numel(fragment), exchange.shards
    if not 0 <= shard < k:
        raise ValueError(f"shard must be in 0..{k - 1}, got {shard}")
    size, count = chunk_grid(n, exchange.up, k, shard_align(exchange.down))
    c0, c1 = shard * count // k, (shard + 1) * count // k
    return Span(shard, range(c0, c1), size, min(n, c0 * size), min(n, c1 * size))



def _json(exchange: Exchange, key: str) -> dict[str, Any] | None:
    try:
        raw = exchange.store.get(key)
    except ObjectMissing:
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise CorruptObject(f"{exchange.store.full_url(key)} is not valid JSON") from exc


def _create(exchange: Exchange, key: str, body: dict[str, Any]) -> bool:
    return exchange.store.put_if_absent(key, json.dumps(body, sort_keys=True).encode())


# -- contributions ---------------------------------------------------------------------
def hold_delta_part(exchange: Exchange, fragment: int, round: int, worker: str,
                    part: Span) -> tuple[Coded, dict[str, Any]]:
    """A contribution's values ``part.lo:part.hi``, verified and kept encoded (decoded
    a chunk at a time: `storage.arrays.Coded`), reading only the chunk objects of
    ``part`` (and zarr.json). Raises what `Exchange.fetch_delta` raises."""
    commit, what = exchange.delta_record(fragment, round, worker)
    coded = hold_vector(exchange.store, commit["payload"], commit["objects"],
                        n=exchange.manifest.numel(fragment), chunks=part.chunks,
                        chunk_len=part.chunk_len, what=f"{what} (shard {part.shard})")
    return coded, commit


def fetch_delta_part(exchange: Exchange, fragment: int, round: int, worker: str,
                     part: Span) -> tuple[np.ndarray, dict[str, Any]]:
    """`hold_delta_part`, decoded: the values ``part.lo:part.hi``."""
    coded, commit = hold_delta_part(exchange, fragment, round, worker, part)
    return coded.decode(), commit


def write_check(exchange: Exchange, fragment: int, round: int, worker: str, shard: int,
                sumsq: float | None, reason: str | None) -> None:
    """Shard ``shard``'s verdict on its chunks of a contribution (first one wins)."""
    _create(exchange, layout.shard_check(fragment, round, shard, worker),
            {"fragment": fragment, "round": round, "worker": worker, "shard": shard,
             "sumsq": sumsq, "reason": reason, "created": layout.utc_now()})


def read_check(exchange: Exchange, fragment: int, round: int, worker: str,
               shard: int) -> dict[str, Any] | None:
    return _json(exchange, layout.shard_check(fragment, round, shard, worker))


# -- the decision and the parts of a mean ------------------------------------------------
def decision(exchange: Exchange, fragment: int, round: int) -> dict[str, Any] | None:
    """Shard 0's decision of (fragment, round), or None while it has not decided."""
    return _json(exchange, layout.decision(fragment, round))


def publish_decision(exchange: Exchange, fragment: int, round: int, writer: str,
                     body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Commit the decision once: (the decision in force, whether this one is it)."""
    record = {"kind": "decision", "run": exchange.manifest.run_id, "fragment": fragment,
              "round": round, "writer": writer, "created": layout.utc_now(), **body}
    if _create(exchange, layout.decision(fragment, round), record):
        return record, True
    got = decision(exchange, fragment, round)
    if got is None:  # pragma: no cover - the commit we lost to must exist
        raise ObjectMissing(f"decision of fragment {fragment} round {round} vanished")
    return got, False


def publish_part(exchange: Exchange, fragment: int, round: int, part: Span, writer: str,
                 x: np.ndarray) -> tuple[np.ndarray, bool]:
    """Encode and commit shard ``part.shard``'s part of the mean, once: (the decoded
    part in force, whether this call created it). With ``mean_from: peers`` the part
    is the exact weighted sum every reader computes: no payload."""
    layout.check_name("writer", writer)
    existing = fetch_part(exchange, fragment, round, part)
    if existing is not None:
        return (x if existing is True else existing), False
    record = {"kind": "mean-part", "run": exchange.manifest.run_id, "fragment": fragment,
              "round": round, "shard": part.shard, "writer": writer, "lo": part.lo,
              "hi": part.hi, "created": layout.utc_now()}
    decoded = x
    if not exchange.from_peers:
        payload = layout.mean_payload(fragment, round, writer, uuid.uuid4().hex[:16])
        objects, decoded = write_array(exchange.store, payload, x, exchange.down)
        record.update(payload=payload, objects=objects)
    if _create(exchange, layout.mean_part(fragment, round, part.shard), record):
        return decoded, True
    got = fetch_part(exchange, fragment, round, part)
    if got is None:  # pragma: no cover - the commit we lost to must exist
        raise ObjectMissing(f"part {part.shard} of the mean of fragment {fragment} "
                            f"round {round} vanished")
    return (x if got is True else got), False


def fetch_part(exchange: Exchange, fragment: int, round: int,
               part: Span) -> np.ndarray | bool | None:
    """Shard ``part.shard``'s committed part of the mean (decoded and verified), True
    for a committed part without payload (peers), None while there is none."""
    key = layout.mean_part(fragment, round, part.shard)
    commit = _json(exchange, key)
    if commit is None:
        return None
    what = f"part {part.shard} of the mean of fragment {fragment} round {round}"
    for k, v in {"kind": "mean-part", "run": exchange.manifest.run_id, "fragment": fragment,
                 "round": round, "shard": part.shard, "lo": part.lo, "hi": part.hi}.items():
        if commit.get(k) != v:
            raise MisboundRecord(f"{what}: the record at {exchange.store.full_url(key)} says "
                                 f"{k} = {commit.get(k)!r}, its key says {v!r}")
    if "payload" not in commit:
        return True
    slot = layout.mean_payload(fragment, round, str(commit.get("writer")), "")
    if not str(commit["payload"]).startswith(slot) or ".." in str(commit["payload"]):
        raise MisboundRecord(f"{what}: payload {commit['payload']!r} is outside {slot}")
    return read_array(exchange.store, commit["payload"], commit["objects"],
                      shape=(part.hi - part.lo,), dtype=np.float32, finite=True, what=what)


def assemble_mean(exchange: Exchange, fragment: int, round: int, writer: str) -> bool:
    """Shard 0: commit ``mean.json`` (the decision, naming the K parts) once every part
    is committed; True when the mean is committed (by now or before)."""
    key = layout.mean_commit(fragment, round)
    if exchange.store.exists(key):
        return True
    k = exchange.shards
    if not all(exchange.store.exists(layout.mean_part(fragment, round, s)) for s in range(k)):
        return False
    body = decision(exchange, fragment, round)
    if body is None:  # pragma: no cover - parts follow the decision
        return False
    body = {**body, "kind": "mean", "writer": writer, "shards": k,
            "numel": exchange.manifest.numel(fragment), "created": layout.utc_now(),
            "parts": [layout.mean_part(fragment, round, s) for s in range(k)]}
    if exchange.from_peers:
        body["mean_from"] = "peers"
    else:
        body["codec"] = exchange.codec_record(exchange.down)
    _create(exchange, key, body)
    return True


def read_sharded_mean(exchange: Exchange, fragment: int, round: int,
                      commit: dict[str, Any]) -> np.ndarray:
    """The mean of a sharded aggregator, assembled from its K parts."""
    if commit.get("shards") != exchange.shards:
        raise MisboundRecord(f"mean of fragment {fragment} round {round}: {commit.get('shards')} "
                             f"shards, the run has {exchange.shards}")
    out = np.empty(exchange.manifest.numel(fragment), np.float32)
    for s in range(exchange.shards):
        part = span(exchange, fragment, s)
        got = fetch_part(exchange, fragment, round, part)
        if not isinstance(got, np.ndarray):
            raise PartialObject(f"mean of fragment {fragment} round {round}: part {s} "
                                f"is not committed with its values")
        out[part.lo:part.hi] = got
    return out


# -- the canonical state ------------------------------------------------------------------
def latest_part(exchange: Exchange, fragment: int, shard: int) -> tuple[int, str] | None:
    """(round, commit key) of shard ``shard``'s newest canonical part of ``fragment``:
    from the newest whole checkpoint on (every part of it exists), probing upward."""
    rounds = [layout.parse_round(k.rsplit("/", 1)[-1][: -len(".json")])
              for k in committed_keys(exchange.store, layout.global_states(fragment))]
    r = max((x for x in rounds if x is not None), default=-1)
    best = None
    if r >= 0 and exchange.store.exists(part_commit(fragment, r, shard)):
        best = (r, part_commit(fragment, r, shard))
    while exchange.store.exists(part_commit(fragment, r + 1, shard)):
        r += 1
        best = (r, part_commit(fragment, r, shard))
    return best


def part_commit(fragment: int, round: int, shard: int) -> str:
    return f"{layout.global_part(fragment, round, shard)}.json"


def assemble_checkpoint(exchange: Exchange, fragment: int, round: int,
                        meta: dict[str, Any]) -> bool:
    """Shard 0: commit the round's canonical checkpoint (naming the K parts, which
    `storage.checkpoints.read_checkpoint` concatenates) once every part is in; True
    when it is committed (by now or before)."""
    key = layout.global_commit(fragment, round)
    if exchange.store.exists(key):
        return True
    parts = [part_commit(fragment, round, s) for s in range(exchange.shards)]
    if not all(exchange.store.exists(p) for p in parts):
        return False
    _create(exchange, key, {"arrays": {}, "parts": parts, "meta": meta})
    return True
