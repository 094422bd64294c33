"""The inner step's pieces: the learning-rate schedule, the device, AdamW, the
evaluation and bf16 autocast.

Apart from the training loop (`workers.train`) so that the aggregator job, which
evaluates the canonical model, imports them without the loop, the islands and
torch's FSDP and checkpoint machinery.
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext

import torch

from workers.config import RunConfig
from workers.model import Transformer


def lr_at(step: int, cfg: RunConfig, warm_from: int | None = None) -> float:
    """Learning rate for inner step ``step`` (1-based): linear warmup, cosine decay
    to ``min_lr_ratio * lr`` at the last step. ``warm_from``: a worker that started
    at that step with a new inner optimizer (a joiner) warms up again over
    ``warmup_steps`` from there."""
    if warm_from is not None and cfg.optim.warmup_steps:
        ramp = min(1.0, (step - warm_from) / cfg.optim.warmup_steps)
        return ramp * lr_at(step, cfg)
    o, total = cfg.optim, cfg.train.steps
    if o.warmup_steps and step <= o.warmup_steps:
        return o.lr * step / o.warmup_steps
    span = max(1, total - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / span)
    floor = o.lr * o.min_lr_ratio
    return floor + (o.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def pick_device(cfg: RunConfig) -> torch.device:
    if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device is 'cuda' but no CUDA device is available")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def make_optimizer(model: Transformer, cfg: RunConfig) -> torch.optim.AdamW:
    """AdamW; no weight decay on norms (1-D parameters), as is usual for Llama."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    o = cfg.optim
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr, betas=o.betas, eps=o.eps, foreach=False,
    )


@torch.no_grad()
def evaluate(model: Transformer, batches: list, device: torch.device) -> float:
    """Mean loss over fixed validation batches."""
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        with autocast_for(device):
            _, loss = model(x.to(device), y.to(device))
        total += float(loss)
    model.train(was_training)
    return total / max(1, len(batches))


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA; float32 (no autocast) elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()
