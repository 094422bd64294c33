"""Where every object of a run lives, relative to the run's root URL, and who writes it.

`KEYS` declares every kind of key a run writes and the one role that writes it::

    launcher  (the train job, ``diloco run/resume/cancel``, ``python -m workers --create``)
    run.json                                     run manifest (created once)
    global/init/{p}.json, global/init/{p}/...    initial canonical parameters
    data/...                                     prepared token data (data.dataset unset)
    tracking.json                                the MLflow parent run of the run
    members/launcher.json                        how the jobs were launched
    members/train/status.json                    the train job's status
    control/cancel.json                          a cancel request (deleted on resume)
    control/cancelled/{time}.json                requests withdrawn by a resume
    control/leave/{worker}.json                  ``diloco leave``: a worker is asked to leave

    aggregator
    frag/{p}/r{round}/mean/{writer}/{nonce}/     a mean (zarr array)
    frag/{p}/r{round}/mean.json                  the one commit of the mean (create-only)
    frag/{p}/r{round}/rejected/{worker}.json     why a contribution was not used
    frag/{p}/r{round}/decision.json              sharded (K > 1): shard 0's decision
    frag/{p}/r{round}/check/{s}/{worker}.json    sharded: shard s's check of its chunks
    frag/{p}/r{round}/part/{s}.json              sharded: shard s's part of the mean
    global/frag/{p}/r{round}.json, .../r{round}/ canonical state after a round (pruned)
    members/aggregator.json, members/aggregator/status.json
    members/{worker}/admission.json              a joiner admitted: its data slot (create-only)

    worker:<name>  (each worker only its own keys)
    frag/{p}/r{round}/delta/{worker}/{nonce}/    its outer gradient (zarr array)
    frag/{p}/r{round}/commits/{worker}.json      its commit record (create-only)
    members/{worker}.json, members/{worker}/status.json   membership record; status = lease
    members/{worker}/left.json                   it left: its last round per fragment
    workers/{worker}/ckpt/{step}.json, .../{step}/  its checkpoints (pruned)

    viewer    reads everything, writes nothing

The functions below build the keys; the writers use them, and `owner` tells for
any key who may write it. The bucket policies of each role (infra/policies.py) are
derived from `KEYS`, so a key added here is granted to its owner and denied to
everyone else, and a key written without being declared here is caught by the
tests (tests/test_roles.py checks every key of a real run).

Payloads sit under a fresh nonce so that a retried or raced upload never overwrites
bytes someone may be reading; only the commit record names the payload in force.
Rounds are zero-padded so that listings sort in round order. A run in a local
folder also holds ``logs/<job>.log``, written by the local launcher beside the
store (never through it, never in a bucket).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property

MANIFEST = "run.json"
TRACKING = "tracking.json"
DATASET = "data"  # the run's own prepared data, when the config names no other
CANCEL = "control/cancel.json"
LAUNCHER_RECORD = "members/launcher.json"
CANONICAL_STATES = "global/frag"  # the aggregator's round checkpoints, per fragment

LAUNCHER, AGGREGATOR, WORKER, VIEWER = "launcher", "aggregator", "worker", "viewer"
#: The roles, as the bucket policies name them (a worker's is ``worker:<name>``).
ROLES = (LAUNCHER, AGGREGATOR, WORKER, VIEWER)
#: Party names whose ``members/`` keys are not a worker's: no worker may take them.
TRAIN = "train"
RESERVED = frozenset({LAUNCHER, AGGREGATOR, TRAIN})

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_name(kind: str, name: str) -> str:
    """Validate a worker or writer name: it becomes part of object keys (and, for a
    worker, of its bucket policy, so it cannot be a name another party's keys use)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"{kind} name {name!r} is not valid: use 1-64 letters, digits, '_', '.', '-', "
            f"starting with a letter or digit"
        )
    if kind == "worker" and name in RESERVED:
        raise ValueError(
            f"worker name {name!r} is reserved: members/{name}.json and members/{name}/ "
            f"are another party's keys (reserved: {', '.join(sorted(RESERVED))})"
        )
    return name


# -- the keys ---------------------------------------------------------------------------


def round_prefix(fragment: int, round: int) -> str:
    return f"frag/{fragment}/r{round:06d}"


def delta_payload(fragment: int, round: int, worker: str, nonce: str) -> str:
    return f"{round_prefix(fragment, round)}/delta/{worker}/{nonce}"


def delta_commits(fragment: int, round: int) -> str:
    return f"{round_prefix(fragment, round)}/commits"


def delta_commit(fragment: int, round: int, worker: str) -> str:
    return f"{delta_commits(fragment, round)}/{worker}.json"


def mean_payload(fragment: int, round: int, writer: str, nonce: str) -> str:
    return f"{round_prefix(fragment, round)}/mean/{writer}/{nonce}"


def mean_commit(fragment: int, round: int) -> str:
    return f"{round_prefix(fragment, round)}/mean.json"


def decision(fragment: int, round: int) -> str:
    """Shard 0's decision of a round of a sharded aggregator (which contributions, with
    which weights), which every shard follows."""
    return f"{round_prefix(fragment, round)}/decision.json"


def shard_check(fragment: int, round: int, shard: int, worker: str) -> str:
    """A shard's check of its chunks of a contribution (sum of squares, or why bad)."""
    return f"{round_prefix(fragment, round)}/check/{shard}/{worker}.json"


def mean_part(fragment: int, round: int, shard: int) -> str:
    """The commit of a shard's part of a mean."""
    return f"{round_prefix(fragment, round)}/part/{shard}.json"


def global_part(fragment: int, round: int, shard: int) -> str:
    """A shard's part of the canonical state after a round (its commit: + .json)."""
    return f"{global_state(fragment, round)}/s{shard}"


def rejected(fragment: int, round: int, worker: str) -> str:
    return f"{round_prefix(fragment, round)}/rejected/{worker}.json"


def global_init(fragment: int) -> str:
    return f"global/init/{fragment}"


def global_state(fragment: int, round: int) -> str:
    return f"{CANONICAL_STATES}/{fragment}/r{round:06d}"


def global_states(fragment: int) -> str:
    return f"{CANONICAL_STATES}/{fragment}"


def global_commit(fragment: int, round: int) -> str:
    return f"{global_state(fragment, round)}.json"


def worker_checkpoints(worker: str) -> str:
    return f"workers/{worker}/ckpt"


def member(name: str) -> str:
    """A party's registration, written once when it first starts."""
    return f"members/{name}.json"


def member_status(name: str) -> str:
    """A party's newest status: the one object of a run that is overwritten."""
    return f"members/{name}/status.json"


def admission(worker: str) -> str:
    """The aggregator's admission of a worker that joined mid-run (its data slot)."""
    return f"members/{worker}/admission.json"


def left(worker: str) -> str:
    """A worker's record that it left the run, with its last round per fragment."""
    return f"members/{worker}/left.json"


def leave_request(worker: str) -> str:
    """``diloco leave``: the request that a worker finish its round and leave."""
    return f"control/leave/{worker}.json"


def cancelled(stamp: str) -> str:
    """Where ``diloco resume`` keeps a cancel request it withdrew."""
    return f"control/cancelled/{stamp}.json"


def parse_round(segment: str) -> int | None:
    """``r000012`` -> 12; anything else -> None."""
    if len(segment) == 7 and segment[0] == "r" and segment[1:].isdigit():
        return int(segment[1:])
    return None


# -- who writes what -------------------------------------------------------------------

#: What each ``{field}`` of a template matches in a key. In a bucket policy every field
#: becomes ``*`` (``r*`` for a round), except ``{worker}`` in a worker's own keys,
#: which becomes its name.
FIELDS = {
    "fragment": r"[0-9]+",
    "round": r"r[0-9]{6,}",
    "worker": _NAME.pattern[1:-1],
    "writer": _NAME.pattern[1:-1],
    "nonce": r"[^/]+",
    "step": r"[0-9]+",
    "stamp": r"[^/]+",
    "shard": r"[0-9]+",
    "path": r".+",  # the objects of a zarr array, or of a prepared dataset
}
_FIELD = re.compile(r"\{(\w+)\}")
_WILDCARDS = {"round": "r*"}  # in a bucket policy; every other field is "*"


@dataclass(frozen=True)
class KeyPattern:
    """One kind of key a run writes, and the role that writes it.

    ``template`` is relative to the run's root, with ``{field}`` parts from
    `FIELDS`; ``owner`` is a role of `ROLES` (``worker``: the worker its
    ``{worker}`` field names); ``prunes``: the owner also deletes these keys;
    ``collected``: the launcher deletes them too, in ``diloco gc`` (workers/gc.py), when
    neither a resume nor the retention needs them.
    """

    template: str
    owner: str
    what: str
    prunes: bool = False
    collected: bool = False

    def __post_init__(self) -> None:
        unknown = set(_FIELD.findall(self.template)) - set(FIELDS)
        if unknown:
            raise ValueError(f"key pattern {self.template!r}: unknown fields {sorted(unknown)}; "
                             f"known: {', '.join(FIELDS)}")
        if self.owner not in (LAUNCHER, AGGREGATOR, WORKER):
            raise ValueError(f"key pattern {self.template!r}: owner {self.owner!r} is not "
                             f"{LAUNCHER}, {AGGREGATOR} or {WORKER} (the {VIEWER} writes nothing)")
        if self.owner == WORKER and "{worker}" not in self.template:
            raise ValueError(f"key pattern {self.template!r}: a worker's key names the worker "
                             f"({{worker}})")

    @cached_property
    def regex(self) -> re.Pattern[str]:
        parts = _FIELD.split(self.template)  # literal, field, literal, field, ...
        body = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>{FIELDS[p]})"
                       for i, p in enumerate(parts))
        return re.compile(f"^{body}$")

    def match(self, key: str) -> dict[str, str] | None:
        """The fields of ``key`` if it is of this kind, else None."""
        found = self.regex.match(key)
        if found is None or found.groupdict().get("worker") in RESERVED:
            return None
        return found.groupdict()

    def role(self, fields: dict[str, str]) -> str:
        """The role that writes the key with these fields: ``worker:<name>`` for a
        worker's key."""
        return f"{WORKER}:{fields['worker']}" if self.owner == WORKER else self.owner

    def resource(self, worker: str | None = None) -> str:
        """The pattern in a bucket policy (IAM's ``*`` matches across ``/``): every
        field ``*``, except ``{worker}`` in a worker's own keys: its name."""
        own = worker if self.owner == WORKER else None
        return _FIELD.sub(lambda m: own if m[1] == "worker" and own else _WILDCARDS.get(m[1], "*"),
                          self.template)

    def example(self, worker: str = "region-a") -> str:
        """A key of this kind (``worker``'s, for a worker's key), for checks and docs."""
        sample = {"fragment": "0", "round": "r000003", "worker": worker,
                  "writer": AGGREGATOR, "nonce": "5f0c2a9e41b7", "step": "00000008",
                  "stamp": "20260101T000000000000Z", "shard": "1", "path": "params/c/0"}
        return _FIELD.sub(lambda m: sample[m[1]], self.template)


KEYS: tuple[KeyPattern, ...] = (
    KeyPattern(MANIFEST, LAUNCHER, "run manifest, created once"),
    KeyPattern("global/init/{fragment}.json", LAUNCHER, "initial parameters: commit"),
    KeyPattern("global/init/{fragment}/{path}", LAUNCHER, "initial parameters"),
    KeyPattern(DATASET + "/{path}", LAUNCHER, "prepared token data"),
    KeyPattern(TRACKING, LAUNCHER, "the MLflow parent run"),
    KeyPattern(LAUNCHER_RECORD, LAUNCHER, "how the jobs were launched"),
    KeyPattern(member_status(TRAIN), LAUNCHER, "the train job's status"),
    KeyPattern(CANCEL, LAUNCHER, "a cancel request", prunes=True),
    KeyPattern(cancelled("{stamp}"), LAUNCHER, "a withdrawn cancel request"),
    KeyPattern(leave_request("{worker}"), LAUNCHER, "a request that a worker leave"),
    KeyPattern("frag/{fragment}/{round}/mean/{writer}/{nonce}/{path}", AGGREGATOR,
               "a mean", collected=True),
    KeyPattern("frag/{fragment}/{round}/mean.json", AGGREGATOR, "the commit of a mean"),
    KeyPattern("frag/{fragment}/{round}/decision.json", AGGREGATOR,
               "a sharded aggregator's decision (shard 0)"),
    KeyPattern("frag/{fragment}/{round}/check/{shard}/{worker}.json", AGGREGATOR,
               "a shard's check of its chunks of a contribution"),
    KeyPattern("frag/{fragment}/{round}/part/{shard}.json", AGGREGATOR,
               "the commit of a shard's part of a mean"),
    KeyPattern("frag/{fragment}/{round}/rejected/{worker}.json", AGGREGATOR,
               "why a worker's contribution was rejected"),
    KeyPattern("global/frag/{fragment}/{round}.json", AGGREGATOR,
               "canonical state after a round: commit", prunes=True, collected=True),
    KeyPattern("global/frag/{fragment}/{round}/{path}", AGGREGATOR,
               "canonical state after a round", prunes=True, collected=True),
    KeyPattern(member(AGGREGATOR), AGGREGATOR, "the aggregator's registration"),
    KeyPattern(member_status(AGGREGATOR), AGGREGATOR, "the aggregator's status"),
    KeyPattern(admission("{worker}"), AGGREGATOR, "a joiner's admission (its data slot)"),
    KeyPattern("frag/{fragment}/{round}/delta/{worker}/{nonce}/{path}", WORKER,
               "an outer gradient", collected=True),
    KeyPattern("frag/{fragment}/{round}/commits/{worker}.json", WORKER,
               "the commit of an outer gradient"),
    KeyPattern(member("{worker}"), WORKER, "a worker's registration"),
    KeyPattern(member_status("{worker}"), WORKER, "a worker's status (its lease)"),
    KeyPattern(left("{worker}"), WORKER, "a worker's record that it left"),
    KeyPattern("workers/{worker}/ckpt/{step}.json", WORKER, "a checkpoint: commit",
               prunes=True, collected=True),
    KeyPattern("workers/{worker}/ckpt/{step}/{path}", WORKER, "a checkpoint", prunes=True,
               collected=True),
)


class UndeclaredKey(LookupError):
    """A key no pattern of `KEYS` declares: no role's policy grants writing it."""


def declared(key: str) -> tuple[KeyPattern, str]:
    """The pattern of ``key`` and the role that writes it (``worker:<name>``,
    ``aggregator`` or ``launcher``); `UndeclaredKey` if none declares it."""
    found = [(p, p.role(fields)) for p in KEYS if (fields := p.match(key)) is not None]
    if not found:
        raise UndeclaredKey(f"{key!r} is not declared in storage/layout.py KEYS")
    if len(found) > 1:  # pragma: no cover - tests/test_roles.py keeps KEYS disjoint
        raise ValueError(f"{key!r} matches {len(found)} patterns: "
                         f"{[p.template for p, _ in found]}")
    return found[0]


def owner(key: str) -> str:
    """The role that writes ``key`` (see `declared`)."""
    return declared(key)[1]


def utc_now() -> str:
    """The ISO-8601 UTC time every JSON record of the layout carries (``created``,
    ``updated``): one clock format, so records written by different roles sort alike."""
    return datetime.now(UTC).isoformat()
