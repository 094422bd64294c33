"""One prepared check of a GPU machine: the worker's speed and the exchange's cost.

    python scripts/gpu_check.py --all --out DIR [--budget-s 420] [--sections ...]
    python scripts/gpu_check.py --all --out DIR --device cpu --quick   # the same, small, no GPU

Made for a lent GPU machine that is bare, reaches no package index and is held for
minutes (docs/gpu.md says how to carry the project there). Each section runs in
turn, writes what it measured to ``DIR/gpu.json`` and ``DIR/gpu.md`` as soon as it
ends (so a run cut short keeps its earlier sections), and a section that fails is
recorded with its error while the next one runs. ``--budget-s`` is the whole check's
time: a section that cannot fit what is left is skipped with the reason, and
``torch.compile`` is tried only while enough time is left.

Sections:

``env``        the card (name, memory, SMs, driver), torch, CUDA and cuDNN versions, the
               card's bf16 peak from its datasheet, a measured bf16 matrix product and
               pinned host<->device copy rates.
``inner``      the inner step of the ``small`` and ``gpu-150m`` recipes in bf16 autocast,
               exactly as the worker runs it (`workers.inner.inner_step`), on host
               batches of the recipe's shape: ms per step, tokens/s, model FLOPs
               utilisation (6N + 12 L d T FLOPs a token, against the datasheet peak and
               the measured matrix product), peak GPU memory; variants: the batch's
               copy (pageable, as before, or pinned), AdamW (for-loop, foreach, fused),
               and ``torch.compile`` of the model.
``codecs``     int8, int4, fp4-e3m0 and topk2 encode and decode of a fragment of the
               150M model (P 6) and of the 1B model (P 11): numpy on the host
               (storage/codecs.py) against torch on the GPU (diloco/device_codecs.py,
               the payload copied to the host included), in GB/s of float32 input, and
               whether the GPU's payload and decoded values equal the host's bit for bit.
``exchange``   a worker's send (its outer gradient) and merge on the training loop,
               per round, with ``sync.outer.device`` cpu and device: a short real run
               of gpu-150m (one worker, the aggregator in a thread, H = 2P), stage by
               stage (`benchmarks.stages`), and the blocked share these give at the
               recipe's H with the measured step.
``streaming``  a real streaming run: two worker processes sharing the GPU, the
               aggregator in this process, a local-directory store, gpu-150m for 200
               steps on the built-in Shakespeare bytes: canonical eval loss, each
               worker's step time, blocked and waited seconds, and the exchange latency.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.report import md_table

log = logging.getLogger("benchmarks.gpu")
SECTIONS = ("env", "inner", "codecs", "exchange", "streaming", "compile")

#: dense bf16 tensor-core peak, TFLOP/s, from the vendors' datasheets (no sparsity)
DATASHEET_BF16_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.5), ("H100", 989.4), ("GH200", 989.4),
    ("H200", 989.4), ("H20", 148.0), ("B200", 2250.0), ("A100", 312.0), ("A10G", 70.0),
    ("L40S", 362.1), ("L4", 121.0),
)


def datasheet_peak(name: str) -> float | None:
    """The card's dense bf16 peak in TFLOP/s by its name, or None if not in the table."""
    for key, tflops in DATASHEET_BF16_TFLOPS:
        if key in name:
            return tflops
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ----------------------------------------------------------------------------- env


def env_section(device: torch.device, quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "numpy": np.__version__,
        "host_cpus": os.cpu_count(), "host": platform.platform(),
    }
    with contextlib.suppress(Exception):
        out["cudnn"] = torch.backends.cudnn.version()
    if device.type != "cuda":
        out["name"] = f"CPU ({platform.processor() or platform.machine()})"
        return out
    props = torch.cuda.get_device_properties(device)
    out.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
               sms=props.multi_processor_count, capability=f"{props.major}.{props.minor}",
               bf16_peak_tflops=datasheet_peak(props.name))
    with contextlib.suppress(Exception):
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        driver, clock, power = [s.strip() for s in q.stdout.strip().splitlines()[0].split(",")]
        out.update(driver=driver, max_sm_clock=clock, power_limit=power)
    out["matmul_bf16_tflops"] = _matmul_tflops(device, 4096 if quick else 8192)
    out["h2d_pinned_gbs"], out["d2h_pinned_gbs"] = _copy_rates(device, 256 * 2**20)
    _free(device)
    return out


def _matmul_tflops(device: torch.device, n: int) -> float:
    """A bf16 n x n x n matrix product's rate on random data: the practical ceiling."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    return round(2 * n**3 / _median_s(lambda: a @ b, device, 10) / 1e12, 1)


def _copy_rates(device: torch.device, nbytes: int) -> tuple[float, float]:
    """Pinned host-to-device and device-to-host copy rates, GB/s."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = nbytes / _median_s(lambda: dev.copy_(host), device, 5) / 1e9
    d2h = nbytes / _median_s(lambda: host.copy_(dev), device, 5) / 1e9
    return round(h2d, 1), round(d2h, 1)


# ----------------------------------------------------------------------------- inner


def flops_per_token(mcfg: Any, seq_len: int) -> float:
    """Training FLOPs a token: 6N for the weights' matrix products (the tied head's
    included, the embedding lookup's not) and 12 L d T for attention (PaLM's count)."""
    n = mcfg.num_parameters()
    if not mcfg.tie_embeddings:
        n -= mcfg.vocab_size * mcfg.d_model  # the input embedding is a lookup
    return 6.0 * n + 12.0 * mcfg.n_layers * mcfg.n_heads * mcfg.head_dim * seq_len


def make_adamw(model: torch.nn.Module, cfg: Any, kind: str) -> torch.optim.Optimizer:
    """The worker's AdamW (`workers.inner.make_optimizer`, ``default``), or the same
    groups and hyper-parameters with another implementation: ``loop``, ``foreach``
    or ``fused``."""
    from workers.inner import make_optimizer  # noqa: PLC0415

    opt = make_optimizer(model, cfg)
    if kind == "default":
        return opt
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]}
              for g in opt.param_groups]
    o = cfg.optim
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps,
                             foreach=kind == "foreach", fused=True if kind == "fused" else None)


def measure_inner(cfg: Any, device: torch.device, *, optimizer: str, pinned: bool,
                  compiled: bool, warmup: int, steps: int) -> dict[str, Any]:
    """Time ``steps`` inner steps after ``warmup`` (the first of them compile, when
    compiled); one wait for the device at the end, so host syncs inside show."""
    from workers.inner import inner_step, to_device  # noqa: PLC0415
    from workers.model import build_model  # noqa: PLC0415

    _free(device)
    mcfg = cfg.model_config_resolved
    model = build_model(mcfg, seed=cfg.train.seed).to(device)
    opt = make_adamw(model, cfg, optimizer)
    b, seq, accum = cfg.data.batch_size, cfg.data.seq_len, cfg.optim.grad_accum
    gen = torch.Generator().manual_seed(0)
    host = [(torch.randint(0, mcfg.vocab_size, (b, seq), generator=gen),
             torch.randint(0, mcfg.vocab_size, (b, seq), generator=gen)) for _ in range(4)]
    turn = itertools.count()

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        x, y = host[next(turn) % len(host)]
        if pinned:
            return to_device(x, device), to_device(y, device)
        return x.to(device), y.to(device)  # pageable: what the loop did before

    net = torch.compile(model) if compiled else model
    t0 = time.perf_counter()
    loss = None
    for _ in range(warmup):
        loss = inner_step(net, opt, next_batch, accum, cfg.optim.grad_clip, device)
    _sync(device)
    warm_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = inner_step(net, opt, next_batch, accum, cfg.optim.grad_clip, device)
    _sync(device)
    step_s = (time.perf_counter() - t0) / steps
    tokens = b * seq * accum
    out = {
        "optimizer": optimizer, "batches": "pinned" if pinned else "pageable",
        "compiled": compiled, "ms_per_step": round(step_s * 1e3, 2),
        "tokens_per_s": round(tokens / step_s), "warmup_s": round(warm_s, 1),
        "loss": round(float(loss), 4),
        "peak_memory_gib": (round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                            if device.type == "cuda" else None),
        "model_flops_per_step": flops_per_token(mcfg, seq) * tokens,
    }
    del model, opt, net
    _free(device)
    return out


def inner_section(device: torch.device, quick: bool, left: Callable[[], float]) -> dict[str, Any]:
    from workers.config import load_config  # noqa: PLC0415

    # (recipe, overrides, label): gpu-1b as one rank of an 8-GPU island (its batch of
    # 128 sequences cut in 8), one micro-batch a step
    recipes = [("tiny", ["data.batch_size=4", "data.seq_len=64"], "tiny")] if quick else [
        ("small", [], "small"), ("gpu-150m", [], "gpu-150m"),
        ("gpu-1b", ["data.batch_size=16", "optim.grad_accum=1"], "gpu-1b, 1 of 8 ranks")]
    # the loop before the GPU run (for-loop AdamW, pageable batches), and now
    variants = [("loop" if device.type == "cuda" else "default", False), ("default", True)]
    rows: list[dict[str, Any]] = []
    for recipe, overrides, label in recipes:
        cfg = load_config(recipe, [f"train.device={device.type}", *overrides])
        steps = 4 if quick else {"small": 30, "gpu-150m": 8}.get(recipe, 3)
        base = {"recipe": label, "params": cfg.model_config_resolved.num_parameters(),
                "batch": f"{cfg.data.batch_size}x{cfg.data.seq_len}x{cfg.optim.grad_accum}"}
        if recipe == "gpu-1b":
            if left() < 150:
                rows.append({**base, "skipped": f"{left():.0f} s left"})
                continue
            rows.append({**base, **measure_inner(cfg, device, optimizer="default", pinned=True,
                                                 compiled=False, warmup=2, steps=steps)})
            continue
        for opt_kind, pinned in variants:
            rows.append({**base, **measure_inner(cfg, device, optimizer=opt_kind, pinned=pinned,
                                                 compiled=False, warmup=3, steps=steps)})
    return {"rows": rows}


def compile_section(device: torch.device, quick: bool, left: Callable[[], float],
                    inner: dict[str, Any] | None) -> dict[str, Any]:
    """``torch.compile`` of the model, with the fastest eager AdamW of ``inner``; last,
    as the compile's own time is the least known. A recipe is tried only while
    ``left()`` leaves room for its compile (about 1-2 minutes at 150M)."""
    from workers.config import load_config  # noqa: PLC0415

    rows: list[dict[str, Any]] = []
    if quick:  # inductor's C++ build of even the tiny model takes minutes on 2 cores
        return {"rows": [{"recipe": "tiny", "compiled": True, "skipped": "--quick"}]}
    for recipe in ("small", "gpu-150m"):
        if left() < (150 if recipe == "gpu-150m" else 75):
            rows.append({"recipe": recipe, "compiled": True, "skipped": f"{left():.0f} s left"})
            continue
        eager = [r for r in (inner or {}).get("rows", []) if r.get("recipe") == recipe
                 and "ms_per_step" in r]
        best = min(eager, key=lambda r: r["ms_per_step"])["optimizer"] if eager else "default"
        cfg = load_config(recipe, [f"train.device={device.type}"])
        base = {"recipe": recipe, "params": cfg.model_config_resolved.num_parameters(),
                "batch": f"{cfg.data.batch_size}x{cfg.data.seq_len}x{cfg.optim.grad_accum}"}
        try:
            rows.append({**base, **measure_inner(
                cfg, device, optimizer=best, pinned=True, compiled=True, warmup=3,
                steps=30 if recipe == "small" else 8)})
        except Exception as exc:  # noqa: BLE001 - recorded, the check goes on
            rows.append({**base, "compiled": True, "error": f"{type(exc).__name__}: {exc}"})
    return {"rows": rows}


# ----------------------------------------------------------------------------- codecs


def fragment_sizes() -> dict[str, int]:
    """The largest fragment of the 150M model at P 6 and of the 1B model at P 11 (the
    recipes' P), cut as `diloco.arithmetic.split_sizes` cuts a model."""
    from diloco.arithmetic import split_sizes  # noqa: PLC0415
    from workers.model_config import PRESETS  # noqa: PLC0415

    return {"150M / 6": max(split_sizes(PRESETS["gpu-150m"].num_parameters(), 6)),
            "1B / 11": max(split_sizes(PRESETS["gpu-1b"].num_parameters(), 11))}


def codec_section(device: torch.device, quick: bool, left: Callable[[], float]) -> dict[str, Any]:
    sizes = {"quick": 300_001} if quick else fragment_sizes()
    rows = []
    for label, n in sizes.items():
        rng = np.random.default_rng(n)
        x = (rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3))
        xd = torch.from_numpy(x).to(device)
        for name in ("int8", "int4", "fp4-e3m0", "topk2"):
            if left() < 30:
                rows.append({"fragment": label, "codec": name, "skipped": f"{left():.0f} s left"})
                continue
            rows.append({"fragment": label, **codec_row(x, xd, name, device)})
        del xd
        _free(device)
    return {"rows": rows}


def codec_row(x: np.ndarray, xd: torch.Tensor, name: str, device: torch.device
              ) -> dict[str, Any]:
    """One codec on the host and on ``device``: rates, and whether the bits agree."""
    from diloco import device_codecs  # noqa: PLC0415
    from storage import codecs  # noqa: PLC0415
    from storage.codecs import CodecSpec  # noqa: PLC0415

    n, spec = x.size, CodecSpec(name)
    host_reps, dev_reps = (1, 3) if n > 50_000_000 else (3, 5)
    cpu = torch.device("cpu")
    payload = codecs.encode(x, spec)
    enc_h = _median_s(lambda: codecs.encode(x, spec), cpu, host_reps)
    dec_h = _median_s(lambda: codecs.decode(payload, n, spec), cpu, host_reps)
    got, decoded = device_codecs.roundtrip(xd, spec)
    same = got == payload and bool(np.array_equal(
        decoded.cpu().numpy().view(np.uint32), codecs.decode(payload, n, spec).view(np.uint32)))
    decoded = None
    device_codecs.encode(xd, spec)  # warm
    enc_d = _median_s(lambda: device_codecs.encode(xd, spec), device, dev_reps)
    dec_d = _median_s(lambda: device_codecs.decode(payload, n, spec, device), device, dev_reps)
    gb = 4 * n / 1e9
    return {
        "values": n, "codec": name, "payload_mb": round(len(payload) / 1e6, 2),
        "host_encode_gbs": round(gb / enc_h, 2), "host_decode_gbs": round(gb / dec_h, 2),
        "device_encode_gbs": round(gb / enc_d, 2), "device_decode_gbs": round(gb / dec_d, 2),
        "host_encode_ms": round(enc_h * 1e3, 1), "device_encode_ms": round(enc_d * 1e3, 1),
        "host_decode_ms": round(dec_h * 1e3, 1), "device_decode_ms": round(dec_d * 1e3, 1),
        "identical": same,
    }


# ----------------------------------------------------------------------------- runs


def prepare_shakespeare(root: Path) -> str:
    from workers.data.prepare import prepare_data  # noqa: PLC0415

    url = str(root / "data")
    if not (root / "data" / "dataset.json").exists():
        prepare_data(["builtin:shakespeare"], url, max_bytes=2_000_000)
    return url


def run_overrides(device: torch.device, data: str, steps: int, workers: list[str]) -> list[str]:
    return [f"train.steps={steps}", f"train.device={device.type}", "train.eval_every=0",
            "train.checkpoint_every=0", f"train.log_every={max(1, steps // 10)}",
            "train.log_model=false", f"data.dataset={data}", "data.split=even",
            "optim.warmup_steps=10", "workers=[" + ",".join(workers) + "]"]


def train_in_threads(url: str, workers: list[str]) -> tuple[list, list, bool, float]:
    """Every worker in a thread, the aggregator in another: (results, loops, done, s)."""
    from diloco.aggregator import Aggregator  # noqa: PLC0415
    from diloco.run import open_run  # noqa: PLC0415
    from workers.loop import WorkerLoop  # noqa: PLC0415

    agg, stop = Aggregator(open_run(url)), threading.Event()
    agg_thread = threading.Thread(target=agg.run, args=(stop, 600), daemon=True)
    agg_thread.start()
    loops = [WorkerLoop.open(url, w) for w in workers]
    results: list = [None] * len(loops)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results[i] = loops[i].run()
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    start = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(loops))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    agg_thread.join(120)
    stop.set()
    for loop in loops:
        loop.close()
    if errors:
        raise errors[0]
    return results, loops, agg.done, seconds


_CLOCK: Any = None


def stage_clock() -> Any:
    """The process-wide stage clock (`benchmarks.stages`), installed once."""
    global _CLOCK
    from benchmarks import stages  # noqa: PLC0415

    if _CLOCK is None:
        _CLOCK = stages.install()
    return _CLOCK


def exchange_section(device: torch.device, quick: bool, left: Callable[[], float],
                     root: Path, inner: dict[str, Any] | None) -> dict[str, Any]:
    from workers.config import load_config  # noqa: PLC0415
    from workers.runs import create_run  # noqa: PLC0415

    recipe = "tiny" if quick else "gpu-150m"
    data = prepare_shakespeare(root)
    clock = stage_clock()
    rows = []
    for outer in ("cpu", "device"):
        if left() < 60:
            rows.append({"outer_device": outer, "skipped": f"{left():.0f} s left"})
            continue
        cfg0 = load_config(recipe, [])
        p = cfg0.sync.schedule.fragments
        steps = 3 * 2 * p
        extra = [f"sync.outer.device={outer}", f"sync.schedule.sync_every={2 * p}", "sync.schedule.overlap=1"]
        if quick:
            extra += ["data.batch_size=4", "data.seq_len=64"]
        cfg = load_config(recipe, run_overrides(device, data, steps, ["gpu-0"]) + extra)
        url = str(root / f"exchange-{outer}")
        shutil.rmtree(url, ignore_errors=True)
        create_run(cfg, url)
        clock.seconds.clear()
        clock.calls.clear()
        results, loops, done, seconds = train_in_threads(url, ["gpu-0"])
        rep = clock.report()

        def per_call(stage: str, rep: dict = rep) -> float | None:
            s = rep.get(stage)
            return round(s["seconds"] / s["calls"] * 1e3, 1) if s and s["calls"] else None

        rows.append({
            "outer_device": outer, "recipe": recipe, "fragments": p, "steps": steps,
            "send_ms": per_call("send"), "merge_ms": per_call("merge"),
            "wait_ms_per_merge": per_call("wait"), "encode_ms": per_call("encode"),
            "rounds": loops[0].sync.stats.rounds_merged, "aggregator_done": done,
            "step_s": round(seconds / steps, 4),
        })
    step = _recipe_step_s(inner, recipe)
    cfg = load_config(recipe, [])
    stride = cfg.sync.schedule.sync_every // cfg.sync.schedule.fragments
    for row in rows:
        if step and row.get("send_ms") is not None:
            b = (row["send_ms"] + row["merge_ms"]) / 1e3
            row["blocked_share_at_recipe_h"] = round(b / (stride * step + b), 4)
            row["recipe_h_over_p"] = stride
            row["inner_step_s"] = step
    return {"rows": rows}


def _recipe_step_s(inner: dict[str, Any] | None, recipe: str) -> float | None:
    """The recipe's inner step as the worker runs it now (pinned batches, its AdamW)."""
    for row in (inner or {}).get("rows", []):
        if (row.get("recipe") == recipe and row.get("optimizer") == "default"
                and row.get("batches") == "pinned" and not row.get("compiled")):
            return row["ms_per_step"] / 1e3
    return None


def streaming_section(device: torch.device, quick: bool, left: Callable[[], float],
                      root: Path, steps: int, inner: dict[str, Any] | None = None
                      ) -> dict[str, Any]:
    """``steps`` (fewer when the inner step measured in ``inner`` says two workers
    sharing the device would not finish them in the time left, but at least two
    rounds of every fragment)."""
    from benchmarks import timed_worker  # noqa: PLC0415
    from benchmarks.contenders import canonical_eval  # noqa: PLC0415
    from diloco.aggregator import Aggregator  # noqa: PLC0415
    from diloco.run import open_run  # noqa: PLC0415
    from workers.config import load_config  # noqa: PLC0415
    from workers.runs import create_run  # noqa: PLC0415

    recipe = "tiny" if quick else "gpu-150m"
    data = prepare_shakespeare(root)
    workers = ["gpu-a", "gpu-b"]
    step = _recipe_step_s(inner, recipe)
    if step and not quick:  # two workers share the device, each at a quarter of the
        fits = int((left() - 75) / (0.6 * step))  # recipe's tokens: about t / 2 a step
        steps = max(96, min(steps, fits // 48 * 48))
    # two workers share one card: a quarter of the recipe's tokens a step each (16 x
    # 1024 x 2), so that both fit an 80 GB card and 200 steps fit the check's minutes
    extra = ["data.batch_size=4", "data.seq_len=64", "sync.schedule.sync_every=8", "sync.schedule.overlap=1"] \
        if quick else ["sync.schedule.sync_every=48", "data.batch_size=16", "optim.grad_accum=2"]
    cfg = load_config(recipe, run_overrides(device, data, steps, workers) + extra)
    url = str(root / "streaming")
    shutil.rmtree(url, ignore_errors=True)
    create_run(cfg, url)
    agg, stop = Aggregator(open_run(url)), threading.Event()
    agg_thread = threading.Thread(target=agg.run, args=(stop, max(60.0, left())), daemon=True)
    agg_thread.start()
    env = {"BENCH_STAGES": "1"}
    clock = stage_clock()  # the aggregator's stages, in this process
    clock.seconds.clear()
    clock.calls.clear()
    logs = [open(root / f"streaming-{w}.log", "w") for w in workers]  # noqa: SIM115
    procs = [timed_worker.launch(url, w, env=env, wait_go=True, log_file=f)
             for w, f in zip(workers, logs, strict=True)]
    try:
        timed_worker.wait_ready(procs, timeout=max(60.0, left()))
        t0 = time.perf_counter()
        timed_worker.go(procs)
        results = timed_worker.collect(procs, timeout=max(60.0, left()))
        wall = time.perf_counter() - t0
    except Exception as exc:  # the workers' own words, which this process never saw
        for f in logs:
            f.flush()
        tails = [f"{w}: ...{(root / f'streaming-{w}.log').read_text()[-1500:]}"
                 for w in workers]
        raise RuntimeError(f"{exc}\n" + "\n".join(tails)) from exc
    finally:
        timed_worker.stop(procs)
        for f in logs:
            f.close()
        agg_thread.join(60)
        stop.set()
    eval_loss = canonical_eval(url, cfg, device=device)
    rows = []
    for r in results:
        t, st = r["timing"], r.get("stages", {})
        rows.append({
            "worker": r["worker"], "steps": r["steps"],
            "step_s": round(t["loop_s"] / max(1, r["steps"]), 4),
            "compute_step_s": round(t["compute_s"] / max(1, r["steps"]), 4),
            "blocked_s": round(t["blocked_s"], 2), "waited_s": round(r["wait_seconds"], 2),
            "utilisation": round(t["utilisation"], 4), "final_loss": r["final_loss"],
            "send_ms": _stage_ms(st, "send"), "merge_ms": _stage_ms(st, "merge"),
            "encode_ms": _stage_ms(st, "encode"),
            "peak_rss_mib": round(r["memory"]["peak_rss"] / 2**20),
        })
    rounds = max(1, len(agg.stats.rounds))
    aggregator = {k: round(v["seconds"] / rounds * 1e3, 1) for k, v in clock.report().items()}
    return {"recipe": recipe, "steps": steps, "workers": len(workers),
            "sync_every": cfg.sync.schedule.sync_every, "fragments": cfg.sync.schedule.fragments,
            "mode": cfg.sync.schedule.mode, "codec_up": cfg.sync.codec.up, "codec_down": cfg.sync.codec.down,
            "canonical_eval_loss": round(eval_loss, 4), "wall_s": round(wall, 1),
            "aggregator_done": agg.done, "aggregator_rounds": len(agg.stats.rounds),
            "aggregator_ms_per_round": aggregator, "rows": rows}


def _stage_ms(stages: dict[str, Any], name: str) -> float | None:
    s = stages.get(name)
    return round(s["seconds"] / s["calls"] * 1e3, 1) if s and s["calls"] else None


# ----------------------------------------------------------------------------- report


def markdown(report: dict[str, Any]) -> str:
    env = report.get("env", {})
    lines = [f"# GPU check: {env.get('name', '?')}", "",
             f"{report.get('date', '')}; `{report.get('command', '')}`; "
             f"{report.get('wall_s', 0):.0f} s.", "",
             md_table(["", ""], [[k, env[k]] for k in (
                 "name", "memory_gib", "sms", "capability", "driver", "torch", "cuda", "cudnn",
                 "python", "host_cpus", "bf16_peak_tflops", "matmul_bf16_tflops",
                 "h2d_pinned_gbs", "d2h_pinned_gbs") if k in env])]
    peak = env.get("bf16_peak_tflops")
    mm = env.get("matmul_bf16_tflops")
    inner = report.get("inner", {}).get("rows", []) + report.get("compile", {}).get("rows", [])
    if inner:
        rows = []
        for r in inner:
            if "ms_per_step" not in r:
                rows.append([r["recipe"], r.get("batch", ""),
                             "compiled" if r.get("compiled") else "", "",
                             r.get("skipped") or r.get("error"), "", "", "", ""])
                continue
            rate = r["model_flops_per_step"] / (r["ms_per_step"] / 1e3) / 1e12
            rows.append([r["recipe"], r["batch"],
                         f"{r['optimizer']}, {r['batches']}" + (", compiled" if r["compiled"] else ""),
                         r["ms_per_step"], f"{r['tokens_per_s']:,}",
                         f"{rate / peak:.1%}" if peak else "", f"{rate / mm:.1%}" if mm else "",
                         r["peak_memory_gib"], r["warmup_s"]])
        lines += ["", "## Inner step (bf16 autocast)", "",
                  md_table(["recipe", "batch x seq x accum", "variant", "ms/step", "tokens/s",
                            "MFU (datasheet)", "of measured matmul", "peak GiB",
                            "warm-up s"], rows)]
    codecs = report.get("codecs", {}).get("rows", [])
    if codecs:
        lines += ["", "## Codecs (GB/s of float32 input; GPU figures include the payload's "
                  "copy to or from the host)", "",
                  md_table(["fragment", "codec", "payload MB", "host enc", "GPU enc", "host dec",
                            "GPU dec", "same bits"],
                           [[r["fragment"], r["codec"], r.get("payload_mb"),
                             r.get("host_encode_gbs"), r.get("device_encode_gbs"),
                             r.get("host_decode_gbs"), r.get("device_decode_gbs"),
                             r.get("identical", r.get("skipped"))] for r in codecs])]
    ex = report.get("exchange", {}).get("rows", [])
    if ex:
        lines += ["", "## Send and merge on the training loop (ms per round)", "",
                  md_table(["outer_device", "send", "merge", "wait per merge", "encode (thread)",
                            "blocked share at the recipe's H"],
                           [[r["outer_device"], r.get("send_ms"), r.get("merge_ms"),
                             r.get("wait_ms_per_merge"), r.get("encode_ms"),
                             f"{r['blocked_share_at_recipe_h']:.2%}"
                             if r.get("blocked_share_at_recipe_h") is not None
                             else r.get("skipped", "")] for r in ex])]
    st = report.get("streaming", {})
    if st.get("rows"):
        lines += ["", f"## Streaming run: {st['recipe']}, {st['workers']} worker processes on "
                  f"one GPU, {st['steps']} steps, H {st['sync_every']}, P {st['fragments']}, "
                  f"{st['mode']}, {st['codec_up']} up / {st['codec_down']} down", "",
                  f"Canonical eval loss **{st['canonical_eval_loss']}**; wall {st['wall_s']} s; "
                  f"aggregator rounds {st['aggregator_rounds']} (done: {st['aggregator_done']}).",
                  "", md_table(["worker", "s/step", "compute s/step", "blocked s", "waited s",
                                "utilisation", "send ms", "merge ms", "final loss"],
                               [[r["worker"], r["step_s"], r["compute_step_s"], r["blocked_s"],
                                 r["waited_s"], r["utilisation"], r["send_ms"], r["merge_ms"],
                                 round(r["final_loss"], 4)] for r in st["rows"]])]
    errors = {k: v["error"] for k, v in report.items() if isinstance(v, dict) and "error" in v}
    skipped = {k: v["skipped"] for k, v in report.items() if isinstance(v, dict) and "skipped" in v}
    for k, v in {**errors, **skipped}.items():
        lines += ["", f"**{k}**: {v.splitlines()[0] if isinstance(v, str) else v}"]
    return "\n".join(lines) + "\n"


def arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the folder for gpu.json and gpu.md")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a CPU rehearsal)")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--streaming-steps", type=int, default=200)
    ap.add_argument("--work", help="scratch folder for stores and data; default: a temporary one")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"gpu_check: --sections: unknown {', '.join(unknown)}; allowed: "
              f"{', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 1
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in ("workers", "diloco", "storage"):
        logging.getLogger(name).setLevel(logging.WARNING)
    start = time.perf_counter()

    def left() -> float:
        return args.budget_s - (time.perf_counter() - start)

    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python scripts/gpu_check.py --all " + " ".join(argv or sys.argv[2:]),
    }
    #: the least time each section needs to be worth starting (full sizes)
    need = {"env": 10, "inner": 60, "codecs": 40, "exchange": 60, "streaming": 90,
            "compile": 75}
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    failed = False
    try:
        for section in sections:
            if not args.quick and left() < need[section]:
                report[section] = {"skipped": f"{left():.0f} s of the budget left"}
                continue
            t0 = time.perf_counter()
            print(f"gpu_check: {section} ({left():.0f} s left)", flush=True)
            try:
                if section == "env":
                    got = env_section(device, args.quick)
                elif section == "inner":
                    got = inner_section(device, args.quick, left)
                elif section == "codecs":
                    got = codec_section(device, args.quick, left)
                elif section == "exchange":
                    got = exchange_section(device, args.quick, left, work, report.get("inner"))
                elif section == "streaming":
                    got = streaming_section(device, args.quick, left, work,
                                            16 if args.quick else args.streaming_steps,
                                            report.get("inner"))
                else:
                    got = compile_section(device, args.quick, left, report.get("inner"))
            except Exception as exc:  # noqa: BLE001 - recorded; the next section runs
                failed = True
                got = {"error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()}
                print(got["traceback"], file=sys.stderr, flush=True)
            got["seconds"] = round(time.perf_counter() - t0, 1)
            _free(device)  # a later section's processes need the card's memory
            if device.type == "cuda":
                got["reserved_after_gib"] = round(torch.cuda.memory_reserved(device) / 2**30, 2)
            report[section] = got
            report["wall_s"] = time.perf_counter() - start
            (out / "gpu.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
            (out / "gpu.md").write_text(markdown(report))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    report["wall_s"] = time.perf_counter() - start
    (out / "gpu.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    text = markdown(report)
    (out / "gpu.md").write_text(text)
    print(text)
    return 1 if failed else 0
