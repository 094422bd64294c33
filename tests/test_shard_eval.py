"""The canonical evaluation of a sharded aggregator (``aggregator.shards: 2``): the
aggregator job (shard 0) logs the same eval figures as the unsharded one (K = 1), the
initial one, one per level of rounds and the last, evaluated from the whole canonical
checkpoints shard 0 assembles from the parts. The workers' contributions are
committed by the test, one merge point at a time, so both runs apply the same rounds
in the same order."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from test_distributed import MICRO, data_url

from diloco.run import open_run
from flows.aggregator import run_aggregator_job, run_shard_job
from storage import layout
from tracking.hooks import Hooks
from workers.config import load_config
from workers.runs import create_run

pytestmark = pytest.mark.slow
__all__ = ["data_url"]  # the module's fixture, shared


class Evals(Hooks):
    """The eval figures the aggregator job logs, by rounds applied (as MLflow gets
    them: in a round's report or in an evaluation of its own)."""

    def __init__(self):
        self.by_round: dict[int, float] = {}

    def aggregator_round(self, report: dict[str, Any]) -> None:
        if "eval_loss" in report:
            self.by_round[report["eval_round"]] = report["eval_loss"]

    def aggregator_eval(self, report: dict[str, Any]) -> None:
        self.by_round[report["rounds"]] = report["eval_loss"]


def contribute(url: str, stop: threading.Event) -> None:
    """The two workers' deltas, merge point by merge point (fragment 0 round 0,
    fragment 1 round 0, fragment 0 round 1, ...), each once the previous mean is in."""
    ex = open_run(url)
    rounds, order = ex.manifest.rounds, []
    for r in range(max(rounds)):
        order += [(p, r) for p in range(len(rounds)) if r < rounds[p]]
    for p, r in order:
        for i, w in enumerate(ex.manifest.workers):
            rng = np.random.default_rng(1000 * r + 10 * p + i)
            x = rng.standard_normal(ex.manifest.numel(p)).astype(np.float32) * 0.02
            ex.publish_delta(p, r, w, x, tokens=256)
        while not ex.store.exists(layout.mean_commit(p, r)):
            if stop.is_set():
                return
            time.sleep(0.02)


def aggregate(tmp_path, data_url: str, shards: int) -> tuple[dict, dict[int, float]]:
    url = str(tmp_path / f"k{shards}")
    cfg = load_config("tiny", [*MICRO, f"data.dataset={data_url}", "train.steps=16",
                               "train.keep_checkpoints=2", f"aggregator.shards={shards}"])
    create_run(cfg, url)
    stop, hooks = threading.Event(), Evals()
    jobs = [threading.Thread(target=contribute, args=(url, stop))]
    jobs += [threading.Thread(target=run_shard_job, args=(url,),
                              kwargs={"shard": s, "stop": stop}) for s in range(1, shards)]
    for t in jobs:
        t.start()
    try:
        out = run_aggregator_job(url, stop=stop, hooks=hooks)
    finally:
        stop.set()
        for t in jobs:
            t.join(60)
    assert out["state"] == "finished", out
    return out, hooks.by_round


def test_two_shards_log_the_eval_figures_of_one(tmp_path, data_url):
    one, evals_1 = aggregate(tmp_path, data_url, 1)
    two, evals_2 = aggregate(tmp_path, data_url, 2)
    total = one["total_rounds"]
    assert len(evals_1) >= 2 and total in evals_1  # a level per P rounds, the last one
    assert evals_2 == evals_1
    for key in ("initial_eval_loss", "eval_loss", "perplexity", "eval_round"):
        assert two[key] == one[key], key
