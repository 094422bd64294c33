"""FSDP2 islands (``train.island: fsdp``) under torchrun with gloo on CPU: the same
training as a replicated island with the same global batch, across outer syncs, and
a resume from the sharded checkpoint."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch
from test_distributed import MICRO, losses, torchrun

from diloco.aggregator import Aggregator
from diloco.run import open_exchange
from storage.objectstore import ObjectStore
from workers import checkpoint
from workers.config import load_config
from workers.data.prepare import prepare_data
from workers.runs import create_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("data") / "shakespeare")
    prepare_data(["builtin:shakespeare"], url, max_bytes=200_000)
    return url


def island_run(tmp_path: Path, data_url: str, name: str, *overrides: str):
    """A two-process island trained to the end: (loss curve, eval loss, final checkpoint)."""
    url = str(tmp_path / name)
    cfg = load_config("tiny", [*MICRO, f"data.dataset={data_url}", "workers=[solo]",
                               "data.slots=1", "train.checkpoint_every=16", *overrides])
    create_run(cfg, url)
    agg = Aggregator(open_exchange(url))
    stop = threading.Event()
    t = threading.Thread(target=agg.run, args=(stop, 300))
    t.start()
    try:
        out = torchrun(2, "--run", url, "--worker", "solo")
    finally:
        t.join(60)
        stop.set()
    assert agg.done
    # both ranks print their result; their lines may interleave: the first eval loss
    result = {"eval_loss": float(re.search(r'"eval_loss": ([0-9.e+-]+)', out.stdout)[1])}
    return losses(out.stderr, "solo"), result, checkpoint.load(ObjectStore(url), "solo")


@pytest.mark.parametrize("sync", [["sync.overlap=auto"], ["sync.split_tensors=true"]],
                         ids=["overlap-auto", "split-tensors"])
def test_fsdp_island_trains_as_the_replicated_island(tmp_path, data_url, sync):
    """Same global batch, same loss curve over two outer syncs, same final model: with
    ``overlap: auto`` (rank 0 tells the others which fragments are due) and with
    fragments holding pieces of tensors (a split tensor moves whole)."""
    rep_losses, rep, (rep_step, rep_state) = island_run(tmp_path, data_url, "rep", *sync)
    fsdp_losses, fsdp, (fsdp_step, fsdp_state) = island_run(
        tmp_path, data_url, "fsdp", "train.island=fsdp", *sync)
    assert len(rep_losses) == len(fsdp_losses) == 16 and rep_step == fsdp_step == 16
    assert fsdp_losses == pytest.approx(rep_losses, rel=1e-5, abs=1e-4)  # logged to 4 places
    assert fsdp["eval_loss"] == pytest.approx(rep["eval_loss"], rel=1e-5)
    assert rep_losses[-1] < rep_losses[0] - 1.0
    # the sharded checkpoint holds the whole model; AdamW divides by sqrt(v), so a few
    # elements with near-zero second moments drift most from float-order differences
    names = sorted(rep_state["model"])
    a = torch.cat([rep_state["model"][n].flatten() for n in names])
    b = torch.cat([fsdp_state["model"][n].flatten() for n in names])
    assert (b - a).norm() / a.norm() < 1e-3  # measured 1.1e-4
    assert set(fsdp_state["optimizer"]["state"]) == set(names)  # AdamW state per parameter


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:  # every rank its half of a batch fixed by the step
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 64, (4, 16), generator=g)
        rank = torch.distributed.get_rank()
        _, loss = model(x[2 * rank: 2 * rank + 2], x[2 * rank: 2 * rank + 2])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def _island(seed: int):
    from diloco.config import SyncConfig  # noqa: PLC0415
    from diloco.run import plan_for  # noqa: PLC0415
    from workers.island import ShardedIsland  # noqa: PLC0415
    from workers.model import ModelConfig, build_model  # noqa: PLC0415

    model = build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2,
                                    max_seq_len=16), seed=seed)
    plan = plan_for(model, SyncConfig(fragments=2))
    initial = [plan.gather(build_model(model.config, seed=0), p) for p in range(len(plan))]
    island = ShardedIsland(model, plan, torch.distributed.get_rank(), initial)
    return island, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def _resume_rank(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{out}/rendezvous",
                                         rank=rank, world_size=2)
    try:
        island, opt = _island(seed=0)
        _train(island.model, opt, range(3))
        model_sd, opt_sd = island.whole_state(opt)
        if rank == 0:
            torch.save((model_sd, opt_sd), f"{out}/ckpt.pt")
        torch.distributed.barrier()
        _train(island.model, opt, range(3, 6))
        # a new island (other initial weights) from the checkpoint of step 3
        resumed, opt2 = _island(seed=1)
        resumed.load_state(opt2, *torch.load(f"{out}/ckpt.pt", weights_only=False))
        _train(resumed.model, opt2, range(3, 6))
        resumed.gather(range(len(resumed.plan)))
        island.gather(range(len(island.plan)))
        if rank == 0:
            torch.save((island.mirror.state_dict(), resumed.mirror.state_dict()),
                       f"{out}/final.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_fsdp_island_resumes_from_its_checkpoint_exactly(tmp_path):
    """Whole state saved from the shards and loaded into a fresh sharded island (every
    rank keeping its shards of model and AdamW state): three more steps give the bits
    of the uninterrupted run."""
    torch.multiprocessing.spawn(_resume_rank, args=(str(tmp_path),), nprocs=2)
    straight, resumed = torch.load(tmp_path / "final.pt", weights_only=False)
    assert straight.keys() == resumed.keys()
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name
