"""Several tracked runs side by side (what ``diloco compare`` shows).

Each spec is an MLflow run id, a run name (the store's run id, which names the
parent run), or an MLflow filter string (``"params.sync.schedule.mode = 'eager'"``,
``"tags.diloco.strategy = 'data_parallel'"``); filters search every experiment and
keep parent runs (those the train job created). A row per run:

- final and best eval loss of the model the run produces (the aggregator's
  canonical model; the workers' mean for data-parallel),
- tokens processed (all workers), bytes exchanged: every byte every party moved
  through the store, up + down, the workers' and the aggregator's (for
  data-parallel the ring all-reduce volume, see `tracking.curves`); beside it the
  aggregator's share and, when its reports carry it, the part of that which is
  canonical checkpoints (``global/``), included in the total,
- the reduction in bytes against data-parallel: against a data-parallel run among
  those compared when there is one, else against the all-reduce formula for this
  run's own model, workers and steps; the ``reduction basis`` column says which,
- wall time and seconds each worker waited on the exchange,
- the config fields that differ between the compared runs (their params; a
  column each, named by the param, e.g. ``train.steps``); fields equal in every
  run are not shown, nor those the strategy and mode columns already show.

What the reduction compares: all the store traffic of the DiLoCo run (the
workers' deltas and reads, the aggregator's reads, means and checkpoints) against
the bytes a ring all-reduce moves for the same model, workers and steps (float32
gradients, every step; a data-parallel run's own checkpoints are not in that
formula). Counting the aggregator's checkpoints makes the ratio smaller than a
workers-only count: it is what the DiLoCo run really moved, not a best case.

It writes CSV and Markdown, draws overlay plots (PNG), and with ``log`` records all
of them as artifacts of a comparison run in MLflow. ``diloco compare``
(`cli.compare`) prints the table.
"""

from __future__ import annotations

import csv
import logging
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from storage.traffic import human_bytes
from tracking.curves import RunCurves, load_run_curves
from tracking.plots import plot_overlay
from tracking.runs import create_experiment, log_artifacts
from tracking.settings import (
    default_tracking_uri,
    experiment_name,
    short_http_retries,
    strip_credentials,
    tracking_unreachable,
)

log = logging.getLogger(__name__)

_RUN_ID = re.compile(r"[0-9a-f]{32}")
_FILTER_HINT = re.compile(r"(=|<|>|\sLIKE\s|\sILIKE\s|\sIN\s)", re.IGNORECASE)
PARENTS = "tags.`diloco.role` = 'train'"


class CompareError(ValueError):
    """A spec that names no run, or a filter MLflow refuses; the message says which."""


@dataclass
class CompareRow:
    run: str
    run_id: str
    strategy: str
    mode: str
    workers: int
    final_eval_loss: float | None
    best_eval_loss: float | None
    tokens: float | None
    bytes_exchanged: float | None
    bytes_source: str
    reduction_vs_dp: float | None
    reduction_basis: str
    wall_s: float | None
    wait_s_per_worker: float | None
    bytes_aggregator: float | None = None  # of bytes_exchanged
    bytes_checkpoints: float | None = None  # of bytes_aggregator, when reported
    config: dict[str, str] = field(default_factory=dict)  # the fields that differ


@dataclass
class CompareResult:
    rows: list[CompareRow]
    curves: list[RunCurves] = field(repr=False, default_factory=list)
    csv_path: Path | None = None
    md_path: Path | None = None
    plots: list[Path] = field(default_factory=list)
    comparison_run_id: str | None = None


# -- finding the runs ---------------------------------------------------------------

def _quote(value: str) -> str | None:
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    return None  # not a plausible run name


def _parent_of(client: Any, run: Any) -> Any:
    parent = run.data.tags.get("mlflow.parentRunId")
    return client.get_run(parent) if parent else run


def resolve_runs(client: Any, specs: list[str]) -> list[Any]:
    """The parent runs named by ``specs``, in order, each once: a spec is tried as a
    run id, then as a run name, then as a filter string."""
    from mlflow.exceptions import MlflowException  # noqa: PLC0415

    experiments = [e.experiment_id for e in client.search_experiments()]
    found: dict[str, Any] = {}
    for spec in specs:
        spec = spec.strip()
        runs: list[Any] = []
        if _RUN_ID.fullmatch(spec):
            try:
                runs = [_parent_of(client, client.get_run(spec))]
            except MlflowException:
                runs = []
        quoted = _quote(spec)
        if not runs and quoted:
            named = client.search_runs(
                experiments, filter_string=f"attributes.run_name = {quoted} and {PARENTS}",
                order_by=["attributes.start_time DESC"])
            if len(named) > 1:
                log.warning("%d runs are named %r; comparing the newest (%s)", len(named),
                            spec, named[0].info.run_id)
            runs = named[:1]
        if not runs:
            try:
                runs = client.search_runs(
                    experiments, filter_string=f"{spec} and {PARENTS}",
                    order_by=["attributes.start_time ASC"], max_results=1000)
            except MlflowException as exc:
                if _FILTER_HINT.search(spec):
                    raise CompareError(
                        f"{spec!r} is not a valid MLflow filter: {exc.message}") from None
        if not runs:
            raise CompareError(
                f"{spec!r} names no tracked run: not a run id, not the name of a run, and "
                "as a filter it matches no parent run")
        for run in runs:
            found.setdefault(run.info.run_id, run)
    return list(found.values())


# -- rows ---------------------------------------------------------------------------------

# params the other columns show already
SHOWN = frozenset({"train.strategy", "sync.schedule.mode"})


def differing_config(curves: list[RunCurves]) -> list[str]:
    """The params (flattened config fields) whose values are not the same in every
    run compared (a field one run lacks counts as different); none for one run."""
    if len(curves) < 2:
        return []
    keys = sorted({k for c in curves for k in c.params} - SHOWN)
    return [k for k in keys if len({c.params.get(k) for c in curves}) > 1]


def rows_for(curves: list[RunCurves]) -> list[CompareRow]:
    """A row per run; reductions against the first data-parallel run if any."""
    results = [c.results() for c in curves]
    differ = differing_config(curves)
    ref = next(((c, r) for c, r in zip(curves, results, strict=True) if c.data_parallel),
               None)
    rows = []
    for c, r in zip(curves, results, strict=True):
        exchanged = r["bytes_exchanged"]
        reduction, basis = None, "-"
        if c.data_parallel:
            reduction, basis = 1.0, "data-parallel itself"
        elif ref is not None:
            ref_bytes = ref[1]["bytes_exchanged"]
            if ref_bytes and exchanged:
                reduction, basis = ref_bytes / exchanged, f"vs run {ref[0].name}"
        else:
            per_step = c.allreduce_bytes_per_step()
            if per_step and exchanged:
                reduction = per_step * c.total_steps / exchanged
                basis = "all-reduce formula"
        rows.append(CompareRow(
            run=c.name, run_id=c.run_id, strategy=c.strategy,
            mode="-" if c.data_parallel else c.mode,
            workers=c.n_workers,
            final_eval_loss=r["final_eval_loss"], best_eval_loss=r["best_eval_loss"],
            tokens=r["tokens"], bytes_exchanged=exchanged, bytes_source=r["bytes_source"],
            bytes_aggregator=r["bytes_aggregator"], bytes_checkpoints=r["bytes_checkpoints"],
            reduction_vs_dp=reduction, reduction_basis=basis,
            wall_s=r["wall_s"], wait_s_per_worker=r["wait_s_per_worker"],
            config={k: c.params.get(k, "-") for k in differ},
        ))
    return rows


# -- output ---------------------------------------------------------------------------------

HEADERS = {
    "run": "run", "strategy": "strategy", "mode": "mode", "workers": "workers",
    "final_eval_loss": "final eval loss", "best_eval_loss": "best eval loss",
    "tokens": "tokens", "bytes_exchanged": "bytes exchanged", "bytes_source": "bytes source",
    "bytes_aggregator": "of which aggregator", "bytes_checkpoints": "of which checkpoints",
    "reduction_vs_dp": "reduction vs DP", "reduction_basis": "reduction basis",
    "wall_s": "wall time", "wait_s_per_worker": "wait per worker",
}
TEXT_COLUMNS = frozenset({"run", "strategy", "mode", "bytes_source", "reduction_basis"})


def config_header(key: str) -> str:
    """A config field's column: its name (``train.steps``), or ``config <name>``
    where that is a column of its own already (``workers``)."""
    return f"config {key}" if key in HEADERS.values() else key


def headers(rows: list[CompareRow]) -> dict[str, str]:
    """The columns: `HEADERS`, then the config fields that differ."""
    config = list(rows[0].config) if rows else []
    return {**HEADERS, **{f"config:{k}": config_header(k) for k in config}}


def is_text(column: str) -> bool:
    """A left-aligned column (names, labels, config values)."""
    return column in TEXT_COLUMNS or column.startswith("config:")


def _fmt(name: str, value: Any) -> str:
    if value is None:
        return "-"
    if name.endswith("eval_loss"):
        return f"{value:.4f}"
    if name == "tokens":
        return f"{value:,.0f}"
    if name in ("bytes_exchanged", "bytes_aggregator", "bytes_checkpoints"):
        return human_bytes(value, 2)
    if name == "reduction_vs_dp":
        return f"{value:,.1f}x"
    if name in ("wall_s", "wait_s_per_worker"):
        return f"{value:,.1f} s"
    return str(value)


def formatted(rows: list[CompareRow]) -> list[dict[str, str]]:
    """Each row's cells by header (`headers`): the numbers formatted, the config as is."""
    out = []
    for row in rows:
        fields = asdict(row)
        cells = {header: _fmt(k, fields[k]) for k, header in HEADERS.items()}
        cells.update({config_header(k): v for k, v in row.config.items()})
        out.append(cells)
    return out


def _raw(row: CompareRow) -> dict[str, Any]:
    fields = asdict(row)
    config = fields.pop("config")
    return {**fields, **config}


def write_csv(rows: list[CompareRow], path: Path) -> Path:
    """Raw numbers (bytes, seconds, tokens), one row per run; then the config fields
    that differ, a column each."""
    fields = list(_raw(rows[0])) if rows else [
        k for k in CompareRow.__dataclass_fields__ if k != "config"]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in _raw(row).items()})
    return path


def write_markdown(rows: list[CompareRow], path: Path, plots: list[Path]) -> Path:
    table = formatted(rows)
    columns = headers(rows)
    names = list(columns.values())
    lines = ["| " + " | ".join(names) + " |",
             "| " + " | ".join("---" if is_text(k) else "---:" for k in columns) + " |"]
    lines += ["| " + " | ".join(r[h].replace("|", "\\|") for h in names) + " |"
              for r in table]
    lines += ["", "Run ids: " + ", ".join(f"{r.run} = `{r.run_id}`" for r in rows), ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    path.write_text("\n".join(lines) + "\n")
    return path


def _log_comparison(client: Any, rows: list[CompareRow], files: list[Path]) -> str:
    name = experiment_name()
    exp = client.get_experiment_by_name(name)
    exp_id = exp.experiment_id if exp is not None else create_experiment(
        client, name, client.tracking_uri)
    title = "compare " + " vs ".join(r.run for r in rows)
    run = client.create_run(exp_id, run_name=title[:200], tags={
        "diloco.role": "compare",
        "diloco.compared": ",".join(r.run_id for r in rows)[:8000],
    })
    run_id = run.info.run_id
    with tempfile.TemporaryDirectory(prefix="diloco-compare-") as tmp:
        for path in files:
            shutil.copy(path, Path(tmp) / path.name)
        log_artifacts(client, client.tracking_uri, run_id, tmp)
    client.set_terminated(run_id)
    return run_id


def compare(
    specs: list[str],
    *,
    tracking_uri: str | None = None,
    out_dir: str | Path = "compare",
    formats: tuple[str, ...] | list[str] = ("csv", "md"),
    log: bool = False,
) -> CompareResult:
    """Compare the runs named by ``specs`` (see the module docstring); writes the
    ``formats`` asked for (``csv``, ``md``) and the overlay plots into ``out_dir``."""
    from mlflow import MlflowClient  # noqa: PLC0415

    if not specs:
        raise CompareError("name at least one run (run id, run name or filter)")
    short_http_retries()
    uri = tracking_uri or default_tracking_uri()
    why = tracking_unreachable(uri)
    if why:
        raise CompareError(
            f"cannot reach the MLflow tracking server {strip_credentials(uri)} ({why}): "
            "start it, or name a running one with --tracking-uri or MLFLOW_TRACKING_URI")
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise CompareError(
            f"no MLflow database at {uri.removeprefix('sqlite:///')} (no run was tracked "
            "here): run diloco compare where diloco run ran, or name the tracking store "
            "with --tracking-uri or MLFLOW_TRACKING_URI")
    client = MlflowClient(tracking_uri=uri)
    runs = resolve_runs(client, list(specs))
    curves = [load_run_curves(client, run) for run in runs]
    rows = rows_for(curves)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = CompareResult(rows=rows, curves=curves)
    result.plots = plot_overlay(curves, out)
    if "csv" in formats:
        result.csv_path = write_csv(rows, out / "compare.csv")
    if "md" in formats:
        result.md_path = write_markdown(rows, out / "compare.md", result.plots)
    if log:
        files = [p for p in (result.csv_path, result.md_path, *result.plots) if p]
        result.comparison_run_id = _log_comparison(client, rows, files)
    return result
