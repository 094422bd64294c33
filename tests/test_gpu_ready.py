"""GPU readiness checked on the CPU: the inner step leaves its loss on the device, so a
worker reads losses back only at log steps (one copy per log step)."""

from __future__ import annotations

import sys
import uuid

import pytest
import torch
from test_worker import Run, config

from workers.data.prepare import prepare_data


@pytest.fixture(scope="module")
def dataset() -> str:
    url = f"memory://datasets/gpu-ready-{uuid.uuid4().hex[:8]}"
    prepare_data(["builtin:shakespeare"], url, max_bytes=100_000)
    return url


def test_step_reads_the_loss_back_only_at_log_steps(dataset, monkeypatch):
    reads: list[tuple[str, str]] = []

    def counting(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.endswith(("workers/loop.py", "workers/losslog.py",
                                                   "workers/inner.py")):
                reads.append((caller.f_code.co_name, name))
            return original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read)

    for name in ("item", "__float__", "tolist", "cpu"):
        counting(name)
    run = Run(config(dataset, "workers=[solo]", "train.steps=8", "train.log_every=4"))
    result = run.train()["solo"]
    monkeypatch.undo()
    # nothing read back in the loop itself or its inner step
    assert [n for f, n in reads if f in ("_run", "inner_step", "_batch")] == []
    assert [n for f, n in reads if f == "flush"] == ["tolist", "tolist"]  # steps 4 and 8
    assert len(result.losses) == 8 and sorted(run.losses["solo"]) == [4, 8]
    assert run.losses["solo"][8] == result.losses[-1] == result.final_loss


def _gpu_check():
    import importlib.util  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    path = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A narrower, shallower model than the recipes' (21M parameters for small, 3.3M for
# tiny): what these checks assert (every step, round, section and figure is there)
# does not depend on the model's size, and most of their CPU time did.
SMALLER = "model.overrides={d_model: 64, n_layers: 4, n_heads: 2}"


def test_gpu_check_runs_a_recipe_on_the_cpu(tmp_path, capsys):
    """The path a user without a GPU can try: the small recipe, shortened rounds (and
    here a smaller model)."""
    import json  # noqa: PLC0415

    code = _gpu_check().main(["--device", "cpu", "--recipe", "small", "--steps", "8",
                              "--dir", str(tmp_path), "--set", "data.batch_size=2",
                              "--set", "data.seq_len=32", "--set", "train.threads=1",
                              "--set", SMALLER])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["sync_every"] == 4 and report["rounds_merged"][0] >= 4  # 2 per fragment
    assert report["steps_per_s"] > 0 and report["peak_memory_bytes"] > 0
    assert report["aggregator_done"] is True


def test_gpu_check_fails_without_the_device_it_was_asked_for(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert _gpu_check().main(["--device", "cuda", "--steps", "2"]) == 1
    assert "no CUDA device" in capsys.readouterr().err


def test_the_prepared_check_runs_every_section_on_the_cpu(tmp_path, capsys, monkeypatch):
    """``--all --quick`` on the CPU: what a lent GPU machine will run, small (and here
    the tiny recipe's model smaller still: every config the check loads of it, so the
    runs' manifests and the worker processes that read them too). Every section
    writes its figures; the torch codecs give the host's bits."""
    import json  # noqa: PLC0415

    from workers import config  # noqa: PLC0415

    load = config.load_config

    def smaller_tiny(source=None, overrides=None):
        return load(source, [*(overrides or []), *([SMALLER] if source == "tiny" else [])])

    monkeypatch.setattr(config, "load_config", smaller_tiny)
    code = _gpu_check().main(["--all", "--out", str(tmp_path), "--device", "cpu", "--quick"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert not [k for k, v in report.items() if isinstance(v, dict) and "error" in v]
    assert report["env"]["torch"] == torch.__version__
    inner = report["inner"]["rows"]
    assert {r["batches"] for r in inner} == {"pageable", "pinned"}
    assert all(r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 for r in inner)
    codecs = report["codecs"]["rows"]
    assert [r["codec"] for r in codecs] == ["int8", "int4", "fp4-e3m0", "topk2"]
    assert all(r["identical"] is True for r in codecs)
    exchange = {r["outer_device"]: r for r in report["exchange"]["rows"]}
    assert set(exchange) == {"cpu", "device"}
    assert all(r["send_ms"] > 0 and r["merge_ms"] > 0 and r["aggregator_done"]
               for r in exchange.values())
    assert 0 < exchange["cpu"]["blocked_share_at_recipe_h"] < 1
    streaming = report["streaming"]
    assert streaming["aggregator_done"] and len(streaming["rows"]) == 2
    assert 0 < streaming["canonical_eval_loss"] < 10
    assert all(r["steps"] == 16 for r in streaming["rows"])
    md = (tmp_path / "gpu.md").read_text()
    assert "## Streaming run" in md and "Canonical eval loss" in md


def test_the_prepared_check_refuses_an_unknown_section(tmp_path, capsys):
    assert _gpu_check().main(["--all", "--out", str(tmp_path), "--device", "cpu",
                              "--sections", "env,warp"]) == 2
    assert "unknown warp" in capsys.readouterr().err
