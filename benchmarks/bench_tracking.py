"""How long a worker step spends in its tracking call while MLflow is slow, then down.

    .venv/bin/python -m benchmarks.bench_tracking [--steps 300] [--delay 0.2] [--pace 0.01]

A real ``mlflow server`` (SQLite, on loopback) sits behind a delay proxy that holds
each request ``--delay`` seconds before passing it on. The train job's hooks create
the parent run; a worker's hooks (`tracking.mlflow_hooks.MlflowHooks`, as a worker
job builds them) then log ``--steps`` steps of the worker's usual nine metrics, one
``worker_metrics`` call per step, ``--pace`` seconds of "training" apart: first
through the slow proxy, then with the proxy gone (connection refused), as in an
outage. For each phase it prints the median and p99 of the call's duration (what the
training loop pays), then how long ``close()`` took and what it did not log.

The proxy runs in its own process, so that its work does not share this one's GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url, timeout=2)
            return
        time.sleep(0.3)
    raise SystemExit(f"{url} did not answer within {timeout:.0f} s")


def serve_proxy(listen: int, upstream: int, delay: float) -> None:
    """Forward 127.0.0.1:listen to 127.0.0.1:upstream, each request chunk ``delay``
    seconds late (answers pass at once)."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   late: float) -> None:
        try:
            while data := await reader.read(65536):
                if late:
                    await asyncio.sleep(late)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream)
        await asyncio.gather(pipe(reader, up_writer, delay), pipe(up_reader, writer, 0.0))

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", listen)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def start_server(workdir: Path, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}",
         "--default-artifact-root", str(workdir / "artifacts"), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})


def stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(30)


def figures(durations: list[float]) -> str:
    d = sorted(durations)
    median, p99 = d[len(d) // 2], d[min(len(d) - 1, int(len(d) * 0.99))]
    return f"median {median * 1e6:7.1f} us   p99 {p99 * 1e6:8.1f} us   max {d[-1] * 1e3:6.1f} ms"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="worker steps per phase")
    p.add_argument("--delay", type=float, default=0.2, help="seconds the proxy holds a request")
    p.add_argument("--pace", type=float, default=0.01, help="seconds of 'training' per step")
    p.add_argument("--close-timeout", type=float, default=15.0)
    p.add_argument("--serve-proxy", nargs=3, metavar=("LISTEN", "UPSTREAM", "DELAY"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_proxy:
        listen, upstream, delay = args.serve_proxy
        serve_proxy(int(listen), int(upstream), float(delay))
        return

    os.environ.update(MLFLOW_EXPERIMENT_NAME="bench-tracking", DILOCO_SYSTEM_METRICS="off")
    import mlflow  # noqa: F401, PLC0415 - once, here, not by two hooks' threads at a time

    from tracking.mlflow_hooks import MlflowHooks  # noqa: PLC0415 - after the settings
    from workers.config import load_config  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as tmp:
        work = Path(tmp)
        server_port, proxy_port = free_port(), free_port()
        server = start_server(work, server_port)
        proxy = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_tracking",
                                  "--serve-proxy", str(proxy_port), str(server_port),
                                  str(args.delay)])
        try:
            wait_http(f"http://127.0.0.1:{server_port}/health")
            uri = f"http://127.0.0.1:{proxy_port}"
            run_url = (work / "store" / "bench").as_uri()
            cfg = load_config("tiny", []).model_dump(mode="json")
            train = MlflowHooks(run_url, role="train", tracking_uri=uri,
                                close_timeout=args.close_timeout)
            train.run_started(cfg, run_url, resumed=False)
            worker = MlflowHooks(run_url, role="worker:region-a", tracking_uri=uri,
                                 close_timeout=args.close_timeout)
            worker.worker_started("region-a", {"host": "bench"})
            time.sleep(3 + 10 * args.delay)  # the runs exist before the steps begin
            phases: dict[str, list[float]] = {}
            step = 0
            for phase in ("slow", "down"):
                if phase == "down":
                    proxy.terminate()
                    proxy.wait(10)
                calls = phases[phase] = []
                for _ in range(args.steps):
                    step += 1
                    metrics = {"worker": "region-a", "step": step, "loss": 5.0 - step / 1e3,
                               "lr": 1e-3, "tokens_per_s": 1000.0, "tokens": 128 * step,
                               "bytes_up": 10 * step, "bytes_down": 5 * step, "wait_s": 0.0,
                               "staleness": 0.0, "late_means": 0}
                    t = time.perf_counter()
                    worker.worker_metrics("region-a", metrics)
                    calls.append(time.perf_counter() - t)
                    time.sleep(args.pace)
            t = time.perf_counter()
            lost = worker.close()
            closed = time.perf_counter() - t
            train.close(timeout=1)
        finally:
            stop(proxy)
            stop(server)
    print(f"worker_metrics, {args.steps} steps per phase, 9 metrics per call, "
          f"{args.pace * 1e3:.0f} ms apart; proxy delay {args.delay * 1e3:.0f} ms")
    for phase, calls in phases.items():
        print(f"  {phase:5s} {figures(calls)}")
    print(f"  close() {closed:.1f} s (timeout {args.close_timeout:.0f} s); not logged: {lost}")


if __name__ == "__main__":
    main()
