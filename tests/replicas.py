"""Run several replicas and the aggregator in one process, as threads.

Each worker gets its own ObjectStore instance (its own traffic counter) on the same
run URL, exactly as separate processes in separate regions would; ``memory://``
URLs are shared between instances of one process.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch
from torch import nn

from diloco.aggregator import Aggregator
from diloco.config import SyncConfig
from diloco.run import new_run, open_run, plan_for
from diloco.synchronizer import Synchronizer
from storage.exchange import Exchange
from storage.objectstore import ObjectStore

Batch = tuple[torch.Tensor, torch.Tensor]


class Blocks(nn.Module):
    """A small residual MLP with repeated blocks, so it can be fragmented."""

    def __init__(self, width: int = 8, depth: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.out(h)


TARGET = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def data(worker: str, step: int):
    seed = int(hashlib.sha256(f"{worker}/{step}".encode()).hexdigest()[:8], 16)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 4, generator=g)
    shift = 0.5 if worker.endswith("1") else -0.5  # non-i.i.d. workers
    return x, x @ TARGET + shift


@dataclass
class WorkerTrace:
    losses: list[float] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    sync: Synchronizer | None = None
    model: nn.Module | None = None


@dataclass
class Result:
    traces: dict[str, WorkerTrace]
    aggregator: Aggregator


# once the run is stopped (it failed), a merge waits at most this long for its mean
STOP_PATIENCE_S = 5.0


def train_replicas(
    url: str,
    make_model: Callable[[], nn.Module],
    batches: Callable[[str, int], Batch],
    config: SyncConfig,
    *,
    workers: Sequence[str] = ("w0", "w1"),
    total_steps: int,
    inner_lr: float = 0.1,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    storage_options: dict | None = None,
    on_step: Callable[[str, int, Synchronizer], None] | None = None,
    before_step: Callable[[str, int, Synchronizer], None] | None = None,
    wrap_exchange: Callable[[str, Exchange], Exchange] | None = None,
    aggregate: Callable[[threading.Event], Aggregator] | None = None,
    restart_at: dict[str, int] | None = None,
    timeout: float = 120.0,
) -> Result:
    """Train ``workers`` replicas with plain SGD for ``total_steps`` each and run the
    aggregator alongside; returns per-step losses and parameters of each worker.

    ``before_step`` runs after the inner optimizer step and before ``sync.step()``
    (a test can hold a merge there until a mean has arrived); ``on_step`` runs after
    it; ``wrap_exchange`` gives a worker a modified view of the store; ``aggregate``
    replaces the default aggregator thread (it must return the final Aggregator);
    ``restart_at`` restarts a worker's synchroniser from its state_dict after the
    given step, as a resumed worker process would."""
    loss_fn = loss_fn or nn.functional.mse_loss
    base = make_model()
    new_run(ObjectStore(url, storage_options=storage_options), base, config,
            workers=list(workers), total_steps=total_steps)
    stop = threading.Event()
    if aggregate is None:
        aggregator = Aggregator(open_run(ObjectStore(url, storage_options=storage_options)))

        def aggregate(stop: threading.Event) -> Aggregator:
            aggregator.run(stop, timeout)
            return aggregator

    traces = {w: WorkerTrace() for w in workers}

    def work(worker: str) -> None:
        model = make_model()
        ex = open_run(ObjectStore(url, storage_options=storage_options, name=worker))
        if wrap_exchange is not None:
            ex = wrap_exchange(worker, ex)
        sync = Synchronizer(model, ex, worker, plan_for(model, config), stop=stop,
                            stop_patience_s=STOP_PATIENCE_S)
        trace = traces[worker]
        trace.sync, trace.model = sync, model
        opt = torch.optim.SGD(model.parameters(), lr=inner_lr)
        try:
            for step in range(1, total_steps + 1):
                x, y = batches(worker, step)
                opt.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
                trace.losses.append(float(loss.detach()))
                if before_step is not None:
                    before_step(worker, step, sync)
                sync.step(tokens=int(x.shape[0]))
                trace.params.append(
                    {k: v.detach().clone() for k, v in model.named_parameters()}
                )
                if on_step is not None:
                    on_step(worker, step, sync)
                if restart_at and restart_at.get(worker) == step:
                    # the worker process dies and comes back from its checkpoint
                    state = sync.state_dict()
                    live = {k: v.detach().clone() for k, v in model.state_dict().items()}
                    sync.close()
                    ex = open_run(
                        ObjectStore(url, storage_options=storage_options, name=worker))
                    if wrap_exchange is not None:
                        ex = wrap_exchange(worker, ex)
                    sync = Synchronizer(model, ex, worker, plan_for(model, config),
                                        initialise=False, stop=stop,
                                        stop_patience_s=STOP_PATIENCE_S)
                    sync.load_state_dict(state)
                    model.load_state_dict(live)
                    trace.sync = sync
            sync.finish()
        finally:
            sync.close()

    with ThreadPoolExecutor(len(workers) + 1) as pool:
        agg = pool.submit(aggregate, stop)
        futures = [pool.submit(work, w) for w in workers]
        deadline = time.monotonic() + timeout
        try:
            # an aggregator that dies fails the run now: its workers would wait for
            # means that never come (the stop set below makes them give up)
            wait([agg, *futures], timeout=timeout, return_when=FIRST_EXCEPTION)
            if agg.done() and agg.exception() is not None:
                raise RuntimeError("the aggregator thread failed") from agg.exception()
            for f in futures:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            aggregator = agg.result(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            stop.set()
    return Result(traces, aggregator)
