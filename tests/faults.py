"""Helpers of the fault campaign (tests/test_fault_campaign.py).

- `Jobs`: the processes of one trial, each with its log file, under one hard
  deadline. A job (``python -m workers`` or tests/fault_job.py) is a fork of the
  test process's zygote (tests/zygote.py), which has done the imports every job
  makes (seconds of CPU a start; ``DILOCO_TEST_ZYGOTE=0``: plain processes). A job
  killed on purpose (SIGKILL from tests/fault_job.py) is started
  again normally; any other non-zero exit, or the deadline, ends the trial with
  the last lines of every log, so a trial never hangs and always says why.
- `FaultProxy`: an HTTP proxy in front of the S3 test server that fails a share
  of the requests (503 SlowDown, or a connection reset before or after the
  request reached the server).
- `snapshot`: what a run leaves that must not depend on how it got there: each
  fragment's final canonical checkpoint (parameters, momentum, residual), each
  round's committed mean and weights, each round's canonical checkpoint, and the
  rejections.
- `canonical_eval`: the canonical model's loss on the run's validation batches.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
from zygote import Forked, enabled, zygote

ROOT = Path(__file__).resolve().parent.parent
FAULT_JOB = str(Path(__file__).resolve().parent / "fault_job.py")


# -- processes ---------------------------------------------------------------------


def forkable(argv: list[str]) -> bool:
    """Whether a job runs ``argv`` as a fork of the zygote (tests/zygote.py):
    ``python -m workers`` or tests/fault_job.py, unless DILOCO_TEST_ZYGOTE=0."""
    if not enabled() or argv[0] != sys.executable:
        return False
    return argv[1:3] == ["-m", "workers"] or (argv[1] == FAULT_JOB and argv[2] == "--")


@dataclass
class Job:
    """One process of a trial: how to start it, its log, how it ended."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen | Forked | None = None
    exits: list[int] = field(default_factory=list)

    def start(self, argv: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        """Start (or start again, with other arguments) in a session of its own, so
        that ending the trial can end it and anything it started."""
        self.argv, self.env = argv or self.argv, env or self.env
        with open(self.log, "ab") as out:
            out.write(f"--- start: {' '.join(self.argv)}\n".encode())
            out.flush()
            if forkable(self.argv):
                self.proc = zygote().start(self.argv, self.env, self.log)
                return
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def tail(self, lines: int = 12) -> str:
        try:
            text = self.log.read_text(errors="replace").rstrip().splitlines()
        except OSError:
            return "    (no log)"
        return "\n".join("    " + line[:300] for line in text[-lines:])

    def kill(self) -> None:
        """SIGKILL the job's whole session (it may have children)."""
        if self.proc is not None and self.proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


#: how a killed job is started again: its argv and env
Restart = tuple[list[str], dict[str, str]]


class TrialFailed(AssertionError):
    """A trial ended badly: a job failed, or the deadline passed ("hung")."""


class Jobs:
    """The processes of one trial under one hard deadline. Use as a context
    manager: leaving it kills whatever still runs."""

    def __init__(self, logs: Path, timeout: float):
        self.logs = logs
        self.logs.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.jobs: dict[str, Job] = {}

    def __enter__(self) -> Jobs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> Job:
        job = Job(name, argv, env, self.logs / f"{name}.log")
        job.start()
        self.jobs[name] = job
        return job

    def kill_all(self) -> None:
        for job in self.jobs.values():
            job.kill()

    def report(self, why: str) -> str:
        """``why``, then the end of every job's log."""
        parts = [why]
        for job in self.jobs.values():
            parts.append(f"  {job.name} (exits {job.exits}, log {job.log}):\n{job.tail()}")
        return "\n".join(parts)

    def fail(self, why: str) -> None:
        self.kill_all()
        raise TrialFailed(self.report(why))

    def wait(self, restart: dict[str, Restart | list[Restart]] | None = None,
             poll_s: float = 0.1) -> None:
        """Wait until every job has exited 0. A job in ``restart`` that dies of
        SIGKILL (the planned fault) is started again once with the given argv and
        env (the plain entry point, no faults), or, given a list, once per item, in
        order (a job with several kills); any other non-zero exit fails the trial at
        once, and so does the deadline ("hung")."""
        plans = {name: list(r) if isinstance(r, list) else [r]
                 for name, r in (restart or {}).items()}
        while True:
            running = False
            for job in self.jobs.values():
                code = job.proc.poll() if job.proc else 0
                if code is None:
                    running = True
                    continue
                if job.proc is not None:
                    job.exits.append(code)
                    job.proc = None
                else:
                    continue
                if code == -signal.SIGKILL and plans.get(job.name):
                    job.start(*plans[job.name].pop(0))
                    running = True
                elif code != 0:
                    self.fail(f"{job.name} exited with status {code}")
            if not running:
                return
            if time.monotonic() > self.deadline:
                self.fail(f"hung: still running after {self.timeout:.0f} s")
            time.sleep(poll_s)


def env_for(**extra: str) -> dict[str, str]:
    """The environment of a job: this one, one thread, no tracking, unbuffered
    output; the faults (if any) in ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DILOCO_", "MLFLOW_", "PREFECT_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", DILOCO_TRACKING="off", **extra)
    return env


def job_argv(run_url: str, name: str, *, faulty: bool) -> list[str]:
    """``python -m workers`` for worker/aggregator ``name``, or the same through
    tests/fault_job.py when it carries faults."""
    role = ["--aggregate"] if name == "aggregator" else ["--worker", name]
    args = ["--run", run_url, *role, "--log-level", "INFO"]
    if faulty:
        return [sys.executable, FAULT_JOB, "--", *args]
    return [sys.executable, "-m", "workers", *args]


def fired(path: Path) -> list[str]:
    """The lines tests/fault_job.py wrote when its faults fired."""
    return path.read_text().splitlines() if path.exists() else []


# -- a faulty network in front of S3 -------------------------------------------------

_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
        "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade"}
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class FaultProxy:
    """A plain HTTP proxy to ``upstream`` (the S3 test server) that fails a
    ``rate`` share of the requests, each failure one of: a 503 SlowDown (the
    request never reaches the server), a connection reset before forwarding, or a
    reset after the server did the work (the client cannot tell whether a write
    happened: the case create-only commits exist for). Seeded, so a failing run
    can be replayed roughly; ``counts`` says what it did."""

    KINDS = ("503", "reset-before", "reset-after")

    def __init__(self, upstream: str, rate: float = 0.3, seed: int = 0,
                 outage_after: int = 0, outage_s: float = 0.0):
        """``outage_after``, ``outage_s``: from that request on, fail every request
        (503 or a reset before forwarding) for ``outage_s`` seconds: a short
        outage, longer than one operation's retries."""
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self.upstream = (host, int(port))
        self.rate = rate
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.outage_after, self.outage_s = outage_after, outage_s
        self.outage_at: float | None = None
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: Any) -> None:
                pass

            def _any(self) -> None:
                proxy.handle(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fate(self) -> str:
        with self.lock:
            seen = sum(self.counts.values())
            if self.outage_s and self.outage_at is None and seen >= self.outage_after:
                self.outage_at = time.monotonic()
            if self.outage_at is not None and time.monotonic() - self.outage_at < self.outage_s:
                self.counts["outage"] += 1
                return self.rng.choice(self.KINDS[:2])
            kind = (self.rng.choice(self.KINDS) if self.rng.random() < self.rate
                    else "forward")
            self.counts[kind] += 1
            return kind

    @staticmethod
    def _body(h: BaseHTTPRequestHandler) -> bytes:
        if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(h.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += h.rfile.read(size)
                h.rfile.readline()
        return h.rfile.read(int(h.headers.get("Content-Length") or 0))

    @staticmethod
    def _reset(h: BaseHTTPRequestHandler) -> None:
        """Close with RST (SO_LINGER 0): the client sees ECONNRESET."""
        with suppress(OSError):
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                    struct.pack("ii", 1, 0))
        h.close_connection = True
        with suppress(OSError):
            h.connection.close()

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        body = self._body(h)
        kind = self.fate()
        if kind == "503":
            h.send_response(503)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(SLOW_DOWN)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(SLOW_DOWN)
            return
        if kind == "reset-before":
            self._reset(h)
            return
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
        if body or h.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.request(h.command, h.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            out_headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP]
        finally:
            conn.close()
        if kind == "reset-after":
            self._reset(h)
            return
        h.send_response(resp.status, resp.reason)
        for k, v in out_headers:
            if h.command != "HEAD" and k.lower() == "content-length":
                continue
            h.send_header(k, v)
        if h.command != "HEAD":
            h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)


# -- what a run leaves ---------------------------------------------------------------


@dataclass
class Snapshot:
    """A finished run as the store holds it (see the module docstring)."""

    final: dict[int, dict[str, np.ndarray]]          # fragment -> arrays of the last round
    means: dict[tuple[int, int], str]                 # (p, r) -> sha256 of the decoded mean
    weights: dict[tuple[int, int], dict[str, float]]  # (p, r) -> the mean's weights
    checkpoints: dict[tuple[int, int], dict]          # (p, r) -> canonical checkpoint meta
    rejected: dict[tuple[int, int], dict[str, str]]   # (p, r) -> worker -> reason
    rounds: list[int]                                 # rounds per fragment (the manifest)


def snapshot(run_url: str, storage_options: dict | None = None) -> Snapshot:
    from diloco.run import latest_global, open_run
    from storage import layout
    from storage.checkpoints import committed_keys, read_checkpoint

    ex = open_run(run_url, storage_options)
    final, means, weights, checkpoints, rejected = {}, {}, {}, {}, {}
    for p, n in enumerate(ex.manifest.rounds):
        latest = latest_global(ex, p)
        assert latest is not None and latest[0] == n - 1, (
            f"fragment {p}: newest canonical checkpoint is {latest}, expected round {n - 1}")
        final[p] = read_checkpoint(ex.store, latest[1])[0]
        keys = committed_keys(ex.store, layout.global_states(p))
        for key in keys:
            r = layout.parse_round(key.rsplit("/", 1)[-1][: -len(".json")])
            checkpoints[(p, r)] = json.loads(ex.store.get(key)).get("meta", {})
        for r in range(n):
            got = ex.fetch_mean(p, r)
            assert got is not None, f"fragment {p} round {r}: no committed mean"
            means[(p, r)] = hashlib.sha256(np.ascontiguousarray(got[0]).tobytes()).hexdigest()
            weights[(p, r)] = got[1]["weights"]
            found = ex.rejections(p, r)
            if found:
                rejected[(p, r)] = found
    return Snapshot(final, means, weights, checkpoints, rejected, list(ex.manifest.rounds))


def differences(got: Snapshot, want: Snapshot) -> list[str]:
    """Where ``got`` differs from ``want``, bit for bit; [] when equal."""
    out = []
    for p, arrays in want.final.items():
        for name, value in arrays.items():
            other = got.final.get(p, {}).get(name)
            if other is None or other.dtype != value.dtype or other.shape != value.shape or (
                    other.tobytes() != value.tobytes()):
                bad = "missing" if other is None else (
                    f"{int((other != value).sum())} of {value.size} values differ")
                out.append(f"fragment {p} final {name}: {bad}")
    for key in sorted(want.means):
        if got.means.get(key) != want.means[key]:
            out.append(f"fragment {key[0]} round {key[1]}: the committed mean differs "
                       f"(weights {got.weights.get(key)}, want {want.weights[key]})")
        if got.weights.get(key) != want.weights[key]:
            out.append(f"fragment {key[0]} round {key[1]}: weights {got.weights.get(key)}, "
                       f"reference {want.weights[key]}")
    return out


def applied_once(s: Snapshot) -> list[str]:
    """Each round of each fragment has exactly one mean and one canonical
    checkpoint, recorded with the mean's weights: nothing applied twice, nothing
    skipped."""
    out = []
    for p, n in enumerate(s.rounds):
        have = sorted(r for q, r in s.checkpoints if q == p)
        if have != list(range(n)):
            out.append(f"fragment {p}: canonical checkpoints of rounds {have}, expected 0..{n-1}")
        for r in range(n):
            meta = s.checkpoints.get((p, r), {})
            if meta.get("weights") != s.weights.get((p, r)):
                out.append(f"fragment {p} round {r}: checkpoint weights {meta.get('weights')} "
                           f"but the mean's are {s.weights.get((p, r))}")
    return out


def round_arrays(run_url: str, fragment: int, round: int,
                 storage_options: dict | None = None) -> dict[str, np.ndarray]:
    """The canonical checkpoint of (fragment, round): params, momentum, residual."""
    from diloco.run import open_run
    from storage import layout
    from storage.checkpoints import read_checkpoint

    ex = open_run(run_url, storage_options)
    return read_checkpoint(ex.store, layout.global_commit(fragment, round))[0]


def canonical_eval(run_url: str, storage_options: dict | None = None) -> float:
    """The canonical model's mean loss on the run's validation batches."""
    import torch

    from diloco.run import load_canonical, open_run, plan_for
    from workers.config import RunConfig
    from workers.data.streams import open_dataset, val_batches
    from workers.loop import evaluate
    from workers.model import build_model

    ex = open_run(run_url, storage_options)
    cfg = RunConfig.stored(ex.manifest.config)
    model = build_model(cfg.model_config_resolved, seed=cfg.train.seed)
    load_canonical(ex, plan_for(model, cfg.sync), model)
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), f"canonical {name} is not finite"
    val = val_batches(open_dataset(cfg.dataset_url(run_url), storage_options),
                      seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size,
                      num_batches=cfg.train.eval_batches)
    return evaluate(model, val, torch.device("cpu"))
