"""What ``diloco status`` and ``diloco cancel`` know of a sharded aggregator's shards 1..K-1.

Each shard job writes its own status board (rounds, state, stall, error, the time of
its last poll); a shard that says it is running but has not polled for a few
heartbeats has died without saying so, and is shown as *silent*.
"""

from __future__ import annotations

from typing import Any

from storage.exchange import Exchange

#: A shard whose status says running but is older than this many of its heartbeats
#: (it writes one after a poll every ``heartbeat_s``) is shown as silent: its job died.
SILENT_HEARTBEATS = 3


def shard_statuses(exchange: Exchange) -> dict[str, dict[str, Any]]:
    """Shards 1..K-1 of a sharded aggregator (shard 0 is the aggregator), named as
    their jobs are (``aggregator-sS``): each one's status, {} before it started."""
    from flows.control import shard_board  # noqa: PLC0415
    from workers.status import read_status  # noqa: PLC0415

    return {f"aggregator-s{s}": read_status(exchange.store, shard_board(s)) or {}
            for s in range(1, exchange.shards)}


def silent_for(status: dict[str, Any]) -> float | None:
    """Seconds since a running shard's last poll, when that is more than
    `SILENT_HEARTBEATS` heartbeats (a dead job); else None."""
    from datetime import UTC, datetime  # noqa: PLC0415

    if status.get("state") != "running" or not status.get("updated"):
        return None
    try:
        age = (datetime.now(UTC) - datetime.fromisoformat(status["updated"])).total_seconds()
    except ValueError:
        return None
    return age if age > SILENT_HEARTBEATS * float(status.get("heartbeat_s") or 5.0) else None


def shard_state(status: dict[str, Any]) -> str:
    """The state to show for a shard: its own, or ``silent`` when its job died
    without saying so (`silent_for`)."""
    return "silent" if silent_for(status) is not None else status.get("state", "not started")
