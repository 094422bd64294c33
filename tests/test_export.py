"""Taking a run's model away: ``diloco export`` writes what transformers loads (the
same logits as our model), ``--round N`` any committed round, ``model.init_from``
starts a run from the exported weights bit for bit, ``diloco sample`` continues a
prompt, and the finished run's model reaches MLflow. No hub: tiny models only."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import pytest
import torch
import transformers  # a dev dependency (pyproject): always installed for the tests
from safetensors.torch import load_file

from cli.app import app
from diloco.aggregator import Aggregator
from diloco.run import load_initial, open_run, plan_for
from workers.config import load_config
from workers.data.prepare import prepare_data
from workers.export import canonical_model
from workers.loop import WorkerLoop
from workers.runs import create_run

MICRO = [
    "model.overrides={d_model: 32, n_layers: 2, n_heads: 2, max_seq_len: 64}",
    "data.seq_len=16", "data.batch_size=4", "optim.warmup_steps=2", "optim.lr=0.01",
    "train.eval_every=0", "train.eval_batches=1", "train.log_every=1",
    "train.checkpoint_every=0", "train.steps=8", "sync.schedule.sync_every=4", "sync.schedule.fragments=2",
    "sync.schedule.overlap=1", "sync.liveness.poll_max_s=0.05", "sync.membership.grace_min_s=0.05", "sync.membership.quorum=1.0",
]


@pytest.fixture(autouse=True)
def no_tracking(monkeypatch):
    monkeypatch.setenv("DILOCO_TRACKING", "off")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("data") / "shakespeare")
    prepare_data(["builtin:shakespeare/tragedies/*"], url, max_bytes=60_000)
    return url


def train(url: str, cfg) -> None:
    """The whole run in this process: the aggregator and two workers in threads."""
    create_run(cfg, url)
    stop = threading.Event()
    agg = Aggregator(open_run(url), slots=cfg.data.slot_count(len(cfg.workers)))
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            loop = WorkerLoop.open(url, name)
            try:
                loop.run()
            finally:
                loop.close()
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=agg.run, args=(stop, 120))]
    threads += [threading.Thread(target=work, args=(w,)) for w in cfg.workers]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join(120)
    threads[0].join(120)
    stop.set()
    assert not errors, errors


@pytest.fixture(scope="module")
def trained(tmp_path_factory, dataset) -> Path:
    """A finished micro run under runs/ (a few rounds per fragment)."""
    where = tmp_path_factory.mktemp("store") / "runs" / "micro-20260101-120000"
    train(str(where), load_config("tiny", [*MICRO, f"data.dataset={dataset}"]))
    return where


def rounds_of(run: Path) -> int:
    """Rounds every fragment of the finished run has."""
    return min(open_run(str(run)).manifest.rounds)


def logits_ours(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)[0]


def logits_hf(out: Path, x: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        return hf(input_ids=x).logits


def test_export_loads_in_transformers_with_the_same_logits(in_process, trained, tmp_path):
    out = tmp_path / "model"
    result = in_process.invoke(app, ["export", str(trained), "--out", str(out)])
    assert result.exit_code == 0, result.output
    total = rounds_of(trained)
    assert total >= 2
    said = " ".join(result.output.split())  # rich wraps long paths where it can
    assert f"after round {total}/{total}" in said
    names = sorted(p.name for p in out.iterdir())
    assert {"config.json", "model.safetensors"} <= set(names), names
    assert not list(tmp_path.glob(".model*")), "no temporary directory is left behind"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    canon = canonical_model(open_run(str(trained)))
    assert canon.rounds == total
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits_hf(out, x), logits_ours(canon.model, x),
                               atol=1e-4, rtol=1e-4)


def test_round_n_is_that_rounds_model_and_a_missing_round_is_refused(
        in_process, trained, tmp_path):
    ex = open_run(str(trained))
    first = canonical_model(ex, 0)
    plan = plan_for(first.model, first.config.sync)
    for p, init in enumerate(load_initial(ex, len(plan))):
        assert torch.equal(plan.gather(first.model, p), init)  # round 0: the initial model
    assert canonical_model(ex, 1).rounds == 1
    assert not torch.equal(plan.gather(canonical_model(ex, 1).model, 0),
                           plan.gather(first.model, 0))
    out = tmp_path / "never"
    total = rounds_of(trained)
    result = in_process.invoke(app, ["export", str(trained), "--out", str(out),
                                     "--round", str(total + 1)])
    assert result.exit_code == 2, result.output
    line = " ".join(result.stderr.split())
    assert f"round {total + 1} is not available" in line and f"0..{total}" in line
    assert not out.exists()


def test_export_never_overwrites(in_process, trained, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = in_process.invoke(app, ["export", str(trained), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "not an empty directory" in " ".join(result.stderr.split())
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_init_from_equals_the_exported_weights_bit_for_bit(in_process, trained, dataset,
                                                           tmp_path):
    first = tmp_path / "first"
    assert in_process.invoke(app, ["export", str(trained), "--out", str(first)]).exit_code == 0
    cfg = load_config("tiny", [*MICRO, f"data.dataset={dataset}",
                               f"model.init_from={first}"])
    again = tmp_path / "runs" / "again-20260101-120000"
    create_run(cfg, str(again))
    second = tmp_path / "second"
    result = in_process.invoke(app, ["export", str(again), "--out", str(second)])
    assert result.exit_code == 0, result.output
    assert f"after round 0/{rounds_of(trained)}" in result.output
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == torch.float32
        assert torch.equal(a[name], b[name]), name


def test_sample_continues_the_prompt_reproducibly(in_process, trained):
    args = ["sample", str(trained), "--prompt", "ROMEO:", "--tokens", "24", "--seed", "3"]
    one, two = in_process.invoke(app, args), in_process.invoke(app, args)
    assert one.exit_code == 0, one.output
    assert one.stdout == two.stdout  # the same seed, the same text
    assert one.stdout.startswith("ROMEO:")
    assert len(one.stdout.encode()) > len("ROMEO:") + 1
    other = in_process.invoke(app, [*args[:-1], "4"])
    assert other.exit_code == 0 and other.stdout != one.stdout
    greedy = in_process.invoke(app, ["sample", str(trained), "--prompt", "ROMEO:",
                                     "--tokens", "8", "--temperature", "0"])
    canon = canonical_model(open_run(str(trained)))
    ids = list(b"ROMEO:")
    for _ in range(8):
        ids.append(int(logits_ours(canon.model, torch.tensor([ids]))[0, -1].argmax()))
    expected = bytes(ids).decode("utf-8", errors="replace")
    assert greedy.stdout == expected + "\n"


def test_sample_refuses_bad_values(in_process, trained):
    result = in_process.invoke(app, ["sample", str(trained), "--prompt", "x", "--top-k", "-1"])
    assert result.exit_code == 2
    assert "--top-k must be >= 0" in result.stderr


def test_the_finished_runs_model_is_an_mlflow_artifact(trained, tmp_path):
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    from tracking.parent_run import log_model

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment(f"export-{uuid.uuid4().hex[:6]}",
                                   artifact_location=str(tmp_path / "artifacts"))
    parent = client.create_run(exp).info.run_id
    line = log_model(client, uri, parent, str(trained), None)
    total = rounds_of(trained)
    assert line.startswith(f"round {total}/{total}")
    got = Path(download_artifacts(run_id=parent, artifact_path="model", tracking_uri=uri,
                                  dst_path=str(tmp_path / "down")))
    x = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    canon = canonical_model(open_run(str(trained)))
    torch.testing.assert_close(logits_hf(got, x), logits_ours(canon.model, x),
                               atol=1e-4, rtol=1e-4)
    assert f"round {total}/{total}" in client.get_run(parent).data.tags["diloco.model"]


def test_a_checkpoint_pruned_while_read_is_looked_for_again(trained, monkeypatch):
    """The aggregator may prune a canonical checkpoint while a healer reads it (a
    part already gone): the frontier looks again instead of failing the worker."""
    from diloco import bootstrap
    from storage.errors import PartialObject

    ex = open_run(str(trained))
    cfg = canonical_model(ex).config
    real, calls = bootstrap.read_checkpoint, {"n": 0}

    def pruned_once(store, key):
        calls["n"] += 1
        if calls["n"] == 1:
            raise PartialObject(f"{key}: a part is missing")
        return real(store, key)

    monkeypatch.setattr(bootstrap, "read_checkpoint", pruned_once)
    front = bootstrap.frontier(ex, cfg.sync, poll_s=0.01, timeout_s=30)
    assert calls["n"] > 1 and front.rounds == [rounds_of(trained)] * 2
