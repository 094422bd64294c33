"""Throughput and error of the outer-gradient codecs on one core.

    .venv/bin/python -m benchmarks.bench_codecs [--n 67108864] [--out benchmarks/results/codecs.json]

Target (storage/codecs.py): at least 1 GB/s of float32 input through int8 and
int4 encode and decode on one core. Every throughput is GB/s of float32 *input*
(4 bytes a value, 1 GB = 1e9 bytes), best of ``--repeats`` runs, next to a plain
``np.copyto`` of the same array measured in the same process as the ceiling.
Errors are measured on N(0,1) data.
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

from storage.codecs import CODEC_NAMES, CodecSpec, decode, encode, roundtrip  # noqa: E402


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of ``repeats`` runs: the least disturbed by the rest of the machine."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


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


def run(n: int, block_size: int, repeats: int) -> dict:
    x = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    gb = 4 * n / 1e9
    copy_dst = np.empty_like(x)
    copy_dst.fill(0)  # fault the pages in, as a reused buffer would be
    memcpy = gb / best_seconds(lambda: np.copyto(copy_dst, x), repeats)
    reuse = copy_dst
    rows = {}
    for name in CODEC_NAMES:
        spec = CodecSpec(name, block_size)
        payload = encode(x, spec)
        decoded = decode(payload, n, spec)
        rel_rms, max_abs = errors(x, decoded)
        del decoded
        rows[name] = {
            "encode_gbps": gb / best_seconds(lambda s=spec: encode(x, s), repeats),
            "decode_gbps": gb / best_seconds(lambda s=spec, p=payload: decode(p, n, s), repeats),
            "decode_into_gbps": gb
            / best_seconds(lambda s=spec, p=payload: decode(p, n, s, out=reuse), repeats),
            "roundtrip_gbps": gb / best_seconds(lambda s=spec: roundtrip(x, s), repeats),
            "roundtrip_into_gbps": gb
            / best_seconds(lambda s=spec: roundtrip(x, s, out=reuse), repeats),
            "rel_rms_error": rel_rms,
            "max_abs_error": max_abs,
            "payload_bytes": len(payload),
            "size_ratio": len(payload) / (4 * n),
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
        "repeats": repeats,
        "unit": "GB/s of float32 input (1e9 bytes), best of repeats",
        "memcpy_gbps": memcpy,
        "codecs": rows,
    }


def table(result: dict) -> str:
    head = (
        f"{'codec':<9} {'encode':>7} {'decode':>7} {'dec-into':>8} {'roundtrip':>9} {'rt-into':>7} "
        f"{'rel RMS':>9} {'max |err|':>9} {'size':>7}"
    )
    lines = [
        f"n={result['n']} block={result['block_size']} numpy {result['numpy']}, "
        f"GB/s of float32 input, best of {result['repeats']}, one core",
        f"memcpy (np.copyto) {result['memcpy_gbps']:.2f} GB/s",
        head,
        "-" * len(head),
    ]
    for name, r in result["codecs"].items():
        lines.append(
            f"{name:<9} {r['encode_gbps']:>7.2f} {r['decode_gbps']:>7.2f} "
            f"{r['decode_into_gbps']:>8.2f} {r['roundtrip_gbps']:>9.2f} {r['roundtrip_into_gbps']:>7.2f} "
            f"{r['rel_rms_error']:>9.2e} {r['max_abs_error']:>9.2e} {r['size_ratio']:>7.4f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1 << 26, help="float32 values (default 64Mi)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/codecs.json"))
    args = parser.parse_args()
    result = run(args.n, args.block_size, args.repeats)
    print(table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
