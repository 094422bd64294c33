"""Traffic: bytes each worker sends and receives per inner step, against data-parallel.

    .venv/bin/python -m benchmarks.bench_traffic [--sync-every 100] [--fragments 1,2,4] \\
        [--codecs int4,topk2-peers] [--workers 2,4] [--steps 300] [--dp-netns auto]

DiLoCo contenders (M workers, the quality recipe's model) train through a real S3
server (moto on loopback). Each worker reaches it through its own counting TCP
proxy, so three counts are taken per worker:

- object bodies, from the worker's store client (storage/traffic.py), split into the
  exchange (``frag/...``, per fragment round) and the rest (the run manifest and the
  initial parameters at start-up, the status object every second or so);
- bytes on the wire at the HTTP level (request and response lines, headers,
  bodies, and any request s3fs makes that the counter does not see), from the
  proxy; TCP/IP headers are not in it;
- from the two, the HTTP overhead per counted request, which turns the exchange's
  per-round bodies and requests into its on-the-wire bytes (an estimate: every
  request is charged the run's mean overhead).

"Per inner step" is steady state: the bytes of the scheduled rounds (the extra final
round a run of T steps may end with is left out) divided by the H steps between two
rounds of a fragment, summed over fragments. The whole run's numbers are beside it.
Data-parallel is the fp32 ring all-reduce of docs/algorithms.md section 8 for the same
parameter count, and, when this runs as root (``--dp-netns``), also measured: two
data-parallel ranks in their own network namespaces, Ethernet bytes on their veths
(gloo's all-reduce plus the status object) over ``--dp-steps`` steps.

The peak payload per sync is the largest delta a worker uploads in one fragment
round (zarr array and its metadata, plus the commit record in the round's bytes).

Every contender's steady-state bytes are also computed by ``diloco.arithmetic`` (the
figures ``diloco estimate`` prints) from the run's own fragment sizes, and the table
says how far the measurement is from it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.contenders import Contender, Workdir, load, run_contender
from benchmarks.recipe import CODEC_LABELS, MODE_LABELS, MODES, ensure_dataset, reference_overrides
from benchmarks.report import (
    cli_logging,
    environment,
    md_table,
    output_args,
    publish,
    rerendered,
    stop_on_sigterm,
    timed,
)
from tests.s3server import MotoS3Server

log = logging.getLogger("benchmarks.traffic")


class CountingProxy:
    """A TCP proxy on loopback that counts the bytes each way (HTTP level)."""

    def __init__(self, upstream: str, host: str = "127.0.0.1"):
        hostport = upstream.split("://", 1)[-1].rstrip("/")
        up_host, up_port = hostport.rsplit(":", 1)
        self.upstream = (up_host, int(up_port))
        self.listener = socket.create_server((host, 0))
        self.endpoint_url = f"http://{host}:{self.listener.getsockname()[1]}"
        self.up = self.down = self.connections = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="proxy").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self._lock:
                self.connections += 1
                self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "down"),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
                with self._lock:
                    setattr(self, way, getattr(self, way) + len(data))
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"up": self.up, "down": self.down, "connections": self.connections}

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        with self._lock:
            for s in self._socks:
                s.close()


def dp_arithmetic(num_parameters: int, workers: int) -> dict[str, float]:
    """fp32 ring all-reduce: 2 (M-1)/M x 32 bits per parameter each way per step."""
    from diloco.arithmetic import data_parallel_per_step  # noqa: PLC0415

    each_way = data_parallel_per_step(num_parameters, workers)
    return {"up": each_way, "down": each_way}


def expected_per_step(cfg: Any, num_parameters: int) -> dict[str, float]:
    """``diloco.arithmetic``'s steady state for this run: bytes per worker per step
    (fragments cut as ``split_tensors`` cuts them)."""
    from diloco import arithmetic as ar  # noqa: PLC0415

    s = ar.Setup.of(cfg.sync, num_parameters, len(cfg.workers), cfg.train.steps)
    w, h = ar.per_round(s)["worker"], cfg.sync.schedule.sync_every
    return {"bytes_up": w.up / h, "bytes_down": w.down / h}


def steady_state(worker: dict[str, Any], rounds: list[int], sync_every: int,
                 final: list[bool]) -> dict[str, float]:
    """Bytes per inner step of one worker over the scheduled rounds (final left out)."""
    per_round = worker["traffic"]["per_round"]
    total = {"bytes_up": 0.0, "bytes_down": 0.0, "requests": 0.0}
    for p, n in enumerate(rounds):
        keys = [f"{p}/r{r:06d}" for r in range(n - int(final[p]))]
        rows = [per_round[k] for k in keys if k in per_round]
        if not rows:
            continue
        for k in total:
            total[k] += sum(r[k] for r in rows) / len(rows) / sync_every
    return total


def measure_contender(c: Contender, base: list[str], server: MotoS3Server,
                      workdir: Path, mlflow: bool) -> dict[str, Any]:
    from diloco.schedule import Schedule  # noqa: PLC0415

    cfg = load(c, base)
    proxies = {w: CountingProxy(server.endpoint_url) for w in cfg.workers}
    try:
        out = run_contender(
            c, base, workdir, mlflow=mlflow, storage_url=f"s3://{server.new_bucket()}",
            storage_options=server.options(),
            worker_options={w: server.options(p.endpoint_url) for w, p in proxies.items()})
    finally:
        wire = {w: p.counts() for w, p in proxies.items()}
        for p in proxies.values():
            p.close()
    sched = Schedule.of(cfg.sync.schedule)
    final = [sched.has_final_round(p, cfg.train.steps, cfg.sync.schedule.merge_alpha)
             for p in range(cfg.sync.schedule.fragments)]
    steps = cfg.train.steps
    workers = {}
    for w, res in out.workers.items():
        t = res["traffic"]
        status = res["status_traffic"]
        bodies = t["total"]["bytes_up"] + t["total"]["bytes_down"] + status["bytes_up"] \
            + status["bytes_down"]
        requests = t["total"]["requests"] + status["requests"]
        wire_total = wire[w]["up"] + wire[w]["down"]
        overhead = (wire_total - bodies) / max(1, requests)
        # the part of it that goes up (request lines and headers): what an upload costs
        overhead_up = (wire[w]["up"] - t["total"]["bytes_up"] - status["bytes_up"]) \
            / max(1, requests)
        steady = steady_state(res, out.rounds, cfg.sync.schedule.sync_every, final)
        peak_up = max(t["delta_payload_bytes"].values(), default=0)
        peak_down = max(t["mean_payload_bytes"].values(), default=0)
        workers[w] = {
            "steady_bodies_per_step": steady,
            "steady_wire_per_step_estimate": steady["bytes_up"] + steady["bytes_down"]
            + steady["requests"] * overhead,
            "run_exchange_bodies_per_step": (t["exchange"]["bytes_up"]
                                             + t["exchange"]["bytes_down"]) / steps,
            "run_all_bodies_per_step": bodies / steps,
            "run_wire_per_step": wire_total / steps,
            "wire": wire[w], "http_overhead_per_request": overhead,
            "http_overhead_up_per_request": overhead_up,
            "requests": requests, "status": status,
            "peak_delta_payload": peak_up, "peak_mean_payload": peak_down,
            "traffic": t,
        }
    return {"contender": c.name, "mode": c.mode, "codec": c.codec, "M": c.workers,
            "expected_per_step": expected_per_step(cfg, out.num_parameters),
            "sync_every": cfg.sync.schedule.sync_every, "fragments": cfg.sync.schedule.fragments,
            "steps": steps, "rounds": out.rounds, "final_round": final,
            "eval_loss": out.eval_loss, "seconds": out.seconds,
            "num_parameters": out.num_parameters, "workers": workers}


def measure_dp_netns(base: list[str], steps: int, workers: int) -> dict[str, Any] | None:
    """Two data-parallel ranks in namespaces, uncapped: Ethernet bytes per step."""
    from benchmarks import bench_bandwidth, netns  # noqa: PLC0415

    if netns.available():
        return None
    with netns.Topology(workers) as topo, MotoS3Server(topo.host_addr) as server, \
            Workdir("traffic-dp") as logs:
        bench = bench_bandwidth.Bench(topo, server, logs, base)
        r = bench.rung(Contender("data-parallel", workers=workers), None, steps)
    return {"steps": steps, "wire_bytes_per_step": r["wire_bytes_per_step"],
            "utilisation": r["utilisation"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    data = ensure_dataset(args.data)
    base = reference_overrides(args.steps, data)
    fragments = [int(p) for p in args.fragments.split(",") if p]
    list_ = [Contender(args.mode, codec, int(m), args.sync_every, fragments=p)
             for m in args.workers.split(",") if m
             for codec in args.codecs.split(",") if codec for p in fragments]
    if args.fp32:
        list_.append(Contender(args.mode, "fp32", 2, args.sync_every, fragments=fragments[0]))
    rows = []
    with MotoS3Server() as server, Workdir("traffic") as wd:
        for c in list_:
            log.info("running %s", c.name)
            rows.append(measure_contender(c, base, server, wd, args.mlflow))
    n = rows[0]["num_parameters"]
    dp = dp_arithmetic(n, 2)
    dp_by_m = {str(m): dp_arithmetic(n, m) for m in sorted({r["M"] for r in rows})}
    dp_measured = None
    if args.dp_netns != "off":
        try:
            dp_measured = measure_dp_netns(base, args.dp_steps, 2)
        except Exception as exc:  # noqa: BLE001 - reported, the rest stands
            log.warning("data-parallel in namespaces failed: %s", exc)
        if dp_measured is None and args.dp_netns == "on":
            raise SystemExit("--dp-netns on: namespaces are not available here")
    return {"rows": rows, "dp_arithmetic_per_step": dp, "dp_by_workers": dp_by_m,
            "dp_measured": dp_measured}


def markdown(report: dict[str, Any]) -> str:
    res, env = report["results"], report["environment"]
    dp = res["dp_arithmetic_per_step"]
    dpm = res["dp_measured"]
    n = res["rows"][0]["num_parameters"] if res["rows"] else 0
    by_m = res.get("dp_by_workers") or {"2": dp}
    lines = [f"Traffic per worker per inner step ({env['date'][:10]}; `{env['command']}`)", "",
             f"{n:,} parameters. Data-parallel, fp32 ring all-reduce (arithmetic), each way "
             "per step: " + ", ".join(f"{v['up'] / 1e6:.3f} MB at M = {m}"
                                      for m, v in by_m.items()) + "."]
    if dpm:
        w = dpm["wire_bytes_per_step"]
        lines.append(f"Data-parallel measured on the wire (Ethernet frames on each rank's "
                     f"veth, {dpm['steps']} steps, gloo plus the status object): "
                     f"{w['up'] / 1e6:.3f} MB up + {w['down'] / 1e6:.3f} MB down per step.")
    lines += ["", "Steady state (scheduled rounds, per worker per step, mean of the "
              "workers). Upload is what the sparse codecs cut: \"less than DP\" divides "
              "data-parallel's upload at the same M (arithmetic) by it, bodies alone and "
              "with the HTTP overhead; \"estimate\" is how far the measured bodies (up + "
              "down) are from `diloco estimate`'s arithmetic:", ""]
    head = ["contender", "M", "up bodies / step", "less than DP", "up with HTTP",
            "less than DP", "up + down bodies", "estimate", "peak delta / sync", "peak cut"]
    table = []
    for r in res["rows"]:
        ws = list(r["workers"].values())
        m = r.get("M", 2)
        dp_up = res.get("dp_by_workers", {}).get(str(m), dp)["up"]
        up = sum(w["steady_bodies_per_step"]["bytes_up"] for w in ws) / len(ws)
        body = sum(w["steady_bodies_per_step"]["bytes_up"]
                   + w["steady_bodies_per_step"]["bytes_down"] for w in ws) / len(ws)
        up_wire = sum(w["steady_bodies_per_step"]["bytes_up"]
                      + w.get("http_overhead_up_per_request", 0.0)
                      * w["steady_bodies_per_step"]["requests"] for w in ws) / len(ws)
        peak = max(w["peak_delta_payload"] for w in ws)
        whole = [q for q in res["rows"] if q["fragments"] == 1 and q["codec"] == r["codec"]
                 and q.get("M", 2) == m]
        p1_peak = max(w["peak_delta_payload"] for w in whole[0]["workers"].values()) \
            if whole else 0
        e = r.get("expected_per_step")
        off = f"{body / (e['bytes_up'] + e['bytes_down']) - 1:+.1%}" if e else ""
        table.append([
            f"{MODE_LABELS[r['mode']]}, {CODEC_LABELS[r['codec']]}, H={r['sync_every']}, "
            f"P={r['fragments']}", m,
            f"{up / 1e3:.3f} kB", f"{dp_up / up:,.0f}x", f"{up_wire / 1e3:.3f} kB",
            f"{dp_up / up_wire:,.0f}x", f"{body / 1e3:.2f} kB", off, f"{peak:,} B",
            f"{p1_peak / peak:.2f}x" if p1_peak else ""])
    lines.append(md_table(head, table))
    lines += ["", "Whole run (all rounds, the final one included, per step, mean of the "
              "two workers):", ""]
    head = ["contender", "M", "steps", "rounds / fragment", "exchange bodies", "all bodies",
            "HTTP wire", "requests", "HTTP overhead / request"]
    table = []
    for r in res["rows"]:
        ws = list(r["workers"].values())

        def mean(key: str, ws: list = ws) -> float:
            return sum(w[key] for w in ws) / len(ws)

        table.append([
            f"{MODE_LABELS[r['mode']]}, {CODEC_LABELS[r['codec']]}, P={r['fragments']}",
            r.get("M", 2), r["steps"], "/".join(str(x) for x in r["rounds"]),
            f"{mean('run_exchange_bodies_per_step') / 1e3:.1f} kB",
            f"{mean('run_all_bodies_per_step') / 1e3:.1f} kB",
            f"{mean('run_wire_per_step') / 1e3:.1f} kB", f"{mean('requests'):.0f}",
            f"{mean('http_overhead_per_request'):.0f} B"])
    lines.append(md_table(head, table))
    lines += ["", "All bodies: the exchange plus start-up (manifest, initial parameters) "
              "and the status object. HTTP wire: the worker's counting proxy; its excess "
              "over the bodies, divided by the requests the store client counted, is the "
              "overhead per request used for the steady-state estimate."]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks.bench_traffic",
                                description=__doc__.splitlines()[0])
    p.add_argument("--sync-every", type=int, default=100, help="H")
    p.add_argument("--fragments", default="1,2,4", help="values of P")
    p.add_argument("--codecs", default="int4,topk2-peers",
                   help="codec pairs of benchmarks/recipe.py, each at every P")
    p.add_argument("--workers", default="2,4", help="values of M")
    p.add_argument("--mode", default="streaming", choices=list(MODES))
    p.add_argument("--fp32", action="store_true", help="also the first P with float32")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--dp-netns", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--dp-steps", type=int, default=20)
    p.add_argument("--data", type=Path, default=None)
    output_args(p, "traffic")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    if (saved := rerendered(args, markdown)) is not None:
        return saved
    env = environment(argv, "benchmarks.bench_traffic")
    stop_on_sigterm()
    results, seconds = timed(lambda: run(args))
    report = {"environment": env, "wall_seconds": seconds, "settings": vars(args) | {
        "data": str(args.data)}, "results": results}
    return publish(args.out, report, markdown, args.results_dir)


if __name__ == "__main__":
    cli_logging("botocore", "s3fs", "mlflow", "alembic")
    main()
    sys.exit(0)
