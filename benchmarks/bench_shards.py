"""The aggregator's reduce throughput at K shards, in encoded bytes per second.

    .venv/bin/python -m benchmarks.bench_shards [--shards 1,2] [--log2n 24] [--workers 4] \\
        [--codec int4] [--rounds 2] [--root /tmp/dir] [--out benchmarks/results/shards.json]

A run on local disk with one fragment of 2^log2n values, ``--workers`` (M)
contributions per round committed up front (seeded Gaussians, encoded with
``--codec`` both ways, cut into a multiple of K chunks as the workers of a K-shard
run cut them). Then the aggregator runs as K processes (`diloco.shards`, or the
one-process `diloco.aggregator.Aggregator` at K = 1), each timed from the start of
its ``run`` to its end (loading the initial parameters is before, not timed, and
the K clocks start together once every shard has loaded), in
wall and in CPU seconds (the machine may be shared: CPU seconds of the busiest shard
are what K idle cores would take), and it
reads and verifies its chunks of every contribution, decides (shard 0, from the
others' checks) or follows the decision, reduces, encodes and commits its part of
the mean, steps and checkpoints its part of the canonical state. Throughput is the
encoded bytes of the contributions over the slowest shard's wall seconds, and
over the busiest shard's CPU seconds.

`reduce_throughput` is the function ``diloco bench scale`` can call.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from diloco.aggregator import Aggregator
from diloco.config import SyncConfig
from diloco.run import new_run, open_run
from diloco.shards import ShardAggregator
from storage.objectstore import ObjectStore


class _Flat(nn.Module):
    """One parameter of n values: one fragment of exactly that size."""

    def __init__(self, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))


def make_run(root: str, shards: int, n: int, workers: int, codec: str, rounds: int) -> int:
    """Create the run and commit every contribution; returns their encoded bytes."""
    cfg = SyncConfig(
        schedule={"mode": "diloco", "sync_every": 1, "fragments": 1},
        codec={"up": codec, "down": codec},
    )
    names = [f"w{i}" for i in range(workers)]
    new_run(ObjectStore(root), _Flat(n), cfg, workers=names, total_steps=rounds,
            user_config={"aggregator": {"shards": shards}})
    ex = open_run(ObjectStore(root))
    total = 0
    for r in range(ex.manifest.rounds[0]):
        for i, w in enumerate(names):
            x = np.random.default_rng(100 * r + i).standard_normal(n, dtype=np.float32)
            commit = ex.publish_delta(0, r, w, x * np.float32(1e-3), tokens=100).commit
            total += sum(o["size"] for o in commit["objects"].values())
    return total


def _shard(root: str, shard: int, shards: int, poll_s: float, out: mp.Queue,
           ready: threading.Barrier) -> None:
    torch.set_num_threads(1)
    ex = open_run(ObjectStore(root))
    agg = (Aggregator(ex) if shards == 1 else ShardAggregator(ex, shard=shard))
    # every shard starts its clock together: one that is ready first would otherwise
    # time the others' interpreter start and loading as its wait for their checks
    ready.wait(timeout=600)
    start, cpu = time.perf_counter(), time.process_time()
    agg.run(timeout=600.0, poll_interval=poll_s)
    out.put((shard, (time.perf_counter() - start, time.process_time() - cpu)))


def reduce_throughput(shards: int, *, log2n: int = 24, workers: int = 4, codec: str = "int4",
                      rounds: int = 2, root: str | None = None,
                      poll_s: float = 0.005) -> dict[str, Any]:
    """One measurement: K = ``shards`` processes reduce ``rounds`` rounds of M =
    ``workers`` contributions of 2^log2n values; encoded bytes per second."""
    base = Path(root or tempfile.mkdtemp(prefix="bench-shards-"))
    where = base / f"k{shards}"
    shutil.rmtree(where, ignore_errors=True)
    try:
        encoded = make_run(str(where), shards, 1 << log2n, workers, codec, rounds)
        ctx = mp.get_context("spawn")
        out, ready = ctx.Queue(), ctx.Barrier(shards)
        procs = [ctx.Process(target=_shard, args=(str(where), s, shards, poll_s, out, ready))
                 for s in range(shards)]
        for p in procs:
            p.start()
        got = dict(out.get(timeout=900) for _ in procs)
        seconds = {s: v[0] for s, v in got.items()}
        for p in procs:
            p.join()
    finally:
        shutil.rmtree(where, ignore_errors=True)
    slowest = max(seconds.values())
    return {"shards": shards, "values": 1 << log2n, "workers": workers, "codec": codec,
            "rounds": rounds, "encoded_bytes": encoded,
            "seconds_per_shard": [round(seconds[s], 3) for s in sorted(seconds)],
            "cpu_seconds_per_shard": [round(got[s][1], 3) for s in sorted(got)],
            "bytes_per_s": encoded / slowest,
            "bytes_per_cpu_s": encoded / max(v[1] for v in got.values())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_shards", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", default="1,2", help="K values, comma-separated")
    p.add_argument("--log2n", type=int, default=24)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--codec", default="int4")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--root", default=None, help="a local directory for the runs (default: temp)")
    p.add_argument("--poll-s", type=float, default=0.005, help="first poll delay of each shard")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    rows = [reduce_throughput(int(k), log2n=args.log2n, workers=args.workers,
                              codec=args.codec, rounds=args.rounds, root=args.root,
                              poll_s=args.poll_s)
            for k in args.shards.split(",")]
    base = rows[0]["bytes_per_s"]
    for row in rows:
        row["speedup"] = row["bytes_per_s"] / base
        print(f"K = {row['shards']}: {row['encoded_bytes'] / 2**20:.1f} MiB encoded in "
              f"{max(row['seconds_per_shard']):.2f} s (shards {row['seconds_per_shard']}): "
              f"{row['bytes_per_s'] / 2**20:.1f} MiB/s, {row['speedup']:.2f}x K = 1; "
              f"CPU s per shard {row['cpu_seconds_per_shard']}: "
              f"{row['bytes_per_cpu_s'] / 2**20:.1f} MiB per CPU s of the busiest shard, "
              f"{row['bytes_per_cpu_s'] / rows[0]['bytes_per_cpu_s']:.2f}x K = 1")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
