"""The replica harness itself (tests/replicas.py), on which the numerics tests rely:
an aggregator that dies must fail the test at once, not leave the workers waiting
for means that never come (a hung test is killed only by the suite's timeout)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from diloco.config import SyncConfig
from replicas import train_replicas


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(2, 1)


def _data(worker: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 2, generator=g)
    return x, x.sum(1, keepdim=True)


def test_a_dead_aggregator_fails_the_run_promptly(tmp_path):
    def aggregate(stop: threading.Event):
        raise OSError("the aggregator lost its store")

    cfg = SyncConfig(
        schedule={"mode": "diloco", "sync_every": 2},
        outer={"lr": 1.0, "momentum": 0.0},
    )
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="aggregator thread failed") as info:
        train_replicas(str(tmp_path), _model, _data, cfg, total_steps=6, aggregate=aggregate)
    assert isinstance(info.value.__cause__, OSError)
    # the workers gave up after the stop's patience, not the harness's 120 s timeout
    assert time.monotonic() - start < 60
