"""What became of every contribution of a run, read from the store alone.

Each committed contribution (``frag/{p}/r{round}/commits/{worker}.json``) ends in
exactly one of:

- ``applied``: in the mean of its own round (its weight key is the worker's name);
- ``applied_late``: in a later mean of its fragment (key ``worker@round``);
- ``dropped_stale``: a later mean lists it as dropped (too stale), or as absent
  and it was committed after that, or it was still owed when the fragment's last
  round was reduced (the run ended before it could be applied);
- ``rejected``: a mean lists it as rejected (corrupt, non-finite, outsized).

A commit in the slot of a name that is not a member of the run (never admitted, or
one that had left before that round) is ``ignored``, as the aggregator ignores it.
One that is in none while its fragment has a later mean that settled it is
``lost``; one in two or more is ``double``. Both must always be empty; that is
what the tests and ``diloco bench elastic`` check. Contributions whose fate is not
decided yet (the run goes on) are ``pending``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from diloco.config import SyncConfig
from diloco.membership import Roster
from storage.exchange import Exchange, contribution_of

OUTCOMES = ("applied", "applied_late", "dropped_stale", "rejected")


def audit(exchange: Exchange) -> dict[str, Any]:
    """Count every contribution's outcome; ``lost`` and ``double`` list offenders
    as ``[fragment, round, worker]``."""
    manifest = exchange.manifest
    roster = Roster(exchange.store, manifest, lease_s=float("inf"), slots=0, admit=False)
    roster.refresh(force=True)
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
                w, k = contribution_of(key, r)
                fates[(p, k, w)].append("applied" if k == r else "applied_late")
            for key in commit.get("rejected", {}):
                w, k = contribution_of(key, r)
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
    lost, double, pending, ignored = [], [], 0, 0
    for key in sorted(committed):
        p, r, w = key
        if not fates.get(key) and not roster.takes_part(w, p, r):
            ignored += 1  # not a member's: the aggregator never reads it
            continue
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
            "ignored": ignored, "lost": lost, "double": double}


def _may_still_come(exchange: Exchange, p: int, r: int, newest: int) -> bool:
    """A contribution that missed round ``r`` is settled within ``max_staleness``
    later rounds; before the newest mean reaches that far it may still be applied."""
    staleness = SyncConfig.stored(exchange.manifest.sync).membership.max_staleness
    return newest < r + max(1, staleness)


def norm_ratios(exchange: Exchange) -> list[dict[str, Any]]:
    """Per (fragment, round) with a mean: the accepted contributions' norms over the
    norm of the fragment's initial parameters (largest and median) and their spread
    (largest over smallest), the figures the norm guard's factors are chosen from."""
    import numpy as np  # noqa: PLC0415

    from diloco.run import load_initial  # noqa: PLC0415

    theta = [float(v.norm()) for v in load_initial(exchange, len(exchange.manifest.fragments))]
    out = []
    for p, rounds in enumerate(exchange.manifest.rounds):
        for r in range(rounds):
            norms = list(((exchange.mean_commit(p, r) or {}).get("norms") or {}).values())
            if not norms or theta[p] == 0:
                continue
            out.append({"fragment": p, "round": r, "contributions": len(norms),
                        "max_over_params": max(norms) / theta[p],
                        "median_over_params": float(np.median(norms)) / theta[p],
                        "spread": max(norms) / min(norms) if min(norms) > 0 else float("inf")})
    return out
