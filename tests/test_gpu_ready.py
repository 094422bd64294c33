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
