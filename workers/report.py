"""What a run has done, read from its store: live progress and the final report.

Everything comes from the status board (``members/*/status.json``) and the
committed means, so the same figures are seen from any region, by the train flow,
``diloco status`` and the progress display alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from storage import billing, layout
from storage.exchange import Exchange
from storage.objectstore import ObjectStore
from storage.traffic import human_bytes
from workers.status import StatusBoard, read_all, read_status

if TYPE_CHECKING:
    from diloco.aggregator import RoundReport
    from workers.config import RunConfig

AGGREGATOR = layout.AGGREGATOR
TRAIN = layout.TRAIN  # the train job's status: only its not-logged tracking counts

#: What the aggregator's status counts of the bytes it moves (cumulative across its
#: restarts); ``bytes_checkpoints`` is the part of ``bytes_up`` that is its canonical
#: round checkpoints.
TRAFFIC_KEYS = ("bytes_up", "bytes_down", "bytes_checkpoints")

#: What a party's status says of its bill (`storage.billing.Meter.figures`, cumulative
#: across its restarts), beside ``crossing``.
COST_KEYS = ("cost_usd", "egress_usd", "egress_up_usd", "egress_down_usd", "requests_usd",
             "requests_a", "requests_b", "billed_bytes_up", "billed_bytes_down")

#: Per-worker columns of the final table: (key in the report, title).
WORKER_COLUMNS = [
    ("worker", "worker"), ("state", "state"), ("steps", "steps"), ("tokens", "tokens"),
    ("bytes_up", "bytes up"), ("bytes_down", "bytes down"), ("wait_s", "wait s"),
    ("loss", "final loss"), ("eval_loss", "eval loss"), ("cost_usd", "cost"),
]


def taus(sync: Any, *, metrics: bool = False) -> dict[str, Any]:
    """``overlap: auto``: the tau in force per fragment (the newest decided), so a
    run shows what each worker chose: ``tau`` (a list) in its status, ``tau/f<p>``
    in its metric reports (MLflow). Nothing for a fixed tau (the config says it)."""
    if sync is None or not sync.config.schedule.auto:
        return {}
    taus = sync.overlaps
    return {f"tau/f{p}": t for p, t in enumerate(taus)} if metrics else {"tau": taus}


def party_meter(cfg: RunConfig, party: str, stores: Sequence[ObjectStore],
                board: StatusBoard) -> billing.Meter:
    """The bill of ``party``: the traffic of every store client it has (``stores`` and
    its status board's) at the run's prices, added to what the status of its previous
    life recorded, so that a restarted party's bill is the whole run's."""
    before = read_status(board.store, board.name) or {}
    return cfg.billing.meter([s.traffic for s in [*stores, board.store]], party, before)


def moved_before(board: StatusBoard) -> tuple[int, int]:
    """The exchange bytes (up, down) a party's previous lives recorded in its status,
    which a restarted party adds its own to, as the aggregator does."""
    before = read_status(board.store, board.name) or {}
    return int(before.get("bytes_up") or 0), int(before.get("bytes_down") or 0)


def price_basis(config: dict[str, Any] | None) -> dict[str, Any]:
    """What a run's bill rests on, from its config: the store's region, each
    configured party's, and the date and source of the list prices of every provider
    involved (read from the config as stored in the manifest: no torch, no pydantic)."""
    b = (config or {}).get("billing") or {}
    store = b.get("store") or billing.LOCAL
    regions = dict(b.get("regions") or {})
    table = billing.price_table(b.get("prices"))
    names = sorted({billing.parse_region(r)[0] for r in [store, *regions.values()]})
    return {"store": store, "regions": regions,
            "prices": {n: {"read": table[n].read, "source": table[n].source} for n in names}}


def party_cost(status: dict[str, Any]) -> dict[str, Any]:
    """One party's bill as its status records it (zeros before its first status)."""
    return {**{k: status.get(k) or 0 for k in COST_KEYS},
            "crossing": status.get("crossing") or "none"}


def run_cost(snap: dict[str, Any], config: dict[str, Any] | None) -> dict[str, Any]:
    """The run's bill so far from a `snapshot`: per party, the workers', the
    aggregator's, the total, and the prices it rests on (`price_basis`)."""
    parties = {**{w: party_cost(s) for w, s in snap["workers"].items()},
               AGGREGATOR: party_cost(snap["aggregator"])}
    workers = sum(c["cost_usd"] for n, c in parties.items() if n != AGGREGATOR)
    return {"total_usd": workers + parties[AGGREGATOR]["cost_usd"], "workers_usd": workers,
            "aggregator_usd": parties[AGGREGATOR]["cost_usd"],
            "egress_usd": sum(c["egress_usd"] for c in parties.values()),
            "requests_usd": sum(c["requests_usd"] for c in parties.values()),
            "parties": parties, **price_basis(config)}


def usd(value: float | None) -> str:
    """Dollars as a reader wants them: cents from $1, else four significant digits
    (a tiny run costs fractions of a cent)."""
    if value is None:
        return "-"
    return f"${value:,.2f}" if abs(value) >= 1 else f"${value:.4g}"


def cost_line(cost: dict[str, Any]) -> list[str]:
    """The run's bill so far, who paid it and over which crossing, and the prices
    it rests on: the parts of one line (`cli.figures.packed` breaks it)."""
    if set(cost["prices"]) <= {"other"}:  # nothing priced: say how to price it
        return ["cost: not priced (store and parties are in other:local; set billing.store",
                "and billing.regions to the clouds the run uses to see its egress bill)"]
    crossings = [f"{n} {c['crossing']}," for n, c in cost["parties"].items()]
    prices = [f"{n} list prices read {p['read']}," for n, p in cost["prices"].items()
              if n != "other"]
    if prices:
        prices[-1] = prices[-1].rstrip(",")
    return [f"cost: {usd(cost['total_usd'])} so far", f"(workers {usd(cost['workers_usd'])},",
            f"aggregator {usd(cost['aggregator_usd'])});",
            f"egress {usd(cost['egress_usd'])}, requests {usd(cost['requests_usd'])};",
            f"store {cost['store']}; crossing:", *crossings, "at", *prices]


def snapshot(exchange: Exchange) -> dict[str, Any]:
    """Every party's newest status: ``{"workers": {w: status}, "aggregator": status}``."""
    workers = exchange.manifest.workers
    found = read_all(exchange.store, [*workers, AGGREGATOR])
    return {"workers": {w: found[w] or {} for w in workers},
            "aggregator": found[AGGREGATOR] or {},
            "total_steps": exchange.manifest.total_steps,
            "total_rounds": sum(exchange.manifest.rounds)}


def fraction_done(snap: dict[str, Any]) -> float:
    """0..1: the aggregator's rounds, or the workers' steps before the first round."""
    agg = snap["aggregator"]
    total_rounds = snap["total_rounds"] or 1
    by_rounds = (agg.get("rounds") or 0) / total_rounds
    steps = [s.get("step") or 0 for s in snap["workers"].values()]
    by_steps = (min(steps) if steps else 0) / max(1, snap["total_steps"])
    return max(0.0, min(1.0, max(by_rounds, 0.98 * by_steps)))


def participation(aggregator_status: dict[str, Any], workers: list[str]) -> dict[str, Any]:
    """From the aggregator's status: the share of the contributions the rounds
    expected that were in their own round's mean (``participation``: on time; members
    join and leave, so the expected ones are counted per round), how many of the
    others were applied late, dropped as too stale or never came (absent), and the
    rounds each worker took part in (on time or late). A run whose rounds went on
    without someone is below 100%, whatever became of the contribution."""
    counts = aggregator_status.get("rounds_by_worker") or {}
    rounds = aggregator_status.get("counted_rounds") or 0
    expected = aggregator_status.get("expected_total") or rounds * len(workers)
    on_time = aggregator_status.get("on_time_total")
    if on_time is None:  # a status written before on-time counts existed
        on_time = aggregator_status.get("participants_total")
    mean = min(1.0, on_time / expected) if expected and on_time is not None else float("nan")
    return {"participation": mean,
            "on_time": int(on_time or 0), "expected": int(expected or 0),
            "late": int(aggregator_status.get("late_total") or 0),
            "dropped": int(aggregator_status.get("dropped_total") or 0),
            "absent": int(aggregator_status.get("absent_total") or 0),
            "rounds_by_worker": {w: int(counts.get(w, 0)) for w in workers},
            "committed_rounds": rounds}


def participation_text(g: dict[str, Any]) -> str:
    """``participation 92% on time (11 of 12; 1 late, 0 dropped, 0 absent)``, or the
    percentage alone when every expected contribution was on time."""
    head = f"participation {_percent(g.get('participation'))}"
    missed = g.get("expected", 0) - g.get("on_time", 0)
    if not g.get("expected") or missed <= 0:
        return head
    return (f"{head} on time ({g['on_time']} of {g['expected']}; {g['late']} late, "
            f"{g['dropped']} dropped, {g['absent']} absent)")


def build_report(exchange: Exchange, *, run_url: str, state: str, wall_seconds: float,
                 message: str = "") -> dict[str, Any]:
    """The final report: per worker and global figures (the train job's result)."""
    snap = snapshot(exchange)
    cost = run_cost(snap, exchange.manifest.config)
    workers = []
    for name, s in snap["workers"].items():
        workers.append({
            "worker": name, "state": s.get("state", "not started"),
            "steps": s.get("step", 0), "total_steps": s.get("total_steps",
                                                            snap["total_steps"]),
            "tokens": s.get("tokens", 0), "bytes_up": s.get("bytes_up", 0),
            "bytes_down": s.get("bytes_down", 0), "wait_s": s.get("wait_s", 0.0),
            "loss": s.get("loss"), "eval_loss": s.get("eval_loss"), **party_cost(s),
        })
    agg = snap["aggregator"]
    eval_loss = agg.get("eval_loss")
    # what each job's MLflow tracking could not log (the train job's own under TRAIN)
    parties = {**snap["workers"], AGGREGATOR: agg,
               TRAIN: read_status(exchange.store, TRAIN) or {}}
    not_logged = {n: s["not_logged"] for n, s in parties.items() if s.get("not_logged")}
    sized = parties[TRAIN].get("store_size")  # what gc left when the run finished
    return {
        "run_id": exchange.manifest.run_id, "run_url": run_url, "state": state,
        "message": message, "wall_seconds": wall_seconds, "workers": workers,
        "not_logged": not_logged,
        "global": {
            "eval_loss": eval_loss,
            "perplexity": math.exp(min(eval_loss, 50.0)) if eval_loss is not None else None,
            "rounds": agg.get("rounds", 0), "total_rounds": snap["total_rounds"],
            "rejected": agg.get("rejected", 0), "aggregator_state": agg.get("state"),
            **participation(agg, exchange.manifest.workers),
            "tokens": sum(w["tokens"] or 0 for w in workers),
            **traffic_totals(workers, agg),
            **{f"{k}_usd": v for k, v in cost_totals(cost).items()},
        },
        "aggregator": {**{k: int(agg.get(k) or 0) for k in TRAFFIC_KEYS}, **party_cost(agg)},
        "cost": cost,
        **({"store": sized} if sized else {}),
    }


def traffic_totals(workers: list[dict[str, Any]], aggregator: dict[str, Any]) -> dict[str, int]:
    """Every byte every party moved through the store: the workers' (``workers_``),
    the aggregator's, of which its canonical checkpoints (``bytes_checkpoints``), and
    their sums (``bytes_up``, ``bytes_down``, ``bytes_total``)."""
    up = sum(w.get("bytes_up") or 0 for w in workers)
    down = sum(w.get("bytes_down") or 0 for w in workers)
    a_up, a_down = int(aggregator.get("bytes_up") or 0), int(aggregator.get("bytes_down") or 0)
    return {"workers_bytes_up": up, "workers_bytes_down": down,
            "aggregator_bytes_up": a_up, "aggregator_bytes_down": a_down,
            "bytes_checkpoints": int(aggregator.get("bytes_checkpoints") or 0),
            "bytes_up": up + a_up, "bytes_down": down + a_down,
            "bytes_total": up + down + a_up + a_down}


def cost_totals(cost: dict[str, Any]) -> dict[str, float]:
    """The report's global dollar figures (keys get ``_usd``): ``cost`` (all parties),
    ``workers_cost``, ``aggregator_cost``, ``egress``, ``requests``."""
    return {"cost": cost["total_usd"], "workers_cost": cost["workers_usd"],
            "aggregator_cost": cost["aggregator_usd"], "egress": cost["egress_usd"],
            "requests": cost["requests_usd"]}


def table_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The final table: one row per worker, then one for the canonical model."""
    rows = [{title: _cell(w.get(key)) for key, title in WORKER_COLUMNS}
            for w in report["workers"]]
    g = report["global"]
    rows.append({
        "worker": "canonical (aggregator)", "state": g.get("aggregator_state") or "",
        "steps": f"{g['rounds']}/{g['total_rounds']} rounds",
        "tokens": _cell(g["tokens"]), "bytes up": _cell(g["aggregator_bytes_up"]),
        "bytes down": _cell(g["aggregator_bytes_down"]),
        "wait s": participation_text(g),
        "final loss": f"of which checkpoints {human_bytes(g['bytes_checkpoints'])}",
        "eval loss": _cell(g["eval_loss"]), "cost": usd(g.get("aggregator_cost_usd")),
    })
    rows.append({
        "worker": "all parties", "state": "", "steps": "", "tokens": "",
        "bytes up": _cell(g["bytes_up"]), "bytes down": _cell(g["bytes_down"]),
        "wait s": "", "final loss": "", "eval loss": "", "cost": usd(g.get("cost_usd")),
    })
    for row, w in zip(rows, report["workers"], strict=False):
        row["cost"] = usd(w.get("cost_usd"))
    return rows


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    return "" if value is None else value


def _percent(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{100 * value:.0f}%"


def human_seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


def markdown(report: dict[str, Any]) -> str:
    """A few lines for the Prefect artifact's description."""
    g = report["global"]
    loss = "-" if g["eval_loss"] is None else f"{g['eval_loss']:.4f}"
    return (f"**{report['run_id']}**: {report['state']} in "
            f"{human_seconds(report['wall_seconds'])}. Canonical model: eval loss {loss} "
            f"after {g['rounds']}/{g['total_rounds']} rounds, {participation_text(g)}. "
            f"Traffic through the store: "
            f"{human_bytes(g['bytes_total'])} (workers {human_bytes(g['workers_bytes_up'])} up, "
            f"{human_bytes(g['workers_bytes_down'])} down; aggregator "
            f"{human_bytes(g['aggregator_bytes_up'])} up, of which canonical checkpoints "
            f"{human_bytes(g['bytes_checkpoints'])}, {human_bytes(g['aggregator_bytes_down'])} "
            f"down). {_cost_sentence(report)}Store: `{report['run_url']}`")


def _cost_sentence(report: dict[str, Any]) -> str:
    """The bill in the artifact: total, workers, aggregator, the prices' dates."""
    cost = report.get("cost")
    if not cost:
        return ""
    read = ", ".join(f"{n} read {p['read']}" for n, p in cost["prices"].items())
    return (f"Cost: {usd(cost['total_usd'])} (workers {usd(cost['workers_usd'])}, aggregator "
            f"{usd(cost['aggregator_usd'])}; store {cost['store']}; list prices: {read}). ")


class Participation:
    """Who took part in the rounds, counted as rounds are applied and kept across
    the aggregator's restarts (in its status): each expected contribution ends once,
    in its round's mean (on time), in a later one (late), past ``max_staleness``
    (dropped) or never committed (absent)."""

    def __init__(self, workers: list[str], previous: dict[str, Any]):
        self.counts: dict[str, Any] = {
            "rounds_by_worker": dict.fromkeys(workers, 0), "counted_rounds": 0,
            "participants_total": 0, "expected_total": 0, "on_time_total": 0,
            "late_total": 0, "dropped_total": 0, "absent_total": 0}
        if previous.get("rounds_by_worker"):
            self.counts.update({k: previous[k] for k in self.counts if k in previous})

    def add(self, report: RoundReport) -> list[str]:
        """Count one applied round; returns its on-time members (joiners too)."""
        c = self.counts
        present = [w for w in report.weights if "@" not in w]
        # a late contribution (``w@r``, applied in this mean) counts for its round
        applied = [w.partition("@")[0] for w in report.weights]
        for w in applied:
            c["rounds_by_worker"][w] = c["rounds_by_worker"].get(w, 0) + 1
        c["counted_rounds"] += 1
        c["participants_total"] += len(applied)
        c["expected_total"] += max(report.expected, len(present))
        c["on_time_total"] += len(present)
        c["late_total"] += report.late
        c["dropped_total"] += report.dropped
        c["absent_total"] += report.absent
        return present
