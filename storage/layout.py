"""Where every object of a run lives, relative to the run's root URL.

One function per kind of key, so the layout is written down in one place::

    run.json                                     run manifest (created once)
    frag/{p}/r{round}/delta/{worker}/{nonce}/    a worker's outer gradient (zarr array)
    frag/{p}/r{round}/commits/{worker}.json      its commit record (create-only)
    frag/{p}/r{round}/mean/{writer}/{nonce}/     an aggregator's mean (zarr array)
    frag/{p}/r{round}/mean.json                  the one commit of the mean (create-only)
    frag/{p}/r{round}/rejected/{worker}.json     why a contribution was not used
    global/init/{p}/                             initial canonical parameters
    global/frag/{p}/r{round}/{array}/            canonical state after a round
    global/frag/{p}/r{round}.json                its commit record
    workers/{worker}/ckpt/{step}/                worker checkpoints

Payloads sit under a fresh nonce so that a retried or raced upload never overwrites
bytes someone may be reading; only the commit record names the payload in force.
Rounds are zero-padded so that listings sort in round order.
"""

from __future__ import annotations

import re

MANIFEST = "run.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_name(kind: str, name: str) -> str:
    """Validate a worker or writer name: it becomes part of object keys."""
    if not _NAME.match(name):
        raise ValueError(
            f"{kind} name {name!r} is not valid: use 1-64 letters, digits, '_', '.', '-', "
            f"starting with a letter or digit"
        )
    return name


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


def rejected(fragment: int, round: int, worker: str) -> str:
    return f"{round_prefix(fragment, round)}/rejected/{worker}.json"


def global_init(fragment: int) -> str:
    return f"global/init/{fragment}"


def global_state(fragment: int, round: int) -> str:
    return f"global/frag/{fragment}/r{round:06d}"


def global_states(fragment: int) -> str:
    return f"global/frag/{fragment}"


def global_commit(fragment: int, round: int) -> str:
    return f"{global_state(fragment, round)}.json"


def worker_checkpoints(worker: str) -> str:
    return f"workers/{worker}/ckpt"


def parse_round(segment: str) -> int | None:
    """``r000012`` -> 12; anything else -> None."""
    if len(segment) == 7 and segment[0] == "r" and segment[1:].isdigit():
        return int(segment[1:])
    return None
