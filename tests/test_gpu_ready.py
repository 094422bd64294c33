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
            if caller.f_code.co_filename.endswith(("workers/train.py", "workers/losslog.py")):
                reads.append((caller.f_code.co_name, name))
            return original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read)

    for name in ("item", "__float__", "tolist", "cpu"):
        counting(name)
    run = Run(config(dataset, "workers=[solo]", "train.steps=8", "train.log_every=4"))
    result = run.train()["solo"]
    monkeypatch.undo()
    assert [n for f, n in reads if f == "_run"] == []  # nothing read back in the loop itself
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


def test_gpu_check_runs_a_recipe_on_the_cpu(tmp_path, capsys):
    """The path a user without a GPU can try: the small recipe, shortened rounds."""
    import json  # noqa: PLC0415

    code = _gpu_check().main(["--device", "cpu", "--recipe", "small", "--steps", "8",
                              "--dir", str(tmp_path), "--set", "data.batch_size=2",
                              "--set", "data.seq_len=32", "--set", "train.threads=1"])
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
