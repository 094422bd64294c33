"""The inner step and its pieces: the learning-rate schedule, the device, AdamW,
the batch's way to the device, the evaluation and bf16 autocast.

Apart from the training loop (`workers.loop`) so that the aggregator job, which
evaluates the canonical model, imports them without the loop, the islands and
torch's FSDP and checkpoint machinery.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
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
    """AdamW; no weight decay on norms (1-D parameters), as is usual for Llama.

    On the CPU the for-loop implementation, whose bits the numerics tests hold against
    an independent reference. On a GPU (plain tensors, not a sharded island's) the
    fused one: a few kernels for every parameter at once instead of about ten a
    parameter, which matters where kernel launches bound the step (docs/gpu.md)."""
    params = list(model.parameters())
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    o = cfg.optim
    fused = bool(params) and all(p.device.type == "cuda" and type(p.data) is torch.Tensor
                                 for p in params)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr, betas=o.betas, eps=o.eps,
        **({"fused": True} if fused else {"foreach": False}),
    )


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on the training device. To a GPU through pinned memory without
    waiting: a copy from pageable memory makes the host wait for every kernel queued
    before it, so the host could never run ahead of the GPU by more than a step."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def inner_step(
    model: Transformer,
    opt: torch.optim.Optimizer,
    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    accum: int,
    grad_clip: float,
    device: torch.device,
    between: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One inner optimizer step over ``accum`` micro-batches; returns the mean loss as
    a float64 tensor on the device (never read back here: a read would make the host
    wait for the GPU every step). ``between(loss)``: after the backward passes and
    before the clip (an island averages its gradients there). The gradients are freed
    after the step, so they are not held beside the sends and merges that follow
    (1x the model's size)."""
    opt.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for _ in range(accum):
        x, y = next_batch()
        with autocast_for(device):
            _, loss = model(x, y)
        (loss / accum).backward()
        loss_sum += loss.detach().double() / accum
    if between is not None:
        loss_sum = between(loss_sum)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss_sum


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
