"""``diloco gc``: what a run's store holds, and deleting what neither a resume nor an
audit needs, on a real short run: a dry run by default, the retention of
contributions, orphans, and a resume that still works after gc of a run that is
not finished."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cli_runs import SHORT

from diloco.run import open_run
from storage.objectstore import ObjectStore
from workers import gc as collecting


def train(run: Path, config: Any = None) -> dict[str, Any]:
    """`diloco run` (``config``) or `diloco resume` (None) of ``run``, as their flow
    calls them but in this process (the command's and Prefect's start-up are not
    what is checked here): the jobs are processes, the launcher this one. Tracking
    off: no MLflow in the jobs (what it puts in a run, tracking.json, is a record,
    kept as the run's other records are)."""
    from flows.launchers import LocalLauncher
    from flows.train import run_train

    with pytest.MonkeyPatch.context() as patch:
        for key in list(os.environ):
            if key.startswith(("PREFECT_", "MLFLOW_", "DILOCO_", "AWS_")):
                patch.delenv(key)
        patch.setenv("DILOCO_TRACKING", "off")
        return run_train(config, str(run), launcher=LocalLauncher(), resume=config is None,
                         poll_s=0.3)


@pytest.fixture
def cli(in_process, monkeypatch):
    """``diloco ARGS`` in this process (no start-up of a command per call; a run and
    a resume are `train`'s, above): cwd ``tmp_path``,
    a clean environment. An exception the command did not turn into its one-line
    error fails here (a process would print its traceback)."""
    from cli.app import app

    monkeypatch.setenv("COLUMNS", "120")

    def run(args: list[str]) -> subprocess.CompletedProcess:
        result = in_process.invoke(app, args)
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            args, result.exception, result.stdout, result.stderr)
        return subprocess.CompletedProcess(["diloco", *args], result.exit_code,
                                           result.stdout, result.stderr)

    return run


def files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A real short run that kept everything (no gc after it), three checkpoints per
    worker (steps 8, 16, 24)."""
    from workers.config import load_config

    run = tmp_path_factory.mktemp("gc") / "runs" / "tiny-gc"
    overrides = [value for flag, value in zip(SHORT[::2], SHORT[1::2], strict=True)
                 if flag == "--set"]
    cfg = load_config("tiny", [*overrides, "retention.after_run=false",
                               "retention.worker_checkpoints=3"])
    report = train(run, cfg)
    assert report["state"] == "finished", report
    return run


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A copy of the finished run under ``tmp_path/runs`` (cwd for the commands)."""
    where = tmp_path / "runs" / finished.name
    shutil.copytree(finished, where)
    return where


def deltas(run: Path) -> dict[tuple[int, int], list[str]]:
    """(fragment, round) -> the payload folders of outer gradients present."""
    found: dict[tuple[int, int], list[str]] = {}
    for folder in run.glob("frag/*/r*/delta/*/*"):
        found.setdefault((int(folder.parts[-5]), int(folder.parts[-4][1:])), []).append(
            folder.name)
    return found


def test_a_dry_run_deletes_nothing_and_apply_keeps_what_an_audit_needs(run, cli):
    before = files(run)
    assert len(list(run.glob("workers/*/ckpt/*.json"))) == 6  # 3 per worker
    dry = cli(["gc", run.name])
    assert dry.returncode == 0, dry.stderr
    # the consoles' width is fixed when cli.console is first imported in this process,
    # by whichever test came first: a line may wrap, so compare the words
    said = " ".join(dry.stdout.split())
    assert "dry run: nothing deleted" in said and f"diloco gc {run.name} --apply" in said
    assert "worker checkpoints" in dry.stdout and "finished" in dry.stdout
    assert files(run) == before

    applied = cli(["gc", run.name, "--apply"])
    assert applied.returncode == 0, applied.stderr
    after = files(run)
    # a finished run is not resumed: no worker checkpoint is left
    assert not list(run.glob("workers/*/ckpt/*"))
    # kept: manifest, data, initial and canonical state, every record, every mean
    kept = [k for k in before if not k.startswith("workers/") and "/delta/" not in k]
    assert all(after.get(k) == before[k] for k in kept), set(kept) - set(after)
    # the payloads of the two newest rounds of each fragment (retention.contributions)
    got = deltas(run)
    rounds = {p: sorted(r for (q, r) in got if q == p) for p in (0, 1)}
    for p in (0, 1):
        applied_rounds = sorted(int(m.parts[-2][1:]) for m in run.glob(f"frag/{p}/r*/mean.json"))
        assert rounds[p] == applied_rounds[-2:], (p, rounds[p], applied_rounds)
    assert all(len(v) == 2 for v in got.values())  # both workers' payloads of those
    assert sum(after.values()) < sum(before.values())
    # the run reads as before
    status = cli(["status", run.name])
    assert status.returncode == 0 and "finished" in status.stdout, status.stderr
    again = cli(["gc", run.name])
    assert again.returncode == 0 and "nothing to delete" in " ".join(again.stdout.split()), \
        again.stdout


def test_contributions_all_keeps_every_payload_and_orphans_go(run, cli):
    count = sum(len(v) for v in deltas(run).values())
    orphan = run / "frag" / "0" / "r000000" / "delta" / "region-a" / "0badc0ffee00"
    orphan.mkdir()
    (orphan / "zarr.json").write_text("{}")
    unfinished = run / "global" / "frag" / "0" / "r000000"  # a write that never committed
    unfinished.mkdir(parents=True, exist_ok=True)
    (unfinished / "x").write_text("partial")
    out = cli(["gc", run.name, "--apply", "--contributions", "all"])
    assert out.returncode == 0, out.stderr
    assert not orphan.exists() and not unfinished.exists()
    assert sum(len(v) for v in deltas(run).values()) == count


def test_gc_of_a_run_that_can_resume_keeps_what_resume_needs(run, tmp_path, cli):
    """region-b did not finish (as after a crash): its newest checkpoint, every payload,
    and orphans (a writer may be about to commit one) stay; the resume then finishes."""
    status = run / "members" / "region-b" / "status.json"
    body = json.loads(status.read_text())
    status.write_text(json.dumps({**body, "state": "interrupted"}))
    orphan = run / "frag" / "0" / "r000000" / "delta" / "region-a" / "0badc0ffee00"
    orphan.mkdir()
    (orphan / "zarr.json").write_text("{}")
    payloads = deltas(run)
    plan = collecting.plan(open_run(ObjectStore(str(run))), keep_worker=1)
    assert not plan.finished
    assert {d.kind for d in plan.deletions} == {"worker checkpoints"}
    out = cli(["gc", run.name, "--apply", "--worker-checkpoints", "1"])
    assert out.returncode == 0, out.stderr
    assert "not finished" in out.stdout
    for worker in ("region-a", "region-b"):
        assert sorted(p.name for p in (run / "workers" / worker / "ckpt").glob("*.json")) == [
            "00000024.json"]
    assert orphan.exists()
    assert deltas(run) == payloads
    resumed = train(run)
    assert resumed["state"] == "finished", resumed
    assert json.loads(status.read_text())["state"] == "finished"


def test_bad_input_is_one_line(run, cli):
    out = cli(["gc", run.name, "--contributions", "-1"])
    assert out.returncode == 2 and "--contributions -1" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    missing = cli(["gc", "nothere"])
    assert missing.returncode == 2 and "no run" in missing.stderr, missing.stderr


# One S3 server is enough for the sizes of a listing: SeaweedFS, the real store (a
# filer with folders under its keys), rather than moto's mock.
@pytest.mark.s3_backends("seaweedfs")
def test_sizes_lists_every_key_with_its_size(make_store):
    store = make_store()
    store.put("a/b.json", b"12345")
    store.put("a/c/d", b"x" * 1000)
    store.put("e", b"")
    assert store.sizes() == {"a/b.json": 5, "a/c/d": 1000, "e": 0}
    assert store.sizes("a/c") == {"a/c/d": 1000}
    assert store.sizes("nothing") == {}
    use = collecting.usage(store)
    assert use.total_bytes == 1005 and use.total_objects == 3
