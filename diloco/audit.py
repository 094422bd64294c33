"""What became of every contribution of a run, read from the store alone.

Each committed contribution (``frag/{p}/r{round}/commits/{worker}.json``) ends in
exactly one of:

- ``applied``: in the mean of its own round (its weight key is the worker's name);
- ``applied_late``: in a later mean of its fragment (key ``worker@round``);
- ``dropped_stale``: a later mean lists it as dropped (too stale), or as absent
  and it was committed after that, or it was still owed when the fragment's last
  round was reduced (the run ended before it could be applied);
- ``rejected``: a mean lists it as rejected (corrupt, non-finite, outsized).

One that is in none while its fragment has a later mean that settled it is
``lost``; one in two or more is ``double``. Both must always be empty; that is
what the tests and ``diloco bench elastic`` check. Contributions whose fate is not
decided yet (the run goes on) are ``pending``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from diloco.gate import parse_key
from storage.exchange import Exchange

OUTCOMES = ("applied", "applied_late", "dropped_stale", "rejected")


def audit(exchange: Exchange) -> dict[str, Any]:
    """Count every contribution's outcome; ``lost`` and ``double`` list offenders
    as ``[fragment, round, worker]``."""
    manifest = exchange.manifest
    fates: dict[tuple[int, int, str], list[str]] = defaultdict(list)
    committed: set[tuple[int, int, str]] = set()
    settled_until: dict[int, int] = {}  # fragment -> newest round with a mean
    final_owed: dict[int, set[tuple[str, int]]] = {}
    for p, rounds in enumerate(manifest.rounds):
        newest = -1
        for r in range(rounds):
            for w in exchange.committed_workers(p, r):
                committed.add((p, r, w))
            commit = exchange.mean_commit(p, r)
            if commit is None:
                continue
            newest = r
            for key in commit.get("weights", {}):
                w, k = parse_key(key, r)
                fates[(p, k, w)].append("applied" if k == r else "applied_late")
            for key in commit.get("rejected", {}):
                w, k = parse_key(key, r)
                fates[(p, k, w)].append("rejected")
            for entry in commit.get("dropped", []):
                fates[(p, int(entry["round"]), entry["worker"])].append("dropped_stale")
            for entry in commit.get("absent", []):
                key3 = (p, int(entry["round"]), entry["worker"])
                fates[key3].append("absent")
            if r == rounds - 1:
                final_owed[p] = {(str(w), int(k)) for w, k in commit.get("owed", [])}
        settled_until[p] = newest
    counts = dict.fromkeys(OUTCOMES, 0)
    lost, double, pending = [], [], 0
    for key in sorted(committed):
        p, r, w = key
        got = [f if f != "absent" else "dropped_stale" for f in fates.get(key, [])]
        if (w, r) in final_owed.get(p, set()):
            got.append("dropped_stale")  # the run ended before it could be applied
        if len(got) == 1:
            counts[got[0]] += 1
        elif len(got) > 1:
            double.append([p, r, w])
        elif r > settled_until.get(p, -1) or _may_still_come(exchange, p, r, settled_until[p]):
            pending += 1
        else:
            lost.append([p, r, w])
    return {"contributions": len(committed), **counts, "pending": pending,
            "lost": lost, "double": double}


def _may_still_come(exchange: Exchange, p: int, r: int, newest: int) -> bool:
    """A contribution that missed round ``r`` is settled within ``max_staleness``
    later rounds; before the newest mean reaches that far it may still be applied."""
    staleness = int(exchange.manifest.sync.get("max_staleness", 2))
    return newest < r + max(1, staleness)
