"""What a run's store holds, and deleting what neither a resume nor an audit needs.

`usage` adds up a run's objects by kind from one listing (``diloco status``).
`plan` decides what may go; `collect` deletes it (``diloco gc``, and the train job
when a run finishes with ``retention.after_run``). The rules follow from what reads
each kind of object later:

- **Worker checkpoints** resume a worker. While the run can still be resumed, each
  worker's newest committed checkpoint stays (older ones, and the payload of a
  checkpoint whose commit was never written, are leftovers of a crash). Once every
  party has finished, a resume has nothing left to do (``diloco resume`` refuses a
  finished run), so all of them go.
- **Canonical checkpoints** (``global/frag/``) resume the aggregator and start a
  continuation; the newest ``train.keep_checkpoints`` per fragment stay (0: all).
  Any older round can be rebuilt from the initial parameters and the means.
- **Outer-gradient payloads** (``frag/*/r*/delta/``) are read by the aggregator
  (and by a worker resuming rounds it had in flight) until their round is reduced
  and checkpointed. In a finished run they serve an audit only: the newest
  ``retention.contributions`` rounds per fragment keep theirs; the commit records,
  which name each payload's sha256, norm and token weight, always stay.
  With ``sync.codec.mean_from: peers`` the means are sums of the contributions they
  name, so those contributions are kept like means.
- **Orphans**: a payload no commit record names (an upload that lost a race or
  was retried under a new nonce). Readers never look at them; they go once the
  run has finished, when no writer can still be about to commit one.

Never deleted: the manifest, the prepared data, the initial parameters, every
commit record, the means, the members' records and status.

Deletion order keeps the store consistent if gc itself is interrupted: a
checkpoint's commit record goes before its payload, so a half-deleted checkpoint
is never found as the newest.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from storage import layout
from storage.errors import StoreError
from storage.exchange import Exchange
from storage.objectstore import ObjectStore
from workers.status import read_all

#: Kinds of object, in the order ``diloco status`` and ``diloco gc`` list them.
KINDS = ("worker checkpoints", "canonical checkpoints", "contributions", "means",
         "initial parameters", "data", "records")


def kind_of(key: str) -> str:
    """The kind of a run's key (one of `KINDS`)."""
    parts = key.split("/")
    if parts[0] == "workers" and len(parts) > 2 and parts[2] == "ckpt":
        return "worker checkpoints"
    if parts[0] == "global":
        if len(parts) > 1 and parts[1] == "init":
            return "initial parameters"
        return "canonical checkpoints"
    if parts[0] == layout.DATASET:
        return "data"
    if parts[0] == "frag" and len(parts) > 4:
        if parts[3] == "delta":
            return "contributions"
        if parts[3] == "mean":
            return "means"
    return "records"


@dataclass
class Usage:
    """Objects and bytes of a run's store, by kind."""

    objects: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, size: int) -> None:
        self.objects[kind] = self.objects.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + size

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_objects(self) -> int:
        return sum(self.objects.values())

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: {"objects": self.objects[k], "bytes": self.bytes[k]}
                for k in KINDS if k in self.objects}


def usage(store: ObjectStore, sizes: dict[str, int] | None = None) -> Usage:
    """What the run at ``store`` holds, by kind (one listing)."""
    out = Usage()
    for key, size in (store.sizes() if sizes is None else sizes).items():
        out.add(kind_of(key), size)
    return out


@dataclass
class Deletion:
    """One thing gc deletes: a key, or every key under ``prefix/``."""

    target: str
    kind: str
    why: str
    objects: int
    bytes: int
    prefix: bool = True


@dataclass
class Plan:
    """What `collect` would delete, and why."""

    run_url: str
    finished: bool
    before: Usage
    deletions: list[Deletion] = field(default_factory=list)

    @property
    def freed_bytes(self) -> int:
        return sum(d.bytes for d in self.deletions)

    @property
    def freed_objects(self) -> int:
        return sum(d.objects for d in self.deletions)

    def by_kind(self) -> dict[str, tuple[int, int]]:
        """kind -> (objects, bytes) deleted."""
        out: dict[str, tuple[int, int]] = {}
        for d in self.deletions:
            o, b = out.get(d.kind, (0, 0))
            out[d.kind] = (o + d.objects, b + d.bytes)
        return out


def run_finished(exchange: Exchange) -> bool:
    """Every worker and the aggregator say ``finished``: nothing is left to resume."""
    names = [*exchange.manifest.workers, layout.AGGREGATOR]
    states = read_all(exchange.store, names)
    return all((states[n] or {}).get("state") == "finished" for n in names)


class _Tree:
    """The listing, with helpers to size and collect what lies under a prefix."""

    def __init__(self, sizes: dict[str, int]):
        self.sizes = sizes

    def under(self, prefix: str) -> tuple[int, int]:
        want = prefix.rstrip("/") + "/"
        keys = [k for k in self.sizes if k.startswith(want)]
        return len(keys), sum(self.sizes[k] for k in keys)

    def children(self, prefix: str) -> set[str]:
        """The names directly under ``prefix/`` (files and folders alike)."""
        want = prefix.rstrip("/") + "/"
        return {k[len(want):].split("/", 1)[0] for k in self.sizes if k.startswith(want)}


def plan(exchange: Exchange, *, contributions: int | Literal["all"] | None = None,
         keep_canonical: int | None = None, keep_worker: int | None = None,
         finished: bool | None = None) -> Plan:
    """What gc would delete in the run of ``exchange`` (nothing is changed).

    The retention comes from the run's config unless given here; ``finished``
    (read from the status board unless given) decides whether resume still needs
    the worker checkpoints.
    """
    from workers.config import RunConfig  # the run's own settings, as it was created

    cfg = RunConfig.stored(exchange.manifest.config)
    contributions = cfg.retention.contributions if contributions is None else contributions
    keep_canonical = cfg.train.keep_checkpoints if keep_canonical is None else keep_canonical
    keep_worker = cfg.retention.worker_checkpoints if keep_worker is None else keep_worker
    if finished is None:
        finished = run_finished(exchange)
    store = exchange.store
    sizes = store.sizes()
    tree = _Tree(sizes)
    out = Plan(store.url, finished, usage(store, sizes))

    def drop(target: str, kind: str, why: str, *, prefix: bool = True) -> None:
        if prefix:
            n, b = tree.under(target)
        else:
            n, b = (1, sizes[target]) if target in sizes else (0, 0)
        if n:
            out.deletions.append(Deletion(target, kind, why, n, b, prefix))

    # checkpoints: committed ones beyond the newest `keep`, and payloads whose commit
    # was never written (a crash while writing) older than the newest commit; all of a
    # worker's once the run has finished
    for worker in exchange.manifest.workers:
        _checkpoints(tree, layout.worker_checkpoints(worker), "worker checkpoints", drop,
                     keep=keep_worker, everything=finished, finished=finished)
    for p in range(len(exchange.manifest.fragments)):
        _checkpoints(tree, layout.global_states(p), "canonical checkpoints", drop,
                     keep=keep_canonical, everything=False, finished=finished)
    if finished:
        _payloads(store, tree, exchange, contributions, drop)
    return out


def _checkpoints(tree: _Tree, prefix: str, kind: str, drop: Callable[..., None], *,
                 keep: int, everything: bool, finished: bool) -> None:
    """``keep`` newest committed checkpoints under ``prefix`` (0: all), or none when
    ``everything``; uncommitted folders older than the newest commit (any, once the
    run has finished: no writer is still at work)."""
    names = tree.children(prefix)
    committed = sorted(n[:-len(".json")] for n in names if n.endswith(".json"))
    newest = committed[-1] if committed else None
    if everything:
        gone, why = committed, "the run has finished: no resume needs it"
    else:
        gone, why = (committed[:-keep] if keep else []), "older than the newest kept"
    for name in gone:  # the commit first: a half-deleted checkpoint is never "newest"
        drop(f"{prefix}/{name}.json", kind, why, prefix=False)
        drop(f"{prefix}/{name}", kind, why)
    for name in sorted(n for n in names if not n.endswith(".json") and n not in committed):
        if finished or (newest is not None and name < newest):
            drop(f"{prefix}/{name}", kind, "never committed (an interrupted write)")


def _payloads(store: ObjectStore, tree: _Tree, exchange: Exchange,
              contributions: int | Literal["all"], drop: Callable[..., None]) -> None:
    """Orphan payloads, and the outer-gradient payloads of rounds beyond the
    retained ones (only for a finished run)."""
    for p in range(len(exchange.manifest.fragments)):
        rounds = sorted(r for name in tree.children(f"frag/{p}")
                        if (r := layout.parse_round(name)) is not None)
        applied = [r for r in rounds if f"{layout.round_prefix(p, r)}/mean.json" in tree.sizes]
        # a peers mean has no payload of its own: the contributions it names are it
        kept = set(rounds) if contributions == "all" or exchange.from_peers else \
            set(applied[-contributions:] if contributions else [])
        for r in rounds:
            base = layout.round_prefix(p, r)
            named = _named_payloads(store, tree, base)
            for folder, kind in ((f"{base}/delta", "contributions"), (f"{base}/mean", "means")):
                for who in sorted(tree.children(folder)):
                    for nonce in sorted(tree.children(f"{folder}/{who}")):
                        target = f"{folder}/{who}/{nonce}"
                        if target not in named:
                            drop(target, kind, "no commit record names it")
                        elif kind == "contributions" and r not in kept:
                            drop(target, kind, "beyond retention.contributions; its commit "
                                               "record stays")


def _named_payloads(store: ObjectStore, tree: _Tree, base: str) -> set[str]:
    """The payload prefixes the round's commit records name."""
    records = ([f"{base}/mean.json"]
               + [f"{base}/commits/{n}" for n in sorted(tree.children(f"{base}/commits"))]
               # a sharded aggregator's mean: each shard's part names its own payload
               + [f"{base}/part/{n}" for n in sorted(tree.children(f"{base}/part"))])
    named = set()
    for key in records:
        if key not in tree.sizes:
            continue
        try:
            payload = json.loads(store.get(key)).get("payload")
        except (StoreError, ValueError):
            continue  # unreadable: keep whatever it might name
        if isinstance(payload, str):
            named.add(payload.rstrip("/"))
    return named


def collect(exchange: Exchange, todo: Plan,
            progress: Callable[[Deletion], None] | None = None) -> int:
    """Delete what ``todo`` lists, in its order; returns the bytes freed."""
    freed = 0
    for d in todo.deletions:
        if d.prefix:
            exchange.store.delete_prefix(d.target)
        else:
            exchange.store.delete(d.target)
        freed += d.bytes
        if progress is not None:
            progress(d)
    return freed


def after_run(exchange: Exchange, *, apply: bool = True) -> dict[str, object]:
    """At the end of a finished run: gc by the run's retention (when ``apply``, i.e.
    ``retention.after_run``), then the run's size, for the report."""
    freed = 0
    if apply:
        todo = plan(exchange)
        freed = collect(exchange, todo) if todo.deletions else 0
    size = usage(exchange.store)
    return {"bytes": size.total_bytes, "objects": size.total_objects,
            "by_kind": size.as_dict(), "freed_bytes": freed}
