"""Latency of one fragment round through the store: two workers, one aggregator.

    .venv/bin/python -m benchmarks.bench_exchange [--backends file,s3] [--mib 32] \\
        [--codec int4] [--repeats 5] [--out benchmarks/results/exchange.json]

One fragment of ``--mib`` MiB of float32 (32 MiB = 8Mi values). Each repeat is one
round of the protocol of storage/exchange.py, run by three threads of this process,
each party with its own ObjectStore and so its own TrafficCounter:

- workers w0 and w1, released together by a barrier, each encode their outer
  gradient (``prepare_delta``) and upload and commit it (``publish_prepared``);
- the aggregator polls ``committed_workers`` every ``--poll-ms`` until both are
  listed, fetches and verifies both (``fetch_delta``), takes the token-weighted
  float32 mean and publishes it (``publish_mean``: encode, upload, commit);
- w0, once its own delta is committed, polls ``fetch_mean`` every ``--poll-ms``
  until the mean is visible and fetched.

Stages (seconds, perf_counter in one process):

    encode            prepare_delta, the slower of the two workers
    upload+commit     publish_prepared, the slower of the two workers
    discover+fetch    from the later worker's commit returning to the aggregator
                      holding both verified deltas (includes up to one poll interval)
      of which fetch  the two fetch_delta calls alone
    reduce            the weighted mean of the two decoded deltas
    mean publish      publish_mean (encode with the down codec, upload, commit)
    mean visible      from publish_mean returning to w0 holding the decoded mean
                      (includes up to one poll interval, the download and decode)
    end to end        from the workers' release to w0 holding the mean

Reported as median and max over ``--repeats`` rounds, after one warm-up round that
is not counted (imports, connection pools, page faults). Bytes are object bodies
from each party's TrafficCounter (storage/traffic.py), per round.

For ``s3`` the benchmark starts moto's S3 server on loopback (tests/s3server.py)
and stops it at the end. Everything shares this machine: the "network" is loopback
and all three parties share its cores and the GIL, so the numbers are the protocol's
and the codecs' cost, not a WAN's; docs/algorithms.md section 8 turns bytes into time
for a real link.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from storage import layout
from storage.codecs import CODEC_NAMES, CodecSpec, encoded_nbytes
from storage.exchange import Exchange
from storage.objectstore import ObjectStore
from storage.spec import CodecEntry, FragmentEntry, ParamEntry, RunManifest, write_manifest

WORKERS = ("w0", "w1")
TOKENS = {"w0": 3000, "w1": 1000}  # unequal on purpose: the mean is weighted 3:1
BLOCK_SIZE = 128
ROUND_TIMEOUT = 300.0  # seconds; a round that takes longer is a failure, not a result
STAGES = (
    ("encode", "worker encode (slower of 2)"),
    ("upload_commit", "worker upload+commit (slower of 2)"),
    ("discover_fetch", "aggregator discover+fetch"),
    ("fetch", "  of which fetch of 2 deltas"),
    ("reduce", "reduce (weighted mean)"),
    ("mean_publish", "mean publish"),
    ("mean_visible", "mean visible to worker"),
    ("end_to_end", "end to end"),
)


@dataclass
class Backend:
    name: str
    url: str
    storage_options: dict[str, Any]


@contextlib.contextmanager
def open_backend(name: str) -> Iterator[Backend]:
    """A fresh, empty store root on ``name`` (file or s3), removed afterwards."""
    if name == "file":
        root = tempfile.mkdtemp(prefix="bench-exchange-")
        try:
            yield Backend(name, Path(root).as_uri(), {})
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    if name != "s3":
        raise SystemExit(f"--backends: unknown backend {name!r}; allowed: file, s3")
    from tests.s3server import MotoS3Server

    with MotoS3Server() as server:
        options = server.options()
        bucket = server.new_bucket("bench-exchange")
        yield Backend(name, f"s3://{bucket}/{uuid.uuid4().hex[:12]}", options)


def manifest_for(n: int, codec_up: str, codec_down: str) -> RunManifest:
    return RunManifest(
        run_id="bench-exchange",
        workers=list(WORKERS),
        total_steps=0,
        rounds=[1],
        codec_up=CodecEntry(name=codec_up, block_size=BLOCK_SIZE),
        codec_down=CodecEntry(name=codec_down, block_size=BLOCK_SIZE),
        fragments=[FragmentEntry(index=0, numel=n, params=[ParamEntry(name="flat", shape=[n])])],
    )


def wait(poll: float, deadline: float, what: str) -> None:
    if time.monotonic() > deadline or failed.is_set():
        raise TimeoutError(f"gave up waiting for {what}")
    time.sleep(poll)


failed = threading.Event()  # set when a party fails, so the others stop polling


def one_round(
    parties: dict[str, Exchange], r: int, x: dict[str, np.ndarray], poll: float
) -> dict[str, Any]:
    """Run round ``r`` once; returns the stage times and each party's traffic."""
    for ex in parties.values():
        ex.store.traffic.reset()
    barrier = threading.Barrier(3)
    t: dict[str, float] = {}
    errors: list[BaseException] = []
    deadline = time.monotonic() + ROUND_TIMEOUT

    def worker(name: str) -> None:
        ex = parties[name]
        barrier.wait(timeout=60)
        t[f"{name}.start"] = time.perf_counter()
        prepared = ex.prepare_delta(0, r, name, x[name])
        t[f"{name}.encoded"] = time.perf_counter()
        ex.publish_prepared(prepared, tokens=TOKENS[name])
        t[f"{name}.committed"] = time.perf_counter()
        if name == "w0":
            while ex.fetch_mean(0, r) is None:
                wait(poll, deadline, "the mean")
            t["mean_seen"] = time.perf_counter()

    def aggregator() -> None:
        agg = parties["agg"]
        barrier.wait(timeout=60)
        while agg.committed_workers(0, r) != list(WORKERS):
            wait(poll, deadline, "both deltas")
        t["discovered"] = time.perf_counter()
        values = {w: agg.fetch_delta(0, r, w)[0] for w in WORKERS}
        t["fetched"] = time.perf_counter()
        total = sum(TOKENS.values())
        mean = np.zeros_like(values[WORKERS[0]])
        for w in WORKERS:
            mean += np.float32(TOKENS[w] / total) * values[w]
        t["reduced"] = time.perf_counter()
        weights = {w: TOKENS[w] / total for w in WORKERS}
        agg.publish_mean(0, r, "agg", mean, weights=weights)
        t["published"] = time.perf_counter()

    def guarded(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)
            failed.set()
            barrier.abort()

    threads = [threading.Thread(target=guarded, args=(worker, w)) for w in WORKERS]
    threads.append(threading.Thread(target=guarded, args=(aggregator,)))
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]

    last_commit = max(t[f"{w}.committed"] for w in WORKERS)
    stages = {
        "encode": max(t[f"{w}.encoded"] - t[f"{w}.start"] for w in WORKERS),
        "upload_commit": max(t[f"{w}.committed"] - t[f"{w}.encoded"] for w in WORKERS),
        "discover_fetch": t["fetched"] - last_commit,
        "fetch": t["fetched"] - t["discovered"],
        "reduce": t["reduced"] - t["fetched"],
        "mean_publish": t["published"] - t["reduced"],
        "mean_visible": t["mean_seen"] - t["published"],
        "end_to_end": t["mean_seen"] - min(t[f"{w}.start"] for w in WORKERS),
    }
    traffic = {
        name: {
            k: ex.store.traffic.snapshot()[k] for k in ("bytes_up", "bytes_down", "requests")
        }
        for name, ex in parties.items()
    }
    return {"round": r, "seconds": stages, "traffic": traffic}


def bench(backend: Backend, n: int, codec_up: str, codec_down: str, repeats: int,
          poll: float) -> dict[str, Any]:
    admin = ObjectStore(backend.url, storage_options=backend.storage_options, name="admin")
    run_name = f"run-{codec_up}-{uuid.uuid4().hex[:6]}"
    run = admin.child(run_name)
    manifest = manifest_for(n, codec_up, codec_down)
    write_manifest(run, manifest)
    parties = {}
    for name in (*WORKERS, "agg"):
        store = ObjectStore(backend.url, storage_options=backend.storage_options, name=name)
        parties[name] = Exchange(store.child(run_name), manifest)
    rng = np.random.default_rng(0)
    x = {w: rng.standard_normal(n, dtype=np.float32) for w in WORKERS}
    rounds = []
    for r in range(repeats + 1):  # round 0 is the warm-up
        result = one_round(parties, r, x, poll)
        if r > 0:
            rounds.append(result)
        run.delete_prefix(layout.round_prefix(0, r))  # keep the server's memory flat
    summary = {
        key: {
            "median_s": statistics.median(rr["seconds"][key] for rr in rounds),
            "max_s": max(rr["seconds"][key] for rr in rounds),
        }
        for key, _ in STAGES
    }
    traffic = {
        party: {
            k: int(statistics.median(rr["traffic"][party][k] for rr in rounds))
            for k in ("bytes_up", "bytes_down", "requests")
        }
        for party in parties
    }
    return {
        "backend": backend.name,
        "codec_up": codec_up,
        "codec_down": codec_down,
        "block_size": BLOCK_SIZE,
        "n": n,
        "float32_bytes": 4 * n,
        "delta_payload_bytes": encoded_nbytes(n, CodecSpec(codec_up, BLOCK_SIZE)),
        "mean_payload_bytes": encoded_nbytes(n, CodecSpec(codec_down, BLOCK_SIZE)),
        "repeats": repeats,
        "poll_s": poll,
        "stages": summary,
        "traffic_median_per_round": traffic,
        "rounds": rounds,
    }


def table(result: dict[str, Any]) -> str:
    mib = result["float32_bytes"] / 2**20
    lines = [
        f"backend {result['backend']}: codec up {result['codec_up']}, down "
        f"{result['codec_down']} (B={result['block_size']}), n={result['n']} "
        f"({mib:g} MiB float32), {result['repeats']} rounds, poll {result['poll_s'] * 1e3:g} ms",
        f"{'stage':<36} {'median ms':>10} {'max ms':>10}",
        "-" * 58,
    ]
    for key, label in STAGES:
        s = result["stages"][key]
        lines.append(f"{label:<36} {s['median_s'] * 1e3:>10.1f} {s['max_s'] * 1e3:>10.1f}")
    lines += [
        "",
        f"{'party':<8} {'bytes up':>14} {'bytes down':>14} {'requests':>9}   (median per round)",
    ]
    for party, tr in result["traffic_median_per_round"].items():
        lines.append(
            f"{party:<8} {tr['bytes_up']:>14,} {tr['bytes_down']:>14,} {tr['requests']:>9}"
        )
    lines.append(
        f"payloads: delta {result['delta_payload_bytes']:,} B, mean "
        f"{result['mean_payload_bytes']:,} B (float32 {result['float32_bytes']:,} B)"
    )
    return "\n".join(lines)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("numpy", "zarr", "fsspec", "s3fs", "aiobotocore", "botocore", "moto"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="file,s3", help="comma list of file, s3")
    parser.add_argument("--mib", type=float, default=32, help="fragment size, MiB of float32")
    parser.add_argument("--codec", default="int4",
                        help=f"up codec(s), comma list of {', '.join(CODEC_NAMES)}")
    parser.add_argument("--codec-down", default="auto",
                        help="down codec; auto: none for none, fp16 for fp16, else int8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--poll-ms", type=float, default=5.0, help="polling interval")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/exchange.json"))
    args = parser.parse_args(argv)
    n = int(args.mib * 2**20) // 4
    if n < 1 or args.repeats < 1:
        parser.error("--mib and --repeats must be positive")
    codecs = [c.strip() for c in args.codec.split(",") if c.strip()]
    for codec in codecs:
        CodecSpec(codec, BLOCK_SIZE)  # validates the name
    results = []
    for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
        with open_backend(name) as backend:
            for codec in codecs:
                down = args.codec_down
                if down == "auto":
                    down = codec if codec in ("none", "fp16") else "int8"
                result = bench(backend, n, codec, down, args.repeats, args.poll_ms / 1e3)
                print(table(result), end="\n\n", flush=True)
                results.append(result)
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "cores_available": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
        },
        "versions": versions(),
        "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.bench_exchange",
                             *(argv if argv is not None else sys.argv[1:])]),
        "unit": "seconds; bytes are object bodies per round from each party's TrafficCounter",
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
