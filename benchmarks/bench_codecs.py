"""Throughput and error of the outer-gradient codecs on one core.

    .venv/bin/python -m benchmarks.bench_codecs [--n 67108864] [--chunk 4096 --k 64] \
        [--out benchmarks/results/codecs.json]

Targets (storage/codecs.py, storage/sparse.py): at least 1 GB/s of float32 input
through int8 and int4 encode and decode on one core; at least 0.5 GB/s through
topk2/topk4 encode + decode together (``enc+dec``: n values encoded and decoded
into a reused array, one after the other; ``cpu e+d`` the same by the process's CPU
time, which other processes on a shared core do not inflate). Every throughput is GB/s of float32
*input* (4 bytes a value, 1 GB = 1e9 bytes), best of ``--repeats`` runs, next to a
plain ``np.copyto`` of the same array measured in the same process as the
ceiling. Errors are measured on N(0,1) data; for the sparse codecs ``kept RMS`` is
the relative RMS error of the values that travel (the rest is error feedback's).
The table is also written beside the JSON as ``.md``.
"""

from __future__ import annotations

import os

# One core, set before numpy is imported so no BLAS/OpenMP pool starts wide.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import zarr  # noqa: E402

from storage.codecs import CODEC_NAMES, CodecSpec, decode, encode, kept, roundtrip  # noqa: E402


def best_times(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(wall, CPU) seconds of the fastest of ``repeats`` runs. The process is one
    thread on one core, so its CPU time is what the work costs that core even when
    other processes share it (the wall time then also counts their turns)."""
    times = []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    return min(times)


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of ``repeats`` runs: the least disturbed by the rest of the machine."""
    return best_times(fn, repeats)[0]


def errors(x: np.ndarray, y: np.ndarray, step: int = 1 << 23) -> tuple[float, float]:
    """Relative RMS error and max abs error, accumulated in float64 chunk by chunk."""
    se = sx = 0.0
    worst = 0.0
    for i in range(0, x.size, step):
        d = y[i : i + step].astype(np.float64) - x[i : i + step]
        se += float(d @ d)
        sx += float(x[i : i + step].astype(np.float64) @ x[i : i + step])
        worst = max(worst, float(np.abs(d).max()))
    return (se / sx) ** 0.5, worst


def kept_error(x: np.ndarray, payload: bytes, spec: CodecSpec) -> float | None:
    """Relative RMS error of the values a sparse payload carries (None when dense)."""
    if not spec.is_sparse:
        return None
    idx, values = kept(payload, x.size, spec)
    true = x[idx].astype(np.float64)
    return float(np.sqrt(np.sum((values - true) ** 2) / np.sum(true**2)))


def run(n: int, block_size: int, repeats: int, chunk: int = 4096, k: int = 64) -> dict:
    x = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    gb = 4 * n / 1e9
    copy_dst = np.empty_like(x)
    copy_dst.fill(0)  # fault the pages in, as a reused buffer would be
    memcpy = gb / best_seconds(lambda: np.copyto(copy_dst, x), repeats)
    reuse = copy_dst
    rows = {}
    for name in CODEC_NAMES:
        spec = CodecSpec(name, block_size, chunk=chunk, k=k)
        payload = encode(x, spec)
        decoded = decode(payload, n, spec)
        rel_rms, max_abs = errors(x, decoded)
        del decoded
        enc, enc_cpu = best_times(lambda s=spec: encode(x, s), repeats)
        dec_into, dec_cpu = best_times(
            lambda s=spec, p=payload: decode(p, n, s, out=reuse), repeats
        )
        rows[name] = {
            "encode_gbps": gb / enc,
            "decode_gbps": gb / best_seconds(lambda s=spec, p=payload: decode(p, n, s), repeats),
            "decode_into_gbps": gb / dec_into,
            "encode_decode_gbps": gb / (enc + dec_into),
            "encode_decode_cpu_gbps": gb / (enc_cpu + dec_cpu),
            "roundtrip_gbps": gb / best_seconds(lambda s=spec: roundtrip(x, s), repeats),
            "roundtrip_into_gbps": gb
            / best_seconds(lambda s=spec: roundtrip(x, s, out=reuse), repeats),
            "rel_rms_error": rel_rms,
            "max_abs_error": max_abs,
            "kept_rel_rms_error": kept_error(x, payload, spec),
            "payload_bytes": len(payload),
            "size_ratio": len(payload) / (4 * n),
            "bytes_per_value": len(payload) / n,
        }
        del payload
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "cores_used": sorted(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else None,
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
        },
        "python": platform.python_version(),
        "numpy": np.__version__,
        "zarr": zarr.__version__,
        "n": n,
        "block_size": block_size,
        "sparse_chunk": chunk,
        "sparse_k": k,
        "repeats": repeats,
        "unit": "GB/s of float32 input (1e9 bytes), best of repeats",
        "memcpy_gbps": memcpy,
        "codecs": rows,
    }


def table(result: dict) -> str:
    head = (
        f"{'codec':<9} {'encode':>7} {'decode':>7} {'dec-into':>8} {'roundtrip':>9} {'rt-into':>7} "
        f"{'enc+dec':>7} {'cpu e+d':>7} {'rel RMS':>9} {'max |err|':>9} {'kept RMS':>8} {'size':>7} {'B/value':>7}"
    )
    lines = [
        f"n={result['n']} block={result['block_size']} sparse C={result.get('sparse_chunk')} "
        f"k={result.get('sparse_k')} numpy {result['numpy']}, "
        f"GB/s of float32 input, best of {result['repeats']}, one core",
        f"memcpy (np.copyto) {result['memcpy_gbps']:.2f} GB/s",
        head,
        "-" * len(head),
    ]
    for name, r in result["codecs"].items():
        kept_rms = r.get("kept_rel_rms_error")
        kept_col = f"{kept_rms:>8.2e}" if kept_rms is not None else f"{'-':>8}"
        lines.append(
            f"{name:<9} {r['encode_gbps']:>7.2f} {r['decode_gbps']:>7.2f} "
            f"{r['decode_into_gbps']:>8.2f} {r['roundtrip_gbps']:>9.2f} {r['roundtrip_into_gbps']:>7.2f} "
            f"{r['encode_decode_gbps']:>7.2f} {r['encode_decode_cpu_gbps']:>7.2f} {r['rel_rms_error']:>9.2e} {r['max_abs_error']:>9.2e} "
            f"{kept_col} {r['size_ratio']:>7.4f} {r['bytes_per_value']:>7.3f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1 << 26, help="float32 values (default 64Mi)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=4096, help="sparse chunk C (topk2/topk4)")
    parser.add_argument("--k", type=int, default=64, help="values kept per sparse chunk")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/codecs.json"))
    args = parser.parse_args()
    result = run(args.n, args.block_size, args.repeats, args.chunk, args.k)
    text = table(result)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(f"```\n{text}\n```\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
