"""A single-process worker checkpoint's save and load time and bytes, per model size.

    .venv/bin/python -m benchmarks.bench_checkpoint [--presets tiny,small] [--repeats 3] \\
        [--root /tmp/dir]

For each preset: the model after one AdamW step, plus what a worker keeps beside it
(outer parameters and momentum, one float32 copy of the model each, and a float32
residual as a numpy array; RNG state, data position, counters), saved with
`workers.checkpoint.save` through a one-process `Island` into a fresh local store,
then restored into a fresh model and optimizer with `workers.checkpoint.restore`
(which checks every file's sha256 before reading it). Prints one JSON line per preset:
parameters, bytes stored, and each repeat's save and load seconds (wall).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from typing import Any

import torch

from storage.objectstore import ObjectStore
from workers import checkpoint
from workers.island import Island
from workers.model import build_model
from workers.model_config import PRESETS


def _worker_state(preset: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    cfg = PRESETS[preset]
    model = build_model(cfg, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(seed))
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rest = {"data": {"position": 123}, "rng": torch.get_rng_state(), "tokens": 4096,
            "sync": {"outer": [{"params": flat.clone(), "momentum": flat.clone()}],
                     "residual": [flat.numpy().copy()]}}
    return model, opt, rest


def measure(preset: str, repeats: int, root: str | None = None) -> dict[str, Any]:
    """Save and restore ``repeats`` times; the figures of one preset."""
    model, opt, rest = _worker_state(preset, seed=0)
    fresh, fresh_opt, _ = _worker_state(preset, seed=1)
    saves, loads, stored = [], [], 0
    for _ in range(repeats):
        where = tempfile.mkdtemp(dir=root)
        try:
            store = ObjectStore(where)
            began = time.perf_counter()
            checkpoint.save(store, "w", 10, Island(model, None, 0, 1), opt, rest)
            saves.append(time.perf_counter() - began)
            stored = sum(store.sizes("").values())
            began = time.perf_counter()
            saved = checkpoint.latest(store, "w")
            checkpoint.restore(store, saved, Island(fresh, None, 0, 1), fresh_opt)
            loads.append(time.perf_counter() - began)
        finally:
            shutil.rmtree(where)
    return {"preset": preset, "params": sum(p.numel() for p in model.parameters()),
            "bytes": stored, "save_s": [round(s, 3) for s in saves],
            "load_s": [round(s, 3) for s in loads]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--root", default=None, help="where the stores go (a temporary dir)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for preset in args.presets.split(","):
        print(json.dumps(measure(preset, args.repeats, args.root)), flush=True)


if __name__ == "__main__":
    main()
