"""The exchange protocol: publish, commit, discover and fetch outer gradients and means.

A worker's outer gradient for (fragment, round) is written as a zarr array under a
fresh nonce, then made visible by a create-only commit record naming it. The
aggregator lists the commit records of a round, fetches and verifies each
contribution, and publishes the mean the same way: whoever creates ``mean.json``
first wins, and a loser adopts the winner's mean, so there is exactly one mean per
(fragment, round) even when two aggregators race. Nothing is ever overwritten.

The way down has two forms (``sync.codec.mean_from``). ``aggregator``: the mean is a
payload of its own, encoded with ``codec_down``. ``peers``: the mean's commit holds
no payload, only the decision (which contributions, with which weights); every
reader fetches those contributions itself and sums them with `weighted_sum`, the
same arithmetic the aggregator used, so all parties hold the same bits without a
second rounding. It suits the sparse codecs, whose M contributions together are
smaller than one dense mean.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from storage import layout
from storage.arrays import Coded, encode_array, hold_vector, write_array
from storage.codecs import CodecSpec
from storage.errors import (
    BAD_CONTRIBUTION,
    CorruptObject,
    MisboundRecord,
    ObjectMissing,
    ShapeMismatch,
    StoreError,
)
from storage.objectstore import ObjectStore
from storage.shards import read_sharded_mean, shard_align, shard_count
from storage.spec import RunManifest

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """An outer gradient encoded in memory, ready to upload."""

    fragment: int
    round: int
    worker: str
    payload: str
    blobs: dict[str, bytes]
    record: dict[str, dict[str, Any]]
    decoded: np.ndarray


@dataclass
class Published:
    """The outcome of a publish: the decoded value in force and its commit record.

    ``created`` is False when an earlier commit existed (a restarted worker, or an
    aggregator that lost a race); ``decoded`` is then the committed value.
    """

    decoded: np.ndarray
    commit: dict[str, Any]
    created: bool


#: values a term of `weighted_sum` is scaled in at a time (4 MiB of float32 scratch)
_SPAN = 1 << 20


def weighted_sum(n: int, values: Mapping[str, np.ndarray | Coded],
                 weights: Mapping[str, float]) -> np.ndarray:
    """``sum_m float32(w_m) * x_m`` over the keys in sorted order, in float32 with two
    roundings per term (the product, then the sum), starting from +0. The mean of a
    round; the aggregator and, with ``mean_from: peers``, every worker call this one
    function, so they agree to the bit.

    A value may be a decoded array or a verified contribution still encoded
    (`storage.arrays.Coded`; a shard's part of one starts at index 0 of this sum):
    it is decoded a zarr chunk at a time, scaled in place and added, so the sum
    holds one float32 vector and one chunk of scratch however many contributions it
    takes. Every element still sees the same
    operations in the same order (term by term, keys sorted), so the bits are those
    of summing whole decoded arrays."""
    acc = np.zeros(n, np.float32)
    scratch: np.ndarray | None = None
    for key in sorted(weights):
        value, w = values[key], np.float32(weights[key])
        if isinstance(value, Coded):
            if scratch is None or scratch.size < value.chunk_len:
                scratch = np.empty(value.chunk_len, np.float32)
            for offset, piece in value.pieces(scratch[:value.chunk_len]):
                np.multiply(piece, w, out=piece)
                acc[offset:offset + piece.size] += piece
            continue
        for lo in range(0, n, _SPAN):
            hi = min(n, lo + _SPAN)
            if scratch is None or scratch.size < hi - lo:
                scratch = np.empty(hi - lo, np.float32)
            term = np.multiply(value[lo:hi], w, out=scratch[:hi - lo])
            acc[lo:hi] += term
    return acc


def contribution_of(key: str, round: int) -> tuple[str, int]:
    """(worker, round) of a mean's weight key: ``w`` is the round's own contribution,
    ``w@k`` one of round ``k`` applied late in this mean."""
    worker, _, k = key.partition("@")
    return worker, (int(k) if k else round)



def _nonce() -> str:
    return uuid.uuid4().hex[:16]


class Exchange:
    """Reads and writes one run's outer gradients and means (numpy in, numpy out)."""

    def __init__(self, store: ObjectStore, manifest: RunManifest):
        self.store = store
        self.manifest = manifest
        self.up = manifest.codec_up.spec()
        self.down = manifest.codec_down.spec()
        #: the aggregator's shards (``aggregator.shards``): deltas are cut into a
        #: multiple of this many zarr chunks, and means are published in this many parts
        self.shards = shard_count(manifest.config)

    # -- helpers -----------------------------------------------------------------
    @staticmethod
    def codec_record(spec: CodecSpec) -> dict[str, Any]:
        """How a commit names its codec: ``{"name", "block_size"}`` (and ``chunk``,
        ``k`` for the sparse codecs)."""
        record = {"name": spec.name, "block_size": spec.block_size}
        if spec.is_sparse:
            record.update(chunk=spec.chunk, k=spec.k)
        return record

    def _check_fragment(self, fragment: int, round: int) -> None:
        if not 0 <= fragment < len(self.manifest.fragments):
            raise ValueError(
                f"fragment {fragment} is not in the run (0..{len(self.manifest.fragments) - 1})"
            )
        if round < 0:
            raise ValueError(f"round must be >= 0, got {round}")

    def _check_vector(self, fragment: int, x: np.ndarray, what: str) -> None:
        n = self.manifest.numel(fragment)
        if x.dtype != np.float32 or x.shape != (n,):
            raise ShapeMismatch(
                f"{what}: expected float32 of shape ({n},), got {x.dtype} {x.shape}"
            )

    def _read_json(self, key: str) -> dict[str, Any]:
        raw = self.store.get(key)
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise CorruptObject(f"{self.store.full_url(key)} is not valid JSON") from exc

    def _check_binding(self, commit: dict[str, Any], key: str, *, kind: str, fragment: int,
                       round: int, party: tuple[str, str], slot: str, what: str) -> None:
        """A record must describe the object at its own key: copied to another round
        or worker slot (a replay), it would pass every checksum of its payload."""
        field_, name = party
        expected = {"kind": kind, "run": self.manifest.run_id, "fragment": fragment,
                    "round": round, field_: name}
        for k, v in expected.items():
            if commit.get(k) != v:
                raise MisboundRecord(
                    f"{what}: the record at {self.store.full_url(key)} says {k} = "
                    f"{commit.get(k)!r}, its key says {v!r}"
                )
        payload = commit.get("payload")
        if not isinstance(payload, str) or not payload.startswith(slot + "/") or (
            "/" in payload[len(slot) + 1:] or ".." in payload):
            raise MisboundRecord(
                f"{what}: the record at {self.store.full_url(key)} names payload "
                f"{payload!r}, outside its slot {slot}/"
            )
        objects = commit.get("objects")
        if not isinstance(objects, dict) or any(
                not isinstance(k, str) or k.startswith("/") or ".." in k.split("/")
                for k in objects):
            raise MisboundRecord(
                f"{what}: the record at {self.store.full_url(key)} lists objects outside "
                f"its payload"
            )

    # -- worker side ----------------------------------------------------------------
    def prepare_delta(self, fragment: int, round: int, worker: str, x: np.ndarray) -> Prepared:
        """Encode an outer gradient in memory, without any I/O.

        Split from the upload so that a worker gets the decoded value (needed for
        error feedback and the eager rule) as soon as encoding is done, while the
        bytes are still on their way.
        """
        self._check_fragment(fragment, round)
        layout.check_name("worker", worker)
        what = f"delta of worker {worker} for fragment {fragment} round {round}"
        self._check_vector(fragment, x, what)
        payload = layout.delta_payload(fragment, round, worker, _nonce())
        blobs, record, decoded = encode_array(payload, x, self.up, self.shards,
                                              shard_align(self.down))
        return Prepared(fragment, round, worker, payload, blobs, record, decoded)

    def publish_prepared(
        self, prepared: Prepared, *, tokens: int, extra: dict[str, Any] | None = None
    ) -> Published:
        """Upload and commit a prepared outer gradient.

        If the worker already committed this round (it was restarted), the committed
        value is returned instead, so the worker goes on with what the aggregator sees.
        """
        p, r, worker = prepared.fragment, prepared.round, prepared.worker
        what = f"delta of worker {worker} for fragment {p} round {r}"
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        commit_key = layout.delta_commit(p, r, worker)
        if self.store.exists(commit_key):
            return self._adopt_own(prepared, what)
        self.store.put_many(prepared.blobs)
        commit = {
            "kind": "delta",
            "run": self.manifest.run_id,
            "fragment": p,
            "round": r,
            "worker": worker,
            "tokens": int(tokens),
            "numel": int(prepared.decoded.size),
            "codec": self.codec_record(self.up),
            "payload": prepared.payload,
            "objects": prepared.record,
            "created": layout.utc_now(),
            **(extra or {}),
        }
        if self.store.put_if_absent(commit_key, json.dumps(commit, sort_keys=True).encode()):
            return Published(prepared.decoded, commit, True)
        return self._adopt_own(prepared, what)

    def _adopt_own(self, prepared: Prepared, what: str) -> Published:
        """The slot holds an earlier attempt's commit: go on with what it holds.

        If that commit cannot be used (corrupt, partial, misbound, non-finite), the
        aggregator rejects it or already has, so the mean counts it with weight 0;
        the worker goes on with this attempt's value, which it applies and later
        takes back exactly as it would an unused contribution. It must not fail for
        ever on an object it can never replace (commits are create-only)."""
        p, r, worker = prepared.fragment, prepared.round, prepared.worker
        log.warning("%s: committed already by an earlier attempt; adopting it", what)
        try:
            value, commit = self.fetch_delta(p, r, worker)
        except BAD_CONTRIBUTION as exc:
            log.warning("%s: the earlier commit is unusable and will not be counted "
                        "(%s: %s); going on", what, type(exc).__name__, exc)
            return Published(prepared.decoded, {"unusable": f"{type(exc).__name__}: {exc}"},
                             False)
        return Published(value, commit, False)

    def publish_delta(
        self,
        fragment: int,
        round: int,
        worker: str,
        x: np.ndarray,
        *,
        tokens: int,
        extra: dict[str, Any] | None = None,
    ) -> Published:
        """Encode, upload and commit worker ``worker``'s outer gradient."""
        prepared = self.prepare_delta(fragment, round, worker, x)
        return self.publish_prepared(prepared, tokens=tokens, extra=extra)

    def mean_commit(self, fragment: int, round: int) -> dict[str, Any] | None:
        """The mean's commit record, or None while no mean is committed."""
        try:
            return self._read_json(layout.mean_commit(fragment, round))
        except ObjectMissing:
            return None

    @property
    def from_peers(self) -> bool:
        """Whether means are summed by their readers from the contributions they name
        (``sync.codec.mean_from: peers``) rather than published as payloads."""
        sync = self.manifest.sync
        chosen = (sync.get("codec") or {}).get("mean_from", sync.get("mean_from"))
        if chosen is None:  # an old run's flat config left the default unresolved:
            return self.up.is_sparse  # peers for a sparse codec (SyncConfig's rule)
        return chosen == "peers"

    def fetch_mean(
        self, fragment: int, round: int, known: Mapping[str, np.ndarray] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]] | None:
        """The decoded, verified mean of (fragment, round), or None if not committed.

        ``known``: contributions the caller holds already, by weight key (a worker's
        own), which a peers mean then does not read again."""
        self._check_fragment(fragment, round)
        commit = self.mean_commit(fragment, round)
        if commit is None:
            return None
        what = f"mean of fragment {fragment} round {round}"
        if commit.get("mean_from") == "peers":
            return self._peers_mean(fragment, round, commit, known or {}, what), commit
        if commit.get("shards", 1) > 1:  # the parts of a sharded aggregator, assembled
            return read_sharded_mean(self, fragment, round, commit), commit
        self._check_binding(
            commit, layout.mean_commit(fragment, round), kind="mean", fragment=fragment,
            round=round, party=("writer", commit.get("writer")),
            slot=layout.mean_payload(fragment, round, str(commit.get("writer")), "")[:-1],
            what=what,
        )
        value = hold_vector(self.store, commit["payload"], commit["objects"],
                            n=self.manifest.numel(fragment), what=what).decode()
        return value, commit

    def _peers_mean(self, fragment: int, round: int, commit: dict[str, Any],
                    known: Mapping[str, np.ndarray], what: str) -> np.ndarray:
        """Sum the contributions a peers mean names, each fetched and verified as the
        aggregator did (the commit records name their sha256)."""
        expected = {"kind": "mean", "run": self.manifest.run_id, "fragment": fragment,
                    "round": round}
        for k, v in expected.items():
            if commit.get(k) != v:
                raise MisboundRecord(
                    f"{what}: the record at {self.store.full_url(layout.mean_commit(fragment, round))}"
                    f" says {k} = {commit.get(k)!r}, its key says {v!r}")
        weights = commit.get("weights")
        if not isinstance(weights, dict):
            raise CorruptObject(f"{what}: the commit names no weights")
        values: dict[str, np.ndarray | Coded] = {}
        for key in sorted(weights):
            worker, k = contribution_of(key, round)
            values[key] = known[key] if key in known else self.hold_delta(fragment, k, worker)[0]
        return weighted_sum(self.manifest.numel(fragment), values, weights)

    # -- aggregator side ----------------------------------------------------------
    def committed_workers(self, fragment: int, round: int) -> list[str]:
        """Workers whose outer gradient for (fragment, round) is committed, sorted."""
        prefix = layout.delta_commits(fragment, round)
        names = []
        for key in self.store.list(prefix):
            name = key.rsplit("/", 1)[-1]
            if name.endswith(".json"):
                names.append(name[: -len(".json")])
        return sorted(names)

    def delta_commit(self, fragment: int, round: int, worker: str) -> dict[str, Any]:
        return self._read_json(layout.delta_commit(fragment, round, worker))

    def fetch_delta(
        self, fragment: int, round: int, worker: str
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Fetch and verify one committed contribution. Raises a StoreError subclass
        (PartialObject, CorruptObject, ShapeMismatch, NonFiniteValues) if it is bad."""
        coded, commit = self.hold_delta(fragment, round, worker)
        return coded.decode(), commit

    def hold_delta(self, fragment: int, round: int, worker: str) -> tuple[Coded, dict[str, Any]]:
        """One committed contribution fetched and verified (sizes, sha256, every chunk)
        but kept encoded, for `weighted_sum` to decode a chunk at a time; a chunk that
        does not decode or holds NaN/Inf raises when it is decoded (`Coded.pieces`:
        ``Coded.sumsq`` is a first pass that checks them all). Raises what
        `fetch_delta` raises."""
        commit, what = self.delta_record(fragment, round, worker)
        coded = hold_vector(self.store, commit["payload"], commit["objects"],
                            n=self.manifest.numel(fragment), what=what)
        return coded, commit

    def delta_record(self, fragment: int, round: int, worker: str
                     ) -> tuple[dict[str, Any], str]:
        """A contribution's commit record, checked (binding, size, codec) before any of
        its payload is read: (record, how errors name it)."""
        what = f"delta of worker {worker} for fragment {fragment} round {round}"
        commit = self.delta_commit(fragment, round, worker)
        self._check_binding(
            commit, layout.delta_commit(fragment, round, worker), kind="delta",
            fragment=fragment, round=round, party=("worker", worker),
            slot=layout.delta_payload(fragment, round, worker, "")[:-1], what=what,
        )
        n = self.manifest.numel(fragment)
        if commit.get("numel") != n:
            raise ShapeMismatch(f"{what}: {commit.get('numel')} values, the run expects {n}")
        codec = commit.get("codec", {})
        if codec != self.codec_record(self.up):
            raise CorruptObject(f"{what}: codec {codec}, the run uses {self.up}")
        return commit, what

    def publish_mean(
        self,
        fragment: int,
        round: int,
        writer: str,
        x: np.ndarray,
        *,
        weights: dict[str, float],
        extra: dict[str, Any] | None = None,
    ) -> Published:
        """Encode and commit the mean of (fragment, round), exactly once per run.

        Returns ``created=False`` and the winner's decoded mean when another writer
        committed first.
        """
        self._check_fragment(fragment, round)
        layout.check_name("writer", writer)
        what = f"mean of fragment {fragment} round {round}"
        self._check_vector(fragment, x, what)
        commit_key = layout.mean_commit(fragment, round)
        existing = self.fetch_mean(fragment, round)
        if existing is not None:
            return Published(existing[0], existing[1], False)
        commit = {
            "kind": "mean",
            "run": self.manifest.run_id,
            "fragment": fragment,
            "round": round,
            "writer": writer,
            "weights": {k: float(v) for k, v in sorted(weights.items())},
            "numel": int(x.size),
            "created": layout.utc_now(),
        }
        if self.from_peers:  # x is weighted_sum of the named contributions: no payload
            decoded = x
            commit["mean_from"] = "peers"
        else:
            payload = layout.mean_payload(fragment, round, writer, _nonce())
            record, decoded = write_array(self.store, payload, x, self.down)
            commit.update(codec=self.codec_record(self.down), payload=payload,
                          objects=record)
        commit.update(extra or {})
        if self.store.put_if_absent(commit_key, json.dumps(commit, sort_keys=True).encode()):
            return Published(decoded, commit, True)
        log.info("%s: another aggregator committed first; adopting its mean", what)
        existing = self.fetch_mean(fragment, round)
        if existing is None:  # pragma: no cover - the commit we lost to must exist
            raise StoreError(f"{what}: commit lost a race but cannot be read back")
        return Published(existing[0], existing[1], False)

    def record_rejection(self, fragment: int, round: int, worker: str, reason: str) -> None:
        """Leave a note that a contribution was rejected (first note wins)."""
        body = {"fragment": fragment, "round": round, "worker": worker,
                "reason": reason, "created": layout.utc_now()}
        self.store.put_if_absent(
            layout.rejected(fragment, round, worker), json.dumps(body).encode()
        )

    def rejections(self, fragment: int, round: int) -> dict[str, str]:
        """worker -> reason, for the contributions of (fragment, round) rejected."""
        prefix = f"{layout.round_prefix(fragment, round)}/rejected"
        out = {}
        for key in self.store.list(prefix):
            body = self._read_json(key)
            out[body["worker"]] = body["reason"]
        return out
