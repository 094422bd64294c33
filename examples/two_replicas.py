"""Two replicas and the aggregator in one process, exchanging through a local
directory: the smallest complete Streaming DiLoCo run.

    .venv/bin/python examples/two_replicas.py [--store runs/example] [--steps 300]

Each replica trains a small residual MLP on its own shifted slice of a regression
task (non-i.i.d. workers), sends int4 outer gradients for two staggered fragments,
and merges the aggregator's int8 means. At the end it prints the loss of the
canonical model against a replica that trained alone, and the bytes exchanged.
"""

from __future__ import annotations

import argparse
import threading
import time
from datetime import datetime
from pathlib import Path

import torch
from torch import nn

from diloco import (
    Aggregator,
    SyncConfig,
    Synchronizer,
    load_canonical,
    new_run,
    open_run,
    plan_for,
)
from storage.objectstore import ObjectStore

WORKERS = ("region-a", "region-b")


class Net(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for layer in self.layers:
            h = h + torch.relu(layer(h))
        return self.out(h)


def teacher(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x[:, :8].sum(1, keepdim=True)) + 0.5 * x[:, 8:].pow(2).mean(1, keepdim=True)


def batch(worker: int, step: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + worker)
    x = torch.randn(n, 16, generator=g) + (0.5 if worker else -0.5)  # each region its own slice
    return x, teacher(x)


def held_out() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2048, 16, generator=g)
    return x, teacher(x)


def evaluate(model: nn.Module) -> float:
    x, y = held_out()
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=None, help="run directory or URL (default runs/example-<time>)")
    ap.add_argument("--steps", type=int, default=300, help="inner steps per replica")
    args = ap.parse_args()
    url = args.store or str(Path("runs") / f"example-{datetime.now():%Y%m%d-%H%M%S}")
    torch.set_num_threads(1)

    cfg = SyncConfig(
        schedule={"mode": "streaming", "sync_every": 20, "fragments": 2, "overlap": 2,
                  "alpha": 0.5},
        codec={"up": "int4", "down": "int8"},
        outer={"lr": 0.7, "momentum": 0.9},
    )
    new_run(url, Net(), cfg, workers=list(WORKERS), total_steps=args.steps)
    s = cfg.schedule
    print(f"run created at {url}: {s.mode}, H={s.sync_every}, P={s.fragments}, "
          f"tau={s.overlap}, up={cfg.codec.up}, down={cfg.codec.down}")

    aggregator = Aggregator(open_run(url))
    stop = threading.Event()
    agg_thread = threading.Thread(target=aggregator.run, args=(stop,), daemon=True)
    agg_thread.start()
    syncs: dict[str, Synchronizer] = {}

    def replica(i: int, name: str) -> None:
        model = Net()
        sync = Synchronizer(model, open_run(ObjectStore(url, name=name)), name,
                            plan_for(model, cfg))
        syncs[name] = sync
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        for step in range(1, args.steps + 1):
            x, y = batch(i, step)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sync.step(tokens=x.shape[0])
            if step % 50 == 0:
                print(f"  {name:9s} step {step:4d}  loss {loss.item():.4f}  "
                      f"waited {sync.stats.wait_seconds:.2f}s")
        sync.finish()

    start = time.perf_counter()
    threads = [threading.Thread(target=replica, args=(i, n)) for i, n in enumerate(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    agg_thread.join(timeout=60)
    stop.set()
    wall = time.perf_counter() - start

    canonical = Net()
    load_canonical(open_run(url), plan_for(canonical, cfg), canonical)
    alone = Net()
    opt = torch.optim.AdamW(alone.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(1, args.steps + 1):
        x, y = batch(0, step)
        opt.zero_grad()
        nn.functional.mse_loss(alone(x), y).backward()
        opt.step()

    print(f"\nfinished in {wall:.1f}s; {len(aggregator.stats.rounds)} fragment rounds applied")
    print(f"held-out MSE: initial {evaluate(Net()):.4f}, canonical model {evaluate(canonical):.4f}, "
          f"one region alone {evaluate(alone):.4f}")
    for name, sync in syncs.items():
        t = sync.exchange.store.traffic
        print(f"  {name}: {t.bytes_up / 1e3:.1f} kB up, {t.bytes_down / 1e3:.1f} kB down, "
              f"waited {sync.stats.wait_seconds:.2f}s")
    print(f"store: {url}")


if __name__ == "__main__":
    main()
