"""What each job's reports become in MLflow: metric names, values and steps.

One step axis for every metric: the workers' inner step. A worker logs at its inner
step; the aggregator logs a round at the inner step of its merge point, ``(k + 1) *
H / P`` for merge point ``k = r * P + p`` (round ``r`` of fragment ``p`` of ``P``;
unique, and the same after a restart), so its eval loss lines up with the workers'
in the MLflow UI. The round is its own metric: ``round`` (``r``) and ``merge_point``
(``k``); ``inner_step`` is logged too (its value is its step). Without a schedule
(no tracking.json yet, or a config the hooks cannot read) the step is ``k``.

Runs logged before this convention have the aggregator's metrics at step ``k`` and
``inner_step`` mapping ``k`` to the inner step; `tracking.curves` reads both.
"""

from __future__ import annotations

import math
from typing import Any

ROUND_EXTRAS = ("eval_loss", "perplexity", "bytes_up", "bytes_down", "bytes_checkpoints",
                "late", "dropped", "absent", "expected", "cost_usd", "egress_usd",
                "requests_usd")

#: the run's bill on the parent run (from the train job's report, `workers.report`):
#: all parties, the workers', the aggregator's, egress and requests
COST_TOTALS = ("cost_usd", "workers_cost_usd", "aggregator_cost_usd", "egress_usd",
               "requests_usd")


def cost_totals(summary: dict[str, Any]) -> dict[str, float]:
    """The dollar totals of a train job's report, for the parent run's metrics."""
    g = summary.get("global") or {}
    return {k: float(g[k]) for k in COST_TOTALS if is_number(g.get(k))}


#: what became of the contributions the rounds expected (`workers.report.participation`),
#: on the parent run: the on-time share, and counts of the others
PARTICIPATION_TOTALS = {"participation": "participation_on_time", "late": "contributions_late",
                        "dropped": "contributions_dropped", "absent": "contributions_absent"}


def participation_totals(summary: dict[str, Any]) -> dict[str, float]:
    """The participation figures of a train job's report, for the parent run."""
    g = summary.get("global") or {}
    return {name: float(g[k]) for k, name in PARTICIPATION_TOTALS.items()
            if is_number(g.get(k)) and g[k] == g[k]}  # NaN: no round was counted


def on_time(weights: dict[str, Any]) -> dict[str, Any]:
    """The weights of the round's own contributions: a late one (of an earlier
    round, applied in this mean) is keyed ``worker@round`` and counted in ``late``."""
    return {w: v for w, v in weights.items() if "@" not in w}


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _metric_type() -> Any:
    from mlflow.entities import Metric  # noqa: PLC0415 - MLflow only once tracking is on

    return Metric


def numbers(report: dict[str, Any], ts: int, step: int, *, prefix: str = "",
            skip: tuple[str, ...] = ()) -> list[Any]:
    """Every number of ``report`` (not ``skip``) as a metric at ``step``."""
    metric = _metric_type()
    return [metric(prefix + name, float(value), ts, step) for name, value in report.items()
            if name not in skip and is_number(value)]


def round_size(report: dict[str, Any]) -> int:
    """How many metrics `round_metrics` makes of a report (counted before the
    schedule is known): six, one weight per worker, the extras, inner_step."""
    return 7 + len(on_time(report.get("weights") or {})) + sum(
        1 for k in ROUND_EXTRAS if is_number(report.get(k)))


def round_index(report: dict[str, Any], schedule: dict[str, int]) -> int | None:
    """``r * P + p``; None without a schedule (the caller counts rounds instead)."""
    frags = int(schedule.get("fragments") or 0)
    if frags <= 0:
        return None
    return int(report.get("round", 0)) * frags + int(report.get("fragment", 0))


def inner_step(k: int, schedule: dict[str, int]) -> int | None:
    """The workers' inner step at merge point ``k``; None without a schedule."""
    frags = int(schedule.get("fragments") or 0)
    if frags <= 0 or not schedule.get("sync_every"):
        return None
    inner = (k + 1) * (int(schedule["sync_every"]) // frags)
    if schedule.get("total_steps"):
        inner = min(inner, int(schedule["total_steps"]))
    return inner


def round_metrics(report: dict[str, Any], schedule: dict[str, int], ts: int,
                  k: int) -> list[Any]:
    """The aggregator's metrics of merge point ``k``, at its inner step (see the
    module docstring; at ``k`` without a schedule)."""
    metric = _metric_type()
    p = int(report.get("fragment", 0))
    weights = on_time(report.get("weights") or {})  # participation: on time
    inner = inner_step(k, schedule)
    step = k if inner is None else inner
    out = [metric(f"grad_norm/frag{p}", float(report.get("grad_norm", math.nan)), ts, step),
           metric("participation", float(len(weights)), ts, step),
           metric("rejected", float(len(report.get("rejected") or {})), ts, step),
           metric("round_seconds", float(report.get("seconds", math.nan)), ts, step),
           metric("round", float(report.get("round", 0)), ts, step),
           metric("merge_point", float(k), ts, step)]
    out += [metric(f"weight/{w}", float(v), ts, step) for w, v in weights.items()]
    out += [metric(name, float(report[name]), ts, step) for name in ROUND_EXTRAS
            if is_number(report.get(name))]
    if inner is not None:
        out.append(metric("inner_step", float(inner), ts, step))
    return out


def eval_metrics(values: dict[str, float], rounds: int, ts: int,
                 schedule: dict[str, int] | None = None) -> list[Any]:
    """The final evaluation of the canonical model, at the inner step of the last
    merge point applied (``rounds - 1``; that index without a schedule)."""
    metric = _metric_type()
    k = max(0, rounds - 1)
    inner = inner_step(k, schedule or {})
    step = k if inner is None else inner
    return [metric(name, float(v), ts, step) for name, v in values.items()]


def stall_metrics(waited_s: float, ts: int, step: int) -> list[Any]:
    """``stalled_s``: how long the aggregator has applied no round (0 once it does
    again), at the step of the last round logged."""
    return [_metric_type()("stalled_s", float(waited_s), ts, step)]
