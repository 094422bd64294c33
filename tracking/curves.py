"""The curves of a tracked run, read back from MLflow.

`load_run_curves` reads a parent run and its children (workers, aggregator) into
`RunCurves`: per-run metric histories plus the axes every plot shares, so that the
canonical model and each worker can be put on inner steps, tokens processed, bytes
exchanged and wall time; `RunCurves.results` gives the run's final figures. The
train job draws them (`tracking.plots.plot_run`) and ``diloco compare`` compares
runs with them (`tracking.compare`).

Bytes exchanged count every byte every party moves through the store: each
worker's ``bytes_up`` + ``bytes_down`` (its deltas, its reads of the means and of
the canonical state) and the aggregator's (its reads of the deltas, its writes of
the means and of the canonical checkpoints under ``global/``; cumulative, logged at
each round). ``bytes_checkpoints``, when the aggregator's report carries it, is the
part of its uploads that are checkpoints, and is shown on its own; it is included
in the total, not added to it. The aggregator's steps are put on the inner-step
axis through its ``inner_step`` metric (old runs logged it at merge point ``k``).

Bytes of a data-parallel run are not in its metrics (its gradients travel over
torch.distributed, not the store), so they come from the ring all-reduce formula:
each worker sends and receives ``2 (M-1)/M * 4 bytes * N`` per step, ``N`` the
number of parameters and ``M`` the workers; ``16 (M-1) N`` bytes per step in all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# What the plots and the comparison read of each child run.
WORKER_KEYS = ("eval_loss", "loss", "tokens", "bytes_up", "bytes_down", "wait_s",
               "result/tokens", "result/bytes_up", "result/bytes_down", "result/wait_seconds")
# A worker's last progress report comes before its final rounds; its result (logged
# when it ends) has the final counters: appended as the last point of each.
_FINAL_COUNTERS = {"tokens": "result/tokens", "bytes_up": "result/bytes_up",
                   "bytes_down": "result/bytes_down", "wait_s": "result/wait_seconds"}
AGGREGATOR_KEYS = ("eval_loss", "inner_step", "bytes_up", "bytes_down", "bytes_checkpoints")


@dataclass
class Series:
    """One metric's history: MLflow steps, values and timestamps (ms), by step."""

    steps: np.ndarray
    values: np.ndarray
    times: np.ndarray

    @classmethod
    def empty(cls) -> Series:
        return cls(np.zeros(0), np.zeros(0), np.zeros(0))

    @classmethod
    def from_history(cls, history: list[Any]) -> Series:
        points = sorted((m.step, m.timestamp, m.value) for m in history)
        if not points:
            return cls.empty()
        s, t, v = (np.asarray(x, dtype=float) for x in zip(*points, strict=True))
        return cls(s, v, t)

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def last(self) -> float | None:
        return float(self.values[-1]) if len(self) else None


@dataclass
class ChildCurves:
    name: str
    run_id: str
    series: dict[str, Series] = field(default_factory=dict)

    def get(self, key: str) -> Series:
        return self.series.get(key) or Series.empty()


@dataclass
class RunCurves:
    """A parent run and its children's histories, with shared axes."""

    run_id: str
    name: str
    start_ms: float
    end_ms: float | None
    params: dict[str, str]
    tags: dict[str, str]
    workers: dict[str, ChildCurves] = field(default_factory=dict)
    aggregator: ChildCurves | None = None

    @property
    def strategy(self) -> str:
        return self.tags.get("diloco.strategy") or self.params.get("train.strategy", "diloco")

    @property
    def mode(self) -> str:
        return self.tags.get("diloco.mode") or self.params.get("sync.schedule.mode", "")

    @property
    def data_parallel(self) -> bool:
        return self.strategy == "data_parallel"

    @property
    def label(self) -> str:
        kind = "data-parallel" if self.data_parallel else f"DiLoCo {self.mode}".strip()
        return f"{self.name} ({kind})"

    @property
    def n_workers(self) -> int:
        try:
            return len(json.loads(self.params["workers"]))
        except (KeyError, ValueError, TypeError):
            return len(self.workers)

    @property
    def n_params(self) -> int | None:
        try:
            return int(self.params["model.parameters"])
        except (KeyError, ValueError):
            return None

    @property
    def total_steps(self) -> int:
        try:
            return int(self.params["train.steps"])
        except (KeyError, ValueError):
            return int(max((w.get("loss").steps.max() for w in self.workers.values()
                            if len(w.get("loss"))), default=0))

    # -- axes ------------------------------------------------------------------------

    def allreduce_bytes_per_step(self) -> float | None:
        """All workers' bytes per step of ring all-reduce in float32 (module docstring)."""
        m, n = self.n_workers, self.n_params
        if not n or m < 2:
            return None
        return 2 * 2 * (m - 1) / m * 4 * n * m

    def traffic(self, child: ChildCurves, key: str) -> Series:
        """Cumulative ``bytes_up`` / ``bytes_down`` of one party; a data-parallel
        worker's is its share of the all-reduce (each way) at each logged step."""
        if not self.data_parallel or child is self.aggregator:
            return child.get(key)
        per_step = self.allreduce_bytes_per_step()
        steps = child.get("loss") if len(child.get("loss")) else child.get("tokens")
        if not per_step or not len(steps):
            return child.get(key)
        each_way = per_step / (2 * self.n_workers)
        store = _interp_from_zero(steps.steps, child.get(key))
        return Series(steps.steps, steps.steps * each_way + store, steps.times)

    def tokens_at(self, steps: np.ndarray) -> np.ndarray:
        total = np.zeros(len(steps))
        for w in self.workers.values():
            total += _interp_from_zero(steps, w.get("tokens"))
        return total

    def bytes_at(self, steps: np.ndarray) -> np.ndarray:
        if self.data_parallel:
            per_step = self.allreduce_bytes_per_step()
            return np.asarray(steps, float) * per_step if per_step else np.full(len(steps), np.nan)
        total = np.zeros(len(steps))
        for w in self.workers.values():
            total += _interp_from_zero(steps, w.get("bytes_up"))
            total += _interp_from_zero(steps, w.get("bytes_down"))
        for key in ("bytes_up", "bytes_down"):  # the aggregator's, checkpoints included
            total += _interp_from_zero(steps, self.on_inner_steps(key))
        return total

    def wall_s(self, times_ms: np.ndarray) -> np.ndarray:
        return (np.asarray(times_ms, float) - self.start_ms) / 1000.0

    # -- evaluation ----------------------------------------------------------------------

    def on_inner_steps(self, key: str) -> Series:
        """An aggregator metric on the workers' inner-step axis: its steps mapped
        through ``inner_step`` (the identity for runs that log at the inner step)."""
        if self.aggregator is None:
            return Series.empty()
        s = self.aggregator.get(key)
        inner = self.aggregator.get("inner_step")
        steps = s.steps
        if len(inner) and len(s):
            lookup = dict(zip(inner.steps.tolist(), inner.values.tolist(), strict=True))
            steps = np.asarray([lookup.get(x, x) for x in s.steps.tolist()], float)
        order = np.argsort(steps, kind="stable")
        return Series(steps[order], s.values[order], s.times[order])

    def canonical_eval(self) -> Series:
        """The model the run produces: the aggregator's canonical eval loss on the
        inner-step axis; without one (data-parallel, or an aggregator that does not
        evaluate) the mean of the workers' eval loss at each step."""
        if self.aggregator is not None and len(self.aggregator.get("eval_loss")):
            return self.on_inner_steps("eval_loss")
        by_step: dict[float, list[tuple[float, float]]] = {}
        for w in self.workers.values():
            ev = w.get("eval_loss")
            for s, v, t in zip(ev.steps, ev.values, ev.times, strict=True):
                by_step.setdefault(float(s), []).append((float(v), float(t)))
        if not by_step:
            return Series.empty()
        steps = np.asarray(sorted(by_step))
        vals = np.asarray([np.mean([v for v, _ in by_step[s]]) for s in steps])
        times = np.asarray([max(t for _, t in by_step[s]) for s in steps])
        return Series(steps, vals, times)

    @property
    def canonical_label(self) -> str:
        if self.aggregator is not None and len(self.aggregator.get("eval_loss")):
            return "canonical model (aggregator)"
        return "model (mean of the workers' eval)"

    # -- results ------------------------------------------------------------------------

    def wall_seconds(self) -> float | None:
        end = self.end_ms
        if not end:
            times = [c.get(k).times.max() for c in self.children() for k in c.series
                     if len(c.get(k))]
            end = max(times, default=None)
        return (end - self.start_ms) / 1000.0 if end else None

    def children(self) -> list[ChildCurves]:
        """Every party's curves: the workers' (by name), then the aggregator's."""
        return list(self.workers.values()) + ([self.aggregator] if self.aggregator else [])

    def results(self) -> dict[str, Any]:
        """Final and best eval loss, tokens, bytes exchanged (all parties; the
        workers', the aggregator's and its checkpoints' also apart), wall time,
        seconds waiting."""
        ev = self.canonical_eval()
        tokens = sum((w.get("tokens").last or 0.0) for w in self.workers.values())
        agg = self.aggregator
        by_aggregator = None if agg is None else (
            (agg.get("bytes_up").last or 0.0) + (agg.get("bytes_down").last or 0.0))
        checkpoints = None if agg is None else agg.get("bytes_checkpoints").last
        by_workers = None
        if self.data_parallel:
            per_step = self.allreduce_bytes_per_step()
            exchanged = per_step * self.total_steps if per_step else None
            source = "all-reduce formula"
        else:
            by_workers = sum((w.get("bytes_up").last or 0.0)
                             + (w.get("bytes_down").last or 0.0)
                             for w in self.workers.values())
            exchanged = by_workers + (by_aggregator or 0.0)
            source = ("measured (store): workers + aggregator" if by_aggregator
                      else "measured (store): workers")
        # a data-parallel worker waits inside all-reduce, which nothing measures
        waits = [] if self.data_parallel else [
            w.get("wait_s").last for w in self.workers.values() if len(w.get("wait_s"))]
        return {
            "final_eval_loss": ev.last,
            "best_eval_loss": float(ev.values.min()) if len(ev) else None,
            "tokens": tokens,
            "bytes_exchanged": exchanged,
            "bytes_source": source,
            "bytes_workers": by_workers,
            "bytes_aggregator": by_aggregator,
            "bytes_checkpoints": checkpoints,
            "wall_s": self.wall_seconds(),
            "wait_s_per_worker": float(np.mean(waits)) if waits else None,
        }


def _interp_from_zero(x: np.ndarray, s: Series) -> np.ndarray:
    """A cumulative counter at steps ``x`` (linear between logged steps, from 0 at
    step 0, flat after the last)."""
    if not len(s):
        return np.zeros(len(x))
    steps, values = s.steps, s.values
    if steps[0] > 0:
        steps, values = np.r_[0.0, steps], np.r_[0.0, values]
    return np.interp(np.asarray(x, float), steps, values)


# -- reading from MLflow -------------------------------------------------------------

def _histories(client: Any, run: Any, keys: tuple[str, ...]) -> dict[str, Series]:
    present = set(run.data.metrics)
    return {k: Series.from_history(client.get_metric_history(run.info.run_id, k))
            for k in keys if k in present}


def _with_final_counters(series: dict[str, Series]) -> dict[str, Series]:
    for key, final_key in _FINAL_COUNTERS.items():
        final = series.pop(final_key, None)
        if final is None or not len(final):
            continue
        s = series.get(key) or Series.empty()
        if len(s) and s.values[-1] >= final.values[-1]:
            continue
        series[key] = Series(np.r_[s.steps, final.steps[-1]], np.r_[s.values, final.values[-1]],
                             np.r_[s.times, final.times[-1]])
    return series


def load_run_curves(client: Any, parent: Any) -> RunCurves:
    """Read ``parent`` (an MLflow Run) and its child runs into `RunCurves`."""
    info = parent.info
    children = client.search_runs(
        [info.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{info.run_id}'",
        max_results=1000,
    )
    curves = RunCurves(
        run_id=info.run_id,
        name=info.run_name or info.run_id[:8],
        start_ms=float(info.start_time or 0),
        end_ms=float(info.end_time) if info.end_time else None,
        params=dict(parent.data.params),
        tags=dict(parent.data.tags),
    )
    for child in children:
        tags = child.data.tags
        role = tags.get("diloco.role")
        if role == "worker":
            name = tags.get("diloco.worker") or child.info.run_name
            curves.workers[name] = ChildCurves(
                name, child.info.run_id,
                _with_final_counters(_histories(client, child, WORKER_KEYS)))
        elif role == "aggregator":
            curves.aggregator = ChildCurves("aggregator", child.info.run_id,
                                            _histories(client, child, AGGREGATOR_KEYS))
    curves.workers = dict(sorted(curves.workers.items()))
    # wall time counts from the first thing that happened (a worker may log before
    # the parent run was created, if the tracking server was slow or away)
    firsts = [c.get(k).times.min() for c in curves.children() for k in c.series
              if len(c.get(k))]
    if firsts:
        curves.start_ms = min([curves.start_ms, *firsts]) if curves.start_ms else min(firsts)
    return curves
