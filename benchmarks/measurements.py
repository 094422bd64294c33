"""What a timed worker measured, in the shape the reports read: its traffic split
into the exchange and the rest, its status writes, its synchroniser's counts.

The worker process (``benchmarks.timed_worker``) computes these and prints them in
its ``RESULT`` line; the parent (``benchmarks.contenders``) summarises the
aggregator's traffic the same way. Both import this module and not each other.
"""

from __future__ import annotations

from typing import Any


def summarise_traffic(snapshot: dict[str, Any]) -> dict[str, Any]:
    """A TrafficCounter snapshot split into the exchange (``frag/...``, per fragment
    round) and the rest (manifest, initial parameters, dataset reads are not here)."""
    rounds: dict[str, dict[str, int]] = {}
    exchange = {"requests": 0, "bytes_up": 0, "bytes_down": 0}
    for cat, t in snapshot["by_category"].items():
        if not cat.startswith("frag/"):
            continue
        for k in exchange:
            exchange[k] += t[k]
        parts = cat.split("/")
        if len(parts) >= 3:
            key = f"{parts[1]}/{parts[2]}"
            row = rounds.setdefault(key, {"requests": 0, "bytes_up": 0, "bytes_down": 0})
            for k in row:
                row[k] += t[k]
    return {
        "total": {k: snapshot[k] for k in ("requests", "bytes_up", "bytes_down")},
        "exchange": exchange,
        "other": {k: snapshot[k] - exchange[k] for k in exchange},
        "per_round": dict(sorted(rounds.items())),
        "delta_payload_bytes": _payloads(snapshot.get("objects_up", {}), "delta"),
        "mean_payload_bytes": _payloads(snapshot.get("objects_down", {}), "mean"),
    }


def _payloads(objects: dict[str, int], kind: str) -> dict[str, int]:
    """Bytes of the ``frag/{p}/{round}/{kind}...`` objects, per fragment round."""
    out: dict[str, int] = {}
    for key, size in objects.items():
        parts = key.split("/")
        if key.startswith("frag/") and len(parts) > 3 and parts[3] == kind:
            name = f"{parts[1]}/{parts[2]}"
            out[name] = out.get(name, 0) + size
    return dict(sorted(out.items()))


def status_totals(loop) -> dict[str, int]:
    """Requests and bodies of a WorkerLoop's status object writes."""
    if not loop.speaks:  # an island's follower writes no status
        return {"requests": 0, "bytes_up": 0, "bytes_down": 0}
    snap = loop.board.store.traffic.snapshot()
    return {k: snap[k] for k in ("requests", "bytes_up", "bytes_down")}


def sync_summary(stats) -> dict[str, Any]:
    return {"wait_seconds": stats.wait_seconds, "rounds_sent": stats.rounds_sent,
            "rounds_merged": stats.rounds_merged, "late_means": stats.late_means,
            "max_staleness": max(stats.staleness, default=0),
            "waits": len(stats.waits)}
