"""The exchange at scale, per model size: short real runs of the ``small`` and
``gpu-150m`` recipes, and one fragment round of a 1B model through the real exchange.

    .venv/bin/python -m benchmarks.bench_scale [--sizes small,150m,1b] [--stride 3] \\
        [--recipe-seq-len N] [--recipe-batch-size N] [--recipe-set key=value ...] \\
        [--gpu-step-s-small 0.02] [--gpu-step-s-150m 0.3] \\
        [--params 1e9] [--fragments 4] [--workers 2] \\
        [--up int4] [--down int8] [--peers] [--backends file,s3] [--shards 1,2] \\
        [--reduce-log2n 24] [--gpu-step-s 0.5] [--sync-every 100] [--out scale]

**Sizes small and 150m.** A real run of the recipe on this machine, M = 2, its own
P, ``overlap: auto``, H = P * ``--stride``, H + stride steps, each size in a process
of its own (``benchmarks.scale_recipes``, whose docstring lists every change to the
recipe): per-round seconds of every stage (below, plus the worker's ``send``, its
outer gradient, and ``merge`` of a mean, both on its training loop), the CPU inner-step time, each worker's blocked time per round and its
share of the round (measured: everything but the final drain), and peak RSS per
party over the model's float32 size (a worker against 3x plus AdamW's 2x). The
blocked share is also modelled, as for 1B below, with the recipe's own H at the
measured CPU step and at a stated GPU step (``--gpu-step-s-small``,
``--gpu-step-s-150m``), the send and merge counted as blocked.

**Exchange round.** The model's P fragments have the sizes of ``split_sizes(N, P)``
(diloco/arithmetic.py); a round moves one fragment (streaming DiLoCo), fragment 0.
The M workers' outer gradients are synthetic: float32 N(0, 1e-6), generated chunk by
chunk into one preallocated array. Every party runs in a process of its own, one
after the other (so that a 1 GB fragment's parties never share the 24 GiB or the two
cores), with the real code of storage/exchange.py:

- worker ``w<i>`` (each): ``prepare_delta`` (encode, ``--up``), then
  ``publish_prepared`` (upload and commit);
- the aggregator: ``fetch_delta`` of every worker (download, verify, decode), the
  token-weighted mean (``weighted_sum``, what diloco/aggregator.py calls: reduce) and
  ``publish_mean`` (encode with ``--down``, upload, commit);
- worker w0 again: ``fetch_mean`` (download and decode). With ``--peers`` (``topk2``
  both ways, ``mean_from: peers``) the mean is a weights record and w0 reads the other
  workers' contributions instead (its own it holds).

Download and upload are the seconds spent in the store's get/put calls inside each
step (timed around the ``ObjectStore`` methods); decode and encode are the rest of
the step. Peak RSS per party: ``VmHWM`` reset (``/proc/self/clear_refs``) once the
store client exists, reported in MiB and as (peak - RSS before) over the fragment's
float32 size: a worker's own outer gradient counts, as it holds it in training.
``completed``: the mean w0 decoded equals the aggregator's, checksum for checksum.

**Reduce throughput.** ``bench_shards.reduce_throughput`` at K = 1 and K = 2 (the
whole aggregator, one fragment of 2^``--reduce-log2n`` values, M contributions of
``--up``): encoded bytes per wall second and per CPU second of the busiest shard.

**Blocked share (a model).** For 1B, with ``overlap: auto`` a fragment's exchange may take
tau = H/P - 1 steps unseen; a worker is blocked ``b = max(0, L - tau * t)`` per round,
a share ``b / (H/P t + b)`` of it, with L the measured exchange latency (the sum of
the stages above, which ran one after the other) and t a *stated* GPU step time
(``--gpu-step-s``), not one measured here. On a loaded machine L is inflated: the
parties' CPU seconds are reported beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.report import (
    environment,
    md_table,
    output_args,
    publish,
    rerendered,
    stop_on_sigterm,
)
from benchmarks.rss import reset_peak, status

MIB = 1 << 20
GEN_CHUNK = 1 << 22  # values generated at a time
STAGES = ("encode", "upload", "download", "decode", "reduce", "mean_encode", "mean_upload",
          "fetch_download", "fetch_decode")




class StoreClock:
    """Seconds spent in an ObjectStore's reads and writes, by wrapping its methods on
    the instance (the exchange calls them; everything else in a step is codec work)."""

    READS = ("get", "get_many", "exists")
    WRITES = ("put", "put_many", "put_if_absent")

    def __init__(self, store: Any):
        self.seconds = {"read": 0.0, "write": 0.0}
        for kind, names in (("read", self.READS), ("write", self.WRITES)):
            for name in names:
                setattr(store, name, self._timed(kind, getattr(store, name)))

    def _timed(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[kind] += time.perf_counter() - t0
        return call

    def take(self) -> dict[str, float]:
        """The seconds so far, and start again from zero."""
        out, self.seconds = self.seconds, {"read": 0.0, "write": 0.0}
        return out


def synthetic(n: int, seed: int) -> Any:
    """An outer gradient of n float32 values, N(0, 1e-6), made in chunks of GEN_CHUNK
    so that nothing but the result is ever resident."""
    import numpy as np  # noqa: PLC0415

    rng, x = np.random.default_rng(seed), np.empty(n, np.float32)
    for a in range(0, n, GEN_CHUNK):
        part = x[a:a + GEN_CHUNK]
        rng.standard_normal(out=part, dtype=np.float32)
        part *= np.float32(1e-3)
    return x


def manifest(n_params: int, fragments: int, workers: int, up: str, down: str,
             peers: bool) -> Any:
    """The run of the benchmark: P fragments of the model's sizes, one round each."""
    from diloco.arithmetic import split_sizes  # noqa: PLC0415
    from storage.codecs import CodecSpec  # noqa: PLC0415
    from storage.spec import CodecEntry, FragmentEntry, ParamEntry, RunManifest  # noqa: PLC0415

    sizes = split_sizes(n_params, fragments)
    return RunManifest(
        run_id="bench-scale", workers=[f"w{i}" for i in range(workers)], total_steps=0,
        rounds=[1] * fragments, codec_up=CodecEntry.of(CodecSpec(up)),
        codec_down=CodecEntry.of(CodecSpec(down)),
        fragments=[FragmentEntry(index=i, numel=s, params=[ParamEntry(name=f"f{i}", shape=[s])])
                   for i, s in enumerate(sizes)],
        sync={"mean_from": "peers" if peers else "aggregator"})


def _checksum(x: Any) -> str:
    import hashlib  # noqa: PLC0415

    return hashlib.sha256(memoryview(x).cast("B")).hexdigest()[:16]


def party(role: str, url: str, options: dict[str, Any]) -> dict[str, Any]:
    """One party's part of the round in this fresh process: its stage seconds and
    peak RSS. ``role``: ``w<i>`` (publish), ``aggregator``, ``fetch`` (w0 reads the
    mean)."""
    import numpy as np  # noqa: PLC0415

    from storage.exchange import Exchange, weighted_sum  # noqa: PLC0415
    from storage.objectstore import ObjectStore  # noqa: PLC0415
    from storage.spec import read_manifest  # noqa: PLC0415

    store = ObjectStore(url, storage_options=options)
    ex = Exchange(store, read_manifest(store))
    n, workers = ex.manifest.numel(0), ex.manifest.workers
    clock = StoreClock(store)
    out: dict[str, Any] = {"role": role}
    cpu = time.process_time()
    if role.startswith("w"):
        base = reset_peak()
        x = synthetic(n, seed=int(role[1:]))
        t0 = time.perf_counter()
        prepared = ex.prepare_delta(0, 0, role, x)
        t1 = time.perf_counter()
        ex.publish_prepared(prepared, tokens=1000)
        t2 = time.perf_counter()
        out.update(encode=t1 - t0, upload=t2 - t1)
    elif role == "aggregator":
        base = reset_peak()
        t0 = time.perf_counter()
        # as diloco/aggregator.py: each kept encoded, its norm from a first chunked pass
        values = {w: ex.hold_delta(0, 0, w)[0] for w in workers}
        norms = {w: values[w].sumsq() for w in workers}  # noqa: F841 - the norm guard's
        t1 = time.perf_counter()
        got = clock.take()
        mean = weighted_sum(n, values, {w: 1.0 / len(workers) for w in workers})
        del values
        t2 = time.perf_counter()
        published = ex.publish_mean(0, 0, "aggregator", mean, weights={
            w: 1.0 / len(workers) for w in workers})
        t3 = time.perf_counter()
        put = clock.take()
        out.update(download=got["read"], decode=t1 - t0 - got["read"], reduce=t2 - t1,
                   mean_upload=put["write"] + put["read"],
                   mean_encode=t3 - t2 - put["write"] - put["read"],
                   checksum=_checksum(published.decoded))
    else:
        known = {"w0": ex.fetch_delta(0, 0, "w0")[0]} if ex.from_peers else {}
        clock.take()
        base = reset_peak()
        t0 = time.perf_counter()
        got_mean = ex.fetch_mean(0, 0, known=known)
        t1 = time.perf_counter()
        if got_mean is None:
            raise RuntimeError("the mean of fragment 0 round 0 is not committed")
        got = clock.take()
        out.update(fetch_download=got["read"], fetch_decode=t1 - t0 - got["read"],
                   checksum=_checksum(np.ascontiguousarray(got_mean[0])))
    peak = status("VmHWM")
    out.update(cpu_s=round(time.process_time() - cpu, 2), values=n, peak_rss_mib=round(peak / MIB), base_rss_mib=round(base / MIB),
               peak_over_fragment_x=round((peak - base) / (4 * n), 2))
    return out


@contextlib.contextmanager
def backend(name: str) -> Iterator[tuple[str, dict[str, Any], dict[str, str]]]:
    """(url, storage options, environment of the children) of a fresh, empty root:
    a temp dir (``file``) or a bucket of SeaweedFS on loopback (``s3``)."""
    if name == "file":
        root = tempfile.mkdtemp(prefix="bench-scale-")
        try:
            yield Path(root).as_uri(), {}, {}
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    if name != "s3":
        raise SystemExit(f"--backends: unknown backend {name!r}; allowed: file, s3")
    from storage.seaweed import SeaweedFS, new_identity  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="bench-scale-s3-") as tmp, SeaweedFS(
            tmp, admin=new_identity("bench")) as server:
        bucket = server.create_bucket("bench")
        saved = dict(os.environ)
        os.environ.update(server.env())  # this process writes the manifest
        try:
            yield (f"s3://{bucket}/{uuid.uuid4().hex[:8]}",
                   {"endpoint_url": server.endpoint,
                    "client_kwargs": {"region_name": "us-east-1"}}, server.env())
        finally:
            os.environ.clear()
            os.environ.update(saved)


def exchange_round(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One fragment round on backend ``name``, every party a child process in turn."""
    from storage.objectstore import ObjectStore  # noqa: PLC0415
    from storage.spec import write_manifest  # noqa: PLC0415

    up, down = ("topk2", "topk2") if args.peers else (args.up, args.down)
    with backend(name) as (url, options, env):
        write_manifest(ObjectStore(url, storage_options=options),
                   manifest(int(args.params), args.fragments, args.workers, up, down,
                            args.peers))
        t0 = time.perf_counter()
        parties = [_child(role, url, options, env) for role in
                   [*(f"w{i}" for i in range(args.workers)), "aggregator", "fetch"]]
        wall = time.perf_counter() - t0
    stages: dict[str, float] = {}
    for p in parties:
        for s in STAGES:
            if s in p:  # the slowest worker's encode and upload (they run in parallel)
                stages[s] = round(max(stages.get(s, 0.0), p[s]), 3)
    by_role = {p["role"]: p for p in parties}
    return {"backend": name, "params": int(args.params), "fragment_values": parties[0]["values"],
            "up": up, "down": down, "mean_from": "peers" if args.peers else "aggregator",
            "workers": args.workers, "stages_s": stages,
            "latency_s": round(sum(stages.values()), 3), "wall_s": round(wall, 1),
            "completed": by_role["aggregator"]["checksum"] == by_role["fetch"]["checksum"],
            "rss": {p["role"]: {k: p[k] for k in ("peak_rss_mib", "base_rss_mib",
                                                  "peak_over_fragment_x")} for p in parties},
            "cpu_s": {p["role"]: p["cpu_s"] for p in parties},
            "load_average": os.getloadavg()}


def _child(role: str, url: str, options: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_scale", "--party", role, url,
                          json.dumps(options)], check=True, capture_output=True, text=True,
                         env={**os.environ, **env}).stdout
    row = json.loads(out.splitlines()[-1])
    print(json.dumps(row), flush=True)
    return row


def reduce_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The aggregator's reduce throughput at each K of ``--shards`` (bench_shards)."""
    from benchmarks.bench_shards import reduce_throughput  # noqa: PLC0415

    codec = "topk2" if args.peers else args.up
    rows = [reduce_throughput(int(k), log2n=args.reduce_log2n, workers=args.workers,
                              codec=codec) for k in args.shards.split(",") if k.strip()]
    for row in rows:
        row["ratio"] = round(row["bytes_per_s"] / rows[0]["bytes_per_s"], 2)
        row["cpu_ratio"] = round(row["bytes_per_cpu_s"] / rows[0]["bytes_per_cpu_s"], 2)
    return rows


def blocked(latency_s: float, step_s: float, sync_every: int, fragments: int,
            merge_s: float = 0.0) -> dict[str, Any]:
    """The modelled share of a round a worker waits, with ``overlap: auto``: the
    round is its H/P steps plus the wait; ``merge_s``, the work on the training loop
    (the send's outer gradient, the merge of the mean), is never hidden."""
    steps = sync_every // fragments
    tau = steps - 1
    wait = max(0.0, latency_s - tau * step_s) + merge_s
    return {"step_s": step_s, "round_steps": steps, "tau": tau, "latency_s": latency_s,
            "blocked_s": round(wait, 3),
            "blocked_share": round(wait / (steps * step_s + wait), 4)}


def size_rows(args: argparse.Namespace, sizes: list[str]) -> list[dict[str, Any]]:
    """The recipe runs of ``sizes`` (small, 150m), each in its own process, with the
    blocked share modelled from their stage latencies."""
    from benchmarks.scale_recipes import child  # noqa: PLC0415

    argv = ["--stride", str(args.stride)]
    if args.recipe_seq_len:
        argv += ["--seq-len", str(args.recipe_seq_len)]
    if args.recipe_batch_size:
        argv += ["--batch-size", str(args.recipe_batch_size)]
    for item in args.recipe_set:
        argv += ["--set", item]
    rows = []
    for size in sizes:
        row = child(size, argv)
        steps = row["recipe_sync_every"]
        merge = sum(row["stages_s"].get(k, 0.0) for k in ("send", "merge"))  # on the loop
        cpu_step = max(w["step_s"] for w in row["per_worker"])
        gpu_step = getattr(args, f"gpu_step_s_{size}")
        row["blocked_cpu_model"] = blocked(row["latency_s"], cpu_step, steps,
                                           row["fragments"], merge)
        row["blocked_gpu_model"] = blocked(row["latency_s"], gpu_step, steps,
                                           row["fragments"], merge)
        print(json.dumps({k: row[k] for k in ("size", "stages_s", "completed")}), flush=True)
        rows.append(row)
    return rows


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def sizes_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """Stage seconds per round and the per-size table of the recipe runs."""
    names = [f"{r['recipe']} ({r['params'] / 1e6:.1f}M)" for r in rows]
    order = [*STAGES, "send", "merge"]
    lines = ["Per model size: a real run on this machine of each recipe, M = 2, its P, "
             "overlap auto, the CPU, local disk (settings in the second table)", "",
             md_table(["stage (s per round)", *names], [
                 [s, *(f"{r['stages_s'][s]:.3g}" if s in r["stages_s"] else "" for r in rows)]
                 for s in order if any(s in r["stages_s"] for r in rows)] + [
                 ["sum (latency; send, merge apart)", *(f"{r['latency_s']:.2f}" for r in rows)],
                 ["rounds completed (aggregator)", *(
                     f"{r['aggregator_rounds']} ({r['completed']})" for r in rows)]]), ""]

    def workers(r: dict[str, Any], fmt: Callable[[dict[str, Any]], str]) -> str:
        return " / ".join(fmt(w) for w in r["per_worker"])

    def model(b: dict[str, Any]) -> str:
        return (f"{b['blocked_s']:.2f} s, {_pct(b['blocked_share'])} "
                f"(step {b['step_s']:.3g} s, H/P {b['round_steps']}, tau {b['tau']})")

    table = [
        ["run (changed from the recipe)", *(
            f"H {r['sync_every']} (recipe {r['recipe_sync_every']}), P {r['fragments']}, "
            f"{r['steps']} steps, seq {r['seq_len']} x batch {r['batch_size']}, "
            f"{r['up']} up / {r['down']} down, mode streaming, quorum 1" for r in rows)],
        ["CPU inner step, s (w0 / w1)", *(workers(r, lambda w: f"{w['step_s']:.3g}")
                                          for r in rows)],
        ["blocked per round, s (measured, w0 / w1)", *(
            workers(r, lambda w: f"{w['blocked_per_round_s']}") for r in rows)],
        ["of it the wait for means, s", *(workers(r, lambda w: f"{w['wait_per_round_s']}")
                                          for r in rows)],
        ["blocked share of the round (measured)", *(
            workers(r, lambda w: _pct(w["blocked_share"])) for r in rows)],
        ["blocked, a model at the CPU step and the recipe's H", *(
            model(r["blocked_cpu_model"]) for r in rows)],
        ["blocked, a model at a stated GPU step", *(model(r["blocked_gpu_model"])
                                                    for r in rows)],
        ["float32 model, MiB", *(f"{4 * r['params'] / MIB:.0f}" for r in rows)],
        ["worker peak RSS, MiB (x float32)", *(workers(
            r, lambda w: f"{w['peak_rss_mib']} ({w['peak_over_float32_x']}x)") for r in rows)],
        ["worker <= 3x float32 + AdamW (5x)", *(
            workers(r, lambda w: "yes" if w["rss_target_met"] else "no") for r in rows)],
        ["worker RSS before the model (runtime), MiB", *(
            workers(r, lambda w: str(w["base_rss_mib"])) for r in rows)],
        ["aggregator peak RSS, MiB (x float32; growth x)", *(
            f"{a['peak_rss_mib']} ({a['peak_over_float32_x']}x; "
            f"+{a['growth_over_float32_x']}x)" for a in (r["aggregator_rss"] for r in rows))],
        ["wall s of the run; load average", *(
            f"{r['wall_s']}; {r['load_average'][0]:.1f}" for r in rows)],
    ]
    lines += [md_table(["", *names], table), "",
              "Blocked: a worker's time in the calls that talk to the store "
              "(benchmarks/timed_worker.py) outside the final drain, per merge point; "
              "share: of the training loop without the drain. The models: "
              "max(0, latency - (H/P - 1) x step) + send + merge per round of H/P steps "
              "(both run on the training loop)."]
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The tables: per size, then the 1B round: stages per backend, RSS per party,
    reduce throughput, the model."""
    lines = sizes_markdown(report["sizes"]) if report.get("sizes") else []
    if report.get("rounds"):
        lines += ([""] if lines else []) + round_markdown(report)
    return "\n".join(lines)


def round_markdown(report: dict[str, Any]) -> list[str]:
    """The 1B exchange round's tables."""
    rounds = report["rounds"]
    head = ["stage (s per round)", *(r["backend"] for r in rounds)]
    rows = [[s, *(f"{r['stages_s'][s]:.3g}" if s in r["stages_s"] else "" for r in rounds)]
            for s in STAGES if any(s in r["stages_s"] for r in rounds)]
    rows += [["sum (latency)", *(f"{r['latency_s']:.2f}" for r in rounds)],
             ["completed", *(str(r["completed"]) for r in rounds)]]
    r0 = rounds[0]
    lines = [f"Exchange round of fragment 0 ({r0['fragment_values']:,} values) of a "
             f"{r0['params']:.3g}-parameter model, M = {r0['workers']}, {r0['up']} up, "
             f"{r0['down']} down, mean from {r0['mean_from']}", "", md_table(head, rows), "",
             "Load average after the round: " + ", ".join(
                 f"{r['backend']} {r['load_average'][0]:.1f}" for r in rounds), "",
             "Peak RSS per party: MiB (peak - base over the fragment's float32 size); "
             "CPU seconds of the party's process (from its start of work)", ""]
    roles = list(r0["rss"])
    lines.append(md_table(["party", *(f"{r['backend']} RSS" for r in rounds),
                           *(f"{r['backend']} CPU s" for r in rounds)], [
        [role, *(f"{r['rss'][role]['peak_rss_mib']} ({r['rss'][role]['peak_over_fragment_x']}x)"
                 for r in rounds), *(r["cpu_s"][role] for r in rounds)] for role in roles]))
    if report.get("reduce"):
        lines += ["", "Aggregator reduce throughput (bench_shards, local disk)", "",
                  md_table(["K", "values", "MiB/s", "x K=1", "MiB per CPU s", "x K=1 (CPU)"], [
                      [r["shards"], f"{r['values']:,}", f"{r['bytes_per_s'] / MIB:.1f}",
                       r["ratio"], f"{r['bytes_per_cpu_s'] / MIB:.1f}", r["cpu_ratio"]]
                      for r in report["reduce"]])]
    if report.get("blocked"):
        b = report["blocked"]
        lines += ["", f"Blocked share (a model, not a measurement): stated GPU step "
                  f"{b['step_s']} s, a round of {b['round_steps']} steps, tau = {b['tau']}, "
                  f"latency {b['latency_s']:.2f} s ({b['backend']}): blocked "
                  f"{b['blocked_s']:.2f} s per round, {100 * b['blocked_share']:.2f}% of it"]
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_scale",
                                description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="small,150m,1b",
                   help="comma list of small, 150m (recipe runs), 1b (the exchange round)")
    p.add_argument("--stride", type=int, default=3, help="recipe runs: H/P (H = P x stride)")
    p.add_argument("--recipe-seq-len", type=int, default=None,
                   help="recipe runs: data.seq_len (default: per size, scale_recipes.SIZES)")
    p.add_argument("--recipe-batch-size", type=int, default=None,
                   help="recipe runs: data.batch_size (default: per size)")
    p.add_argument("--recipe-set", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe runs: more overrides (e.g. a smaller model for --quick)")
    p.add_argument("--gpu-step-s-small", type=float, default=0.02,
                   help="stated GPU step of the small recipe (its batch), for the model")
    p.add_argument("--gpu-step-s-150m", type=float, default=0.3,
                   help="stated GPU step of gpu-150m (its batch), for the model")
    p.add_argument("--params", type=float, default=1e9, help="1b: model parameters N")
    p.add_argument("--fragments", type=int, default=4, help="P")
    p.add_argument("--workers", type=int, default=2, help="M")
    p.add_argument("--up", default="int4")
    p.add_argument("--down", default="int8")
    p.add_argument("--peers", action="store_true", help="topk2 both ways, mean_from: peers")
    p.add_argument("--backends", default="file,s3", help="comma list of file, s3")
    p.add_argument("--shards", default="1,2", help="K values of the reduce throughput; "
                   "empty: skip it")
    p.add_argument("--reduce-log2n", type=int, default=24)
    p.add_argument("--gpu-step-s", type=float, default=0.5, help="1b: stated GPU step time")
    p.add_argument("--sync-every", type=int, default=100, help="H of the blocked-share model")
    p.add_argument("--party", nargs=3, help=argparse.SUPPRESS)
    output_args(p, "scale", "(no MLflow runs here; accepted for benchmarks.run_all)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.party:
        role, url, options = args.party
        print(json.dumps(party(role, url, json.loads(options))))
        return 0
    if rerendered(args, markdown):
        return 0
    if args.params < 1 or args.fragments < 1 or args.workers < 1:
        raise SystemExit("--params, --fragments and --workers must be >= 1")
    sizes = [x.strip() for x in args.sizes.split(",") if x.strip()]
    unknown = sorted(set(sizes) - {"small", "150m", "1b"})
    if unknown or not sizes:
        raise SystemExit(f"--sizes: unknown {', '.join(unknown) or '(empty)'}; allowed: "
                         "small, 150m, 1b")
    start = time.perf_counter()
    report: dict[str, Any] = environment(argv, "benchmarks.bench_scale")
    report["sizes"] = size_rows(args, [s for s in ("small", "150m") if s in sizes])
    report["rounds"], report["reduce"] = [], []
    if "1b" in sizes:
        report["rounds"] = [exchange_round(args, b.strip())
                            for b in args.backends.split(",") if b.strip()]
        report["reduce"] = reduce_rows(args) if args.shards.strip() else []
        slowest = max(report["rounds"], key=lambda r: r["latency_s"])
        report["blocked"] = {"backend": slowest["backend"], **blocked(
            slowest["latency_s"], args.gpu_step_s, args.sync_every, args.fragments)}
    report["wall_seconds"] = time.perf_counter() - start
    publish(args.out, report, markdown, args.results_dir)
    return 0 if all(r["completed"] for r in [*report["rounds"], *report["sizes"]]) else 1


if __name__ == "__main__":
    stop_on_sigterm()
    raise SystemExit(main())
