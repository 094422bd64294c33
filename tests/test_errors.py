"""Errors a user meets, each one line naming what is wrong and what to do, exit
status 2, nothing written: cancelling or resuming a finished run, a bad option
value, an unreachable Prefect API or MLflow server, a bad ``--set``."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cli.app import app
from storage.objectstore import ObjectStore
from workers.config import load_config
from workers.data.prepare import prepare_data
from workers.runs import create_run
from workers.status import StatusBoard

MICRO = [
    "model.overrides={d_model: 64, n_layers: 2, n_heads: 2, max_seq_len: 64}",
    "data.seq_len=32", "data.batch_size=8", "train.steps=16", "sync.schedule.sync_every=8",
    "sync.schedule.fragments=2",
]


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def one_line(stderr: str) -> str:
    """The one error line (and nothing else)."""
    assert "Traceback" not in stderr, stderr
    lines = " ".join(stderr.split())  # rich wraps at the console's width
    assert lines.startswith("error: ") and lines.count("error:") == 1, stderr
    return lines


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("data") / "shakespeare")
    prepare_data(["builtin:shakespeare/tragedies/*"], url, max_bytes=100_000)
    return url


@pytest.fixture
def new_run(tmp_path, data_url) -> Path:
    """A run under runs/, created and never started."""
    cfg = load_config("tiny", [*MICRO, f"data.dataset={data_url}"])
    where = tmp_path / "runs" / "tiny-20260101-120000"
    create_run(cfg, str(where))
    return where


@pytest.fixture
def finished_run(new_run) -> Path:
    """A run under runs/ whose every party reported ``finished``."""
    store = ObjectStore(str(new_run))
    for name in ["region-a", "region-b", "aggregator"]:
        StatusBoard(store, name).update("finished", force=True)
    return new_run


# -- a finished run -----------------------------------------------------------------------


@pytest.mark.parametrize("command", ["cancel", "resume"])
def test_a_finished_run_is_not_cancelled_or_resumed(in_process, finished_run, command):
    before = tree(finished_run)
    result = in_process.invoke(app, [command, finished_run.name])
    assert result.exit_code == 2, result.output
    line = one_line(result.stderr)
    assert f"runs/{finished_run.name} has finished; there is nothing to {command}" in line
    assert f"diloco status {finished_run.name}" in line
    assert tree(finished_run) == before  # no cancel request, nothing else


# -- a bad option value -------------------------------------------------------------------


@pytest.mark.parametrize("command", [["run"], ["resume", "nope"]])
def test_an_unknown_backend_names_the_option_and_the_choices(in_process, tmp_path, command):
    result = in_process.invoke(app, [*command, "--backend", "k8s"])
    assert result.exit_code == 2, result.output
    assert one_line(result.stderr) == ("error: --backend k8s: no such backend; use one of: "
                                       "local, deployments")
    assert tree(tmp_path) == []  # nothing written, Prefect never started



# -- an unreachable Prefect API -----------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, todo", [
    ([], "unset PREFECT_API_URL to use a temporary local server"),
    (["--backend", "local", "--store", "local-s3"],
     "unset PREFECT_API_URL to use a temporary local server"),
    (["--backend", "deployments"], "start that server (prefect server start)"),
], ids=["default", "local-s3", "deployments"])
def test_a_stale_prefect_api_url_is_named_before_anything_is_written(
        in_process, tmp_path, monkeypatch, args, todo):
    url = f"http://127.0.0.1:{closed_port()}/api"
    monkeypatch.setenv("PREFECT_API_URL", url)
    result = in_process.invoke(app, ["run", *args])
    assert result.exit_code == 2, result.output
    line = one_line(result.stderr)
    assert f"PREFECT_API_URL={url}: no Prefect API answers" in line and todo in line
    assert tree(tmp_path) == []  # no data/, no run, no mlflow.db, no Prefect home


def test_resume_with_a_stale_prefect_api_url_writes_nothing(in_process, new_run, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{closed_port()}/api")
    before = tree(new_run.parent.parent)
    result = in_process.invoke(app, ["resume", new_run.name])
    assert result.exit_code == 2, result.output
    assert "no Prefect API answers" in one_line(result.stderr)
    assert tree(new_run.parent.parent) == before


# -- an unreachable MLflow server ---------------------------------------------------------


@pytest.mark.parametrize("via", ["option", "environment"])
def test_compare_names_an_unreachable_tracking_server(in_process, tmp_path, monkeypatch, via):
    uri = f"http://127.0.0.1:{closed_port()}/"
    if via == "environment":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    result = in_process.invoke(app, ["compare", "x", *(["--tracking-uri", uri]
                                                   if via == "option" else [])])
    assert result.exit_code == 2, result.output
    line = one_line(result.stderr)
    assert f"cannot reach the MLflow tracking server {uri} (Connection refused)" in line
    assert "--tracking-uri or MLFLOW_TRACKING_URI" in line
    assert tree(tmp_path) == []


# -- a bad --set --------------------------------------------------------------------------


@pytest.mark.parametrize("sets, blamed, why", [
    (["train.steps=abc"], "--set train.steps=abc", "train.steps: Input should be a valid "
                                                   "integer"),
    (["train.stepz=5"], "--set train.stepz=5", "train: unknown field(s) stepz"),
    (["train.steps=5", "sync.schedule.fragments=7"], "--set sync.schedule.fragments=7",
     "sync.schedule: sync_every (H) must be divisible by fragments (P)"),
    (["sync.schedule.fragments=7", "sync.schedule.sync_every=28", "train.steps=abc"],
     "--set train.steps=abc", "train.steps:"),  # fragments=7 was made valid again
], ids=["bad-value", "unknown-field", "bad-combination", "a-later-one"])
def test_a_bad_set_is_named_not_the_recipe(in_process, tmp_path, sets, blamed, why):
    result = in_process.invoke(app, ["run", *(a for s in sets for a in ("--set", s))])
    assert result.exit_code == 2, result.output
    line = one_line(result.stderr)
    assert line.startswith(f"error: {blamed}: invalid configuration: {why}"), line
    assert "tiny.yaml" not in line
    assert tree(tmp_path) == []


def test_an_invalid_recipe_file_is_still_named(in_process, tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("train:\n  steps: abc\n")
    result = in_process.invoke(app, ["run", str(recipe), "--set", "train.eval_every=5"])
    assert result.exit_code == 2, result.output
    assert one_line(result.stderr).startswith(f"error: {recipe}: invalid configuration: "
                                              "train.steps:")
    assert tree(tmp_path) == ["mine.yaml"]


def test_compare_without_a_tracking_database_creates_none(in_process, tmp_path):
    result = in_process.invoke(app, ["compare", "x"])
    assert result.exit_code == 2, result.output
    assert f"no MLflow database at {tmp_path / 'mlflow.db'}" in one_line(result.stderr)
    assert tree(tmp_path) == []
