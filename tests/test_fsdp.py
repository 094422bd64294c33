"""FSDP2 islands (``train.island: fsdp``) on two processes with gloo on CPU: the same
training as a replicated island with the same global batch, across outer syncs, and
a resume from the sharded checkpoint.

Every island here runs on the same two rank processes, one run after the other (a
module fixture): each rank runs ``python -m workers``'s ``main`` for each run with
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ...), then the
resume scenario. Starting torch once per rank instead of once per run and rank (and
no torchrun agent) is most of this file's CPU time saved; torchrun itself is
tested in tests/test_distributed.py and tests/test_island_stop.py."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from test_distributed import MICRO, free_port, losses
from test_worker_checkpoints import same
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from diloco.aggregator import Aggregator
from diloco.run import open_run
from storage.objectstore import ObjectStore
from workers import checkpoint, checkpoint_files
from workers.config import load_config
from workers.data.prepare import prepare_data
from workers.group_exit import exit_after_group
from workers.runs import create_run

pytestmark = pytest.mark.slow

# overlap auto sizes tau to measured latencies: on a loaded machine the two runs' taus
# (so their trajectories) could differ; a margin this wide makes every tau H/P - 1,
# which the ranks other than rank 0 still learn only from it
AUTO = ["sync.schedule.overlap=auto", "sync.schedule.overlap_margin=1000"]
SYNCS = {"overlap-auto": AUTO, "split-tensors": ["sync.schedule.split_tensors=true"]}
ISLANDS = {"rep": [], "fsdp": ["train.island=fsdp"]}
RUN_S = 300  # each island run's bound (as a torchrun of one run had), and the resume's


@contextmanager
def _output_to(out: str, err: str):
    """This process's stdout and stderr (the file descriptors: what a rank's logging
    and its result line write to) into these files."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(out, "w") as o, open(err, "w") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)


def _island_ranks(rank: int, out: str, runs: list[tuple[str, str, int]]) -> None:
    """One rank of every island run in turn, as ``torchrun -m workers -- --run URL
    --worker solo`` runs it (rank 0 runs the run's aggregator beside it, as the test
    process did for torchrun), then this rank of the resume scenario."""
    from workers.__main__ import main  # noqa: PLC0415

    for name, url, port in runs:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                          LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          OMP_NUM_THREADS="1")
        agg, stop, t = None, threading.Event(), None
        if rank == 0:
            agg = Aggregator(open_run(url))
            t = threading.Thread(target=agg.run, args=(stop, RUN_S))
            t.start()
        try:
            with _output_to(f"{out}/{name}.out{rank}", f"{out}/{name}.err{rank}"):
                code = main(["--run", url, "--worker", "solo"])
        finally:
            if t is not None:
                t.join(60)
                stop.set()
        Path(f"{out}/{name}.code{rank}").write_text(f"{code} {agg.done if agg else ''}")
        if code != 0:  # the other rank is ended by the spawn (as torchrun would)
            raise RuntimeError(f"{name}: rank {rank} exited {code}")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        del os.environ[key]
    _resume_rank(rank, out)
    exit_after_group(0)  # as an island's rank leaves: no teardown race (SIGABRT) after success


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    """The two rank processes' work, done: four island runs (replicated and fsdp, for
    each of SYNCS) in ``<dir>/<sync>-<island>``, and the resume scenario's files."""
    out = tmp_path_factory.mktemp("fsdp")
    data_url = str(out / "shakespeare")
    prepare_data(["builtin:shakespeare"], data_url, max_bytes=200_000)
    runs = []
    for sync_id, sync in SYNCS.items():
        for island, extra in ISLANDS.items():
            name = f"{sync_id}-{island}"
            url = str(out / name)
            cfg = load_config("tiny", [*MICRO, f"data.dataset={data_url}", "workers=[solo]",
                                       "data.slots=1", "train.checkpoint_every=16", *extra,
                                       *sync])
            create_run(cfg, url)
            runs.append((name, url, free_port()))
    ctx = torch.multiprocessing.spawn(_island_ranks, args=(str(out), runs), nprocs=2,
                                      join=False)
    deadline = time.monotonic() + RUN_S * (len(runs) + 1)
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks did not finish in time"
    finally:
        for proc in ctx.processes:  # a hung rank: end it (only the processes started here)
            if proc.is_alive():
                proc.kill()
    return out


def island_run(out: Path, name: str):
    """A two-process island trained to the end: (loss curve, eval loss, final checkpoint)."""
    assert [(out / f"{name}.code{r}").read_text() for r in (0, 1)] == ["0 True", "0 "], \
        (out / f"{name}.err0").read_text()[-3000:]  # both ranks exit 0; the aggregator done
    stdout = (out / f"{name}.out0").read_text()
    result = {"eval_loss": float(re.search(r'"eval_loss": ([0-9.e+-]+)', stdout)[1])}
    stderr = (out / f"{name}.err0").read_text() + (out / f"{name}.err1").read_text()
    return losses(stderr, "solo"), result, checkpoint.load(ObjectStore(str(out / name)), "solo")


@pytest.mark.parametrize("sync", list(SYNCS))
def test_fsdp_island_trains_as_the_replicated_island(ranks, sync):
    """Same global batch, same loss curve over two outer syncs, same final model (the
    fsdp island's from its sharded checkpoint): with
    ``overlap: auto`` (rank 0 tells the others which fragments are due) and with
    fragments holding pieces of tensors (a split tensor moves whole)."""
    rep_losses, rep, (rep_step, rep_state) = island_run(ranks, f"{sync}-rep")
    fsdp_losses, fsdp, (fsdp_step, fsdp_state) = island_run(ranks, f"{sync}-fsdp")
    assert len(rep_losses) == len(fsdp_losses) == 16 and rep_step == fsdp_step == 16
    # logged to 4 places; the float order differs (measured with split tensors: at
    # most 2e-4 at step 15, 5.7e-5 relative; eval loss 1.3e-5 relative)
    assert fsdp_losses == pytest.approx(rep_losses, rel=1e-4, abs=1e-4)
    assert fsdp["eval_loss"] == pytest.approx(rep["eval_loss"], rel=1e-4)
    assert rep_losses[-1] < rep_losses[0] - 1.0
    # the sharded checkpoint holds the whole model; AdamW divides by sqrt(v), so a few
    # elements with near-zero second moments drift most from float-order differences
    ranks_of = {name: checkpoint.latest(ObjectStore(str(ranks / f"{sync}-{name}")),
                                        "solo").dcp["ranks"] for name in ISLANDS}
    assert ranks_of == {"rep": 1, "fsdp": 2}  # the fsdp island's ranks wrote their shards
    names = sorted(rep_state["model"])
    a = torch.cat([rep_state["model"][n].flatten() for n in names])
    b = torch.cat([fsdp_state["model"][n].flatten() for n in names])
    assert (b - a).norm() / a.norm() < 1e-3  # measured 1.1e-4
    assert set(fsdp_state["optimizer"]["state"]) == set(names)  # AdamW state per parameter
    assert fsdp_state["tokens"] == rep_state["tokens"]  # rank 0's rest of the state


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
    from workers.model import build_model  # noqa: PLC0415
    from workers.model_config import ModelConfig  # noqa: PLC0415

    model = build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2,
                                    max_seq_len=16), seed=seed)
    plan = plan_for(model, SyncConfig(schedule={"fragments": 2}))
    initial = [plan.gather(build_model(model.config, seed=0), p) for p in range(len(plan))]
    island = ShardedIsland(model, plan, torch.distributed.get_rank(), initial)
    return island, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


class _FailingWriter:
    """A DCP writer whose file writes raise ``error`` (a rank losing its store)."""

    def __init__(self, writer, error: BaseException):
        self._writer, self._error = writer, error

    def __getattr__(self, name):
        return getattr(self._writer, name)

    def write_data(self, plan, planner):
        raise self._error


def _failing_on_rank_1(rank: int, errors: list[BaseException]):
    """Rank 1's next ``len(errors)`` shard writers fail with these errors, in order."""
    writer = checkpoint_files.new_writer

    def make(*args):
        inner = writer(*args)
        return _FailingWriter(inner, errors.pop(0)) if rank == 1 and errors else inner
    return make


def _resume_rank(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{out}/rendezvous",
                                         rank=rank, world_size=2)
    store = ObjectStore(f"{out}/store")
    try:
        island, opt = _island(seed=0)
        _train(island.model, opt, range(3))
        model_sd, opt_sd = island.whole_state(opt)
        writer, keys = checkpoint_files.new_writer, []

        def new_key():
            keys.append(checkpoint.dcp_key("solo", 3))
            return keys[-1]
        try:  # rank 1's store drops a connection once: every rank writes again, elsewhere
            checkpoint_files.new_writer = _failing_on_rank_1(rank, [ConnectionResetError()])
            ref = island.outlast_save(opt, store, new_key, patience_s=60, pause_s=0)
            # denied: no retry, every rank raises (none waits for ever), nothing commits
            checkpoint_files.new_writer = _failing_on_rank_1(rank, [PermissionError("denied")])
            try:
                island.outlast_save(opt, store, new_key, patience_s=60, pause_s=0)
                raise AssertionError("a save with a failing rank returned")
            except CheckpointException as exc:
                assert isinstance(exc.failures[1][0], PermissionError)
            # an outage past the patience: rank 0 gives up at once, every rank raises
            checkpoint_files.new_writer = _failing_on_rank_1(rank, [ConnectionResetError()])
            try:
                island.outlast_save(opt, store, new_key, patience_s=0, pause_s=0)
                raise AssertionError("a save past its patience returned")
            except CheckpointException as exc:
                assert isinstance(exc.failures[1][0], ConnectionResetError)
        finally:
            checkpoint_files.new_writer = writer
        if rank == 0:
            assert len(keys) == 4 and ref["key"] == keys[1]  # the retry wrote a fresh one
            torch.save((model_sd, opt_sd, ref), f"{out}/ckpt.pt")
        torch.distributed.barrier()
        _train(island.model, opt, range(3, 6))
        # new islands (other initial weights) from the checkpoint of step 3: the whole
        # state (as legacy checkpoints hold it) and the shards
        whole, opt2 = _island(seed=1)
        whole.load_whole(opt2, *torch.load(f"{out}/ckpt.pt", weights_only=False)[:2])
        sharded, opt3 = _island(seed=2)
        sharded.load_state(opt3, store, ref)
        finals = []
        for isl, o in ((island, opt), (whole, opt2), (sharded, opt3)):
            if isl is not island:
                _train(isl.model, o, range(3, 6))
            isl.gather(range(len(isl.plan)))
            finals.append(isl.mirror.state_dict() if rank == 0 else None)
        if rank == 0:
            torch.save(finals, f"{out}/final.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_fsdp_island_resumes_from_its_checkpoint_exactly(ranks):
    """Sharded checkpoint (each rank writes its shards of model and AdamW state with
    DCP) and the older whole state, each loaded into a fresh sharded island: three
    more steps give the bits of the uninterrupted run. The shards also load whole
    into one process, bit for bit the state they were saved from."""
    tmp_path = ranks  # where the two ranks ran _resume_rank
    straight, from_whole, from_shards = torch.load(tmp_path / "final.pt", weights_only=False)
    same(from_whole, straight)
    same(from_shards, straight)

    model_sd, opt_sd, ref = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    store = ObjectStore(str(tmp_path / "store"))
    files = sorted(k.rsplit("/", 1)[-1] for k in store.list(ref["key"]))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file per rank
    assert sorted(ref["files"]) == files  # each rank has every rank's sizes and sha256
    assert ref["bytes"] == sum(store.size(f"{ref['key']}/{f}") for f in files)
    from workers.island import Island  # noqa: PLC0415
    from workers.model import build_model  # noqa: PLC0415
    from workers.model_config import ModelConfig  # noqa: PLC0415
    model = build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2,
                                    max_seq_len=16), seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    Island(model, None, 0, 1).load_state(opt, store, ref)  # no process group
    same(get_state_dict(model, opt), (model_sd, opt_sd))

