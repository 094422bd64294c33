"""``diloco compare`` on two tiny runs: one DiLoCo, one data-parallel.

Both runs are `fake_run`s (see test_tracking.py) on SQLite. The expected numbers:

- DiLoCo, 60 steps: each worker ends with 6000 bytes up and 3000 down (1000 and
  500 per merge point, 6 merge points), and the aggregator with 600 up and 1200
  down (240 of them checkpoints), so 2 * 9000 + 1800 = 19,800 bytes exchanged;
  tokens 2 workers * 60 steps * 128 = 15,360; canonical eval 4.5, 4.0, 3.5 at
  steps 20, 40, 60: final = best = 3.5; wait 0.01 * 60 = 0.6 s per worker.
- Data-parallel, 40 steps: bytes from the ring all-reduce formula, 2 workers:
  per step 2 workers * 2 ways * 2 (M-1)/M * 4 bytes * N = 16 N, so 16 * N * 40;
  eval = mean of the workers' (+0.15 and +0.25 over 5.1 - 0.025 t): 4.8 at step 20,
  4.3 at 40: final = best = 4.3; tokens 2 * 40 * 128 = 10,240.
- Reduction of the DiLoCo run against that data-parallel run: 16 N * 40 / 19,800
  (with N = 3,279,104, the tiny preset: 2,098,626,560 / 19,800 = 105,991.2x). Alone,
  against the formula for its own 60 steps: 16 N * 60 / 19,800.
- Their configs differ in train.steps (60, 40) and train.strategy (which the
  strategy column shows): one config column, ``train.steps``.
"""

from __future__ import annotations

import csv
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_tracking
import typer
from mlflow import MlflowClient
from rich.console import Console
from test_tracking import fake_run, tiny_config, tiny_parameters
from typer.testing import CliRunner

from cli.compare import compare_command, rich_table
from tracking.compare import CompareError, compare
from tracking.plots import OVERLAY_PLOTS

mlflow_db_template = test_tracking.mlflow_db_template  # the session fixture, shared


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory,
            mlflow_db_template: Path) -> Iterator[dict[str, str]]:
    """A DiLoCo run of 60 steps and a data-parallel run of 40, tracked in SQLite
    (made once for this module: ``uri`` and each run's id by name)."""
    root = tmp_path_factory.mktemp("compare")
    shutil.copy(mlflow_db_template, root / "mlflow.db")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.setenv("MLFLOW_EXPERIMENT_NAME", "diloco-test")
        mp.setenv("DILOCO_SYSTEM_METRICS", "off")
        mp.delenv("DILOCO_TRACKING", raising=False)
        mp.chdir(root)
        for name, strategy, steps in (("run-diloco", "diloco", 60),
                                      ("run-dp", "data_parallel", 40)):
            run = fake_run((root / "store" / name).as_uri(), strategy=strategy, steps=steps,
                           pace=0.02)
            assert all(c == {} for c in run["closes"].values()), run["closes"]
        client = MlflowClient(uri)
        runs = client.search_runs([client.get_experiment_by_name("diloco-test").experiment_id],
                                  filter_string="tags.`diloco.role` = 'train'")
        yield {"uri": uri, **{r.info.run_name: r.info.run_id for r in runs}}


def test_compare_two_runs(tracked: dict[str, str], tmp_path: Path) -> None:
    n = tiny_parameters(tiny_config())
    assert n == 3_279_104  # the tiny preset, as in the module docstring
    out = tmp_path / "cmp"
    console = Console(record=True, width=250)
    # one by name, one by run id
    result = compare(["run-diloco", tracked["run-dp"]], tracking_uri=tracked["uri"],
                     out_dir=out, log=True)
    console.print(rich_table(result.rows, console.width))
    diloco, dp = result.rows
    assert (diloco.run, dp.run) == ("run-diloco", "run-dp")
    assert (diloco.strategy, dp.strategy) == ("diloco", "data_parallel")
    assert diloco.final_eval_loss == pytest.approx(3.5)
    assert diloco.best_eval_loss == pytest.approx(3.5)
    assert dp.final_eval_loss == pytest.approx(4.3)
    assert dp.best_eval_loss == pytest.approx(4.3)
    assert diloco.tokens == 15_360 and dp.tokens == 10_240
    assert diloco.bytes_exchanged == 19_800
    assert diloco.bytes_source == "measured (store): workers + aggregator"
    assert (diloco.bytes_aggregator, diloco.bytes_checkpoints) == (1800, 240)
    assert (dp.bytes_aggregator, dp.bytes_checkpoints) == (None, None)
    assert dp.bytes_exchanged == 16 * n * 40 == 2_098_626_560
    assert dp.bytes_source == "all-reduce formula"
    assert diloco.reduction_vs_dp == pytest.approx(2_098_626_560 / 19_800)
    assert diloco.reduction_vs_dp == pytest.approx(105_991.2, abs=0.1)
    # the config fields that differ, and only those
    assert diloco.config == {"train.steps": "60"} and dp.config == {"train.steps": "40"}
    assert diloco.reduction_basis == "vs run run-dp"
    assert dp.reduction_vs_dp == 1.0
    assert diloco.wait_s_per_worker == pytest.approx(0.6)
    assert dp.wait_s_per_worker is None
    assert diloco.wall_s is not None and 0 < diloco.wall_s < 120

    text = console.export_text()
    assert "run-diloco" in text and "105,991.2x" in text and "19.80 kB" in text
    assert "train.steps" in text and "train.eval_every" not in text

    with result.csv_path.open() as fh:
        table = list(csv.DictReader(fh))
    assert [r["run"] for r in table] == ["run-diloco", "run-dp"]
    assert float(table[0]["bytes_exchanged"]) == 19_800
    assert float(table[0]["bytes_checkpoints"]) == 240
    assert float(table[0]["reduction_vs_dp"]) == pytest.approx(105_991.2, abs=0.1)
    assert [r["train.steps"] for r in table] == ["60", "40"]
    assert table[1]["wait_s_per_worker"] == ""

    md = result.md_path.read_text()
    assert md.splitlines()[0].startswith("| run | strategy |")
    assert md.splitlines()[0].endswith("| train.steps |")
    assert "| run-diloco | diloco | streaming | 2 | 3.5000 | 3.5000 | 15,360 | 19.80 kB" in md
    assert "vs run run-dp" in md

    assert sorted(p.name for p in result.plots) == sorted(OVERLAY_PLOTS)
    assert all(p.stat().st_size > 10_000 for p in result.plots)

    client = MlflowClient(tracked["uri"])
    logged = client.get_run(result.comparison_run_id)
    assert logged.data.tags["diloco.role"] == "compare"
    names = {f.path for f in client.list_artifacts(result.comparison_run_id)}
    assert {"compare.csv", "compare.md", *OVERLAY_PLOTS} <= names


def test_compare_alone_uses_the_formula(tracked: dict[str, str], tmp_path: Path) -> None:
    n = tiny_parameters(tiny_config())
    result = compare(["tags.`diloco.strategy` = 'diloco'"], tracking_uri=tracked["uri"],
                     out_dir=tmp_path / "one", formats=("csv",))
    (row,) = result.rows
    assert row.run == "run-diloco"
    assert row.reduction_basis == "all-reduce formula"
    assert row.reduction_vs_dp == pytest.approx(16 * n * 60 / 19_800)
    assert row.config == {}  # one run: nothing to tell apart
    assert result.md_path is None and result.csv_path.exists()


def test_compare_filter_finds_both_and_never_children(tracked: dict[str, str],
                                                      tmp_path: Path) -> None:
    result = compare(["attributes.run_name LIKE 'run-%'"], tracking_uri=tracked["uri"],
                     out_dir=tmp_path / "f", formats=())
    assert sorted(r.run for r in result.rows) == ["run-diloco", "run-dp"]


def test_compare_unknown_spec_is_named(tracked: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(CompareError, match="'no-such-run' names no tracked run"):
        compare(["no-such-run"], tracking_uri=tracked["uri"], out_dir=tmp_path / "x")
    with pytest.raises(CompareError, match="not a valid MLflow filter"):
        compare(["params.x === 'y'"], tracking_uri=tracked["uri"], out_dir=tmp_path / "x")


def test_compare_command(tracked: dict[str, str], tmp_path: Path) -> None:
    app = typer.Typer()
    app.command("compare")(compare_command)
    app.command("noop")(lambda: None)  # more than one command, as in the real CLI
    out = tmp_path / "cli"
    res = CliRunner().invoke(app, ["compare", "run-diloco", "run-dp", "--out", str(out),
                                   "--no-md", "--tracking-uri", tracked["uri"]])
    assert res.exit_code == 0, res.output
    assert "run-diloco" in res.output and "reduction" in res.output
    assert (out / "compare.csv").exists() and not (out / "compare.md").exists()
    bad = CliRunner().invoke(app, ["compare", "nope", "--out", str(out),
                                   "--tracking-uri", tracked["uri"]])
    assert bad.exit_code == 2


def test_many_runs_are_not_squeezed_when_printed_to_a_pipe(monkeypatch) -> None:
    """Seven runs get a row each. Printed to a file or a pipe (not a terminal), the
    table must not be cut to 80 columns, where every cell became "…"."""
    import cli.compare as command  # noqa: PLC0415
    import tracking.compare as cmp  # noqa: PLC0415

    rows = [cmp.CompareRow(
        run=f"streaming-int4-m-4-h-50-run-{i}", run_id=f"{i:032x}", strategy="diloco",
        mode="streaming", workers=4, final_eval_loss=1.6 + i / 100, best_eval_loss=1.6,
        tokens=2_457_600, bytes_exchanged=86e6, bytes_source="measured (store)",
        bytes_aggregator=None, bytes_checkpoints=None,
        reduction_vs_dp=295.2, reduction_basis="all-reduce formula", wall_s=217.0,
        wait_s_per_worker=14.8) for i in range(7)]

    def fake_compare(specs, **_kwargs):
        return cmp.CompareResult(rows)

    monkeypatch.setattr(cmp, "compare", fake_compare)
    app = typer.Typer()
    app.command("compare")(command.compare_command)
    app.command("noop")(lambda: None)
    res = CliRunner().invoke(app, ["compare", "x", "--no-csv", "--no-md"])
    assert res.exit_code == 0, res.output
    assert "…" not in res.output
    for i in range(7):
        assert f"streaming-int4-m-4-h-50-run-{i}" in res.output
    assert "final eval loss" in res.output and "1.6600" in res.output
