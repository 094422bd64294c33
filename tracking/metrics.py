"""What each job's reports become in MLflow: metric names, values and steps.

A worker logs at its inner step. The aggregator logs a round at its merge point in
the whole schedule, ``k = r * P + p`` for round ``r`` of fragment ``p`` of ``P``
(unique, and the same after a restart), plus ``inner_step``, the workers' step at
that merge point, so that its curves can be drawn on the workers' axis.
"""

from __future__ import annotations

import math
from typing import Any

ROUND_EXTRAS = ("eval_loss", "perplexity", "bytes_up", "bytes_down")


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
    schedule is known): four, one weight per worker, the extras, inner_step."""
    return 5 + len(report.get("weights") or {}) + sum(
        1 for k in ROUND_EXTRAS if is_number(report.get(k)))


def round_index(report: dict[str, Any], schedule: dict[str, int]) -> int | None:
    """``r * P + p``; None without a schedule (the caller counts rounds instead)."""
    frags = int(schedule.get("fragments") or 0)
    if frags <= 0:
        return None
    return int(report.get("round", 0)) * frags + int(report.get("fragment", 0))


def round_metrics(report: dict[str, Any], schedule: dict[str, int], ts: int,
                  k: int) -> list[Any]:
    """The aggregator's metrics of one round, at step ``k`` (see the module
    docstring); ``inner_step`` when the schedule says where merge point k is."""
    metric = _metric_type()
    p = int(report.get("fragment", 0))
    weights = report.get("weights") or {}
    out = [metric(f"grad_norm/frag{p}", float(report.get("grad_norm", math.nan)), ts, k),
           metric("participation", float(len(weights)), ts, k),
           metric("rejected", float(len(report.get("rejected") or {})), ts, k),
           metric("round_seconds", float(report.get("seconds", math.nan)), ts, k)]
    out += [metric(f"weight/{w}", float(v), ts, k) for w, v in weights.items()]
    out += [metric(name, float(report[name]), ts, k) for name in ROUND_EXTRAS
            if is_number(report.get(name))]
    frags = int(schedule.get("fragments") or 0)
    if frags > 0 and schedule.get("sync_every"):
        inner = (k + 1) * (int(schedule["sync_every"]) // frags)
        if schedule.get("total_steps"):
            inner = min(inner, int(schedule["total_steps"]))
        out.append(metric("inner_step", float(inner), ts, k))
    return out


def eval_metrics(values: dict[str, float], rounds: int, ts: int) -> list[Any]:
    """The final evaluation of the canonical model, at the index of the last round
    applied (whose report already placed ``inner_step`` there)."""
    metric = _metric_type()
    k = max(0, rounds - 1)
    return [metric(name, float(v), ts, k) for name, v in values.items()]


def stall_metrics(waited_s: float, ts: int, step: int) -> list[Any]:
    """``stalled_s``: how long the aggregator has applied no round (0 once it does
    again), at the index of the rounds applied so far."""
    return [_metric_type()("stalled_s", float(waited_s), ts, step)]
