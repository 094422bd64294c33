"""One contender of a benchmark, run start to end: the run, its workers, its result.

The benchmarks compare training strategies on the same model, data, seed and token
budget. This module holds what they share:

- the reference recipe (``reference_overrides``): a 0.89M-parameter byte-level
  Llama on the installed Shakespeare corpus, close to the 0.87M reference model of
  ALGORITHMS.md section 7;
- the contenders (``Contender``): data-parallel, or a synchronisation mode (``MODES``)
  with a codec pair (``CODECS``), M workers, an outer learning rate and momentum;
- running one: DiLoCo workers as threads of this process (``run_threads``), or any
  strategy as one process per worker (``benchmarks.timed_worker``), the aggregator
  in a thread, the canonical model evaluated at the end (``canonical_eval``);
- a moto S3 server bound to any local address (``MotoServer``);
- reports: JSON and Markdown under ``benchmarks/results/`` (``write_report``).

Data-parallel is the real ``train.strategy=data_parallel`` of workers/train.py, one
process per rank, gloo over TCP, started the way torchrun starts its ranks (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment, ``env://`` rendezvous) but
without torchrun's agent, so that each rank can be put in its own network namespace.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
log = logging.getLogger("benchmarks")

# About the reference model of ALGORITHMS.md section 7 (0.87M parameters, byte level):
# 4 blocks of width 128, 4 heads, SwiGLU 384: 885,888 parameters.
REFERENCE_MODEL = "{d_model: 128, n_layers: 4, n_heads: 4, max_seq_len: 128}"


def reference_overrides(steps: int = 600, data_url: str | None = None) -> list[str]:
    """The quality recipe: tiny's optimizer, the reference model, 16 x 64 tokens a step."""
    out = [
        f"model.overrides={REFERENCE_MODEL}",
        "data.seq_len=64",
        "data.batch_size=16",
        "optim.lr=3e-3",
        "optim.warmup_steps=30",
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.eval_batches=32",
        "train.checkpoint_every=0",
        "train.log_every=10",
        "train.threads=1",
        "train.seed=0",
    ]
    if data_url:
        out.append(f"data.dataset={data_url}")
    return out


# Synchronisation modes (ALGORITHMS.md sections 2-4); H is set per contender.
MODES: dict[str, list[str]] = {
    "diloco": ["sync.mode=diloco", "sync.fragments=1", "sync.overlap=0"],
    "streaming": ["sync.mode=streaming", "sync.fragments=2", "sync.overlap=1",
                  "sync.alpha=0.5"],
    "eager": ["sync.mode=eager", "sync.eager_rule=adaptive", "sync.fragments=2",
              "sync.overlap=1", "sync.alpha=0.5"],
    "pure-eager": ["sync.mode=eager", "sync.eager_rule=pure", "sync.fragments=2",
                   "sync.overlap=0"],
}
MODE_LABELS = {
    "data-parallel": "data-parallel",
    "diloco": "DiLoCo (blocking)",
    "streaming": "streaming (tau=1, alpha=0.5)",
    "eager": "adaptive eager (tau=1, alpha=0.5)",
    "pure-eager": "pure eager (paper's rule)",
}
# Error feedback stays at the product default: on for int4 up, off for int8 down.
CODECS: dict[str, list[str]] = {
    "fp32": ["sync.codec_up=none", "sync.codec_down=none"],
    "int4": ["sync.codec_up=int4", "sync.codec_down=int8"],
}
CODEC_LABELS = {"fp32": "float32", "int4": "int4 up / int8 down"}


@dataclass(frozen=True)
class Contender:
    """One strategy in one benchmark: ``mode`` is ``data-parallel`` or a key of MODES."""

    mode: str
    codec: str = "fp32"
    workers: int = 2
    sync_every: int = 50
    fragments: int | None = None  # default: the mode's
    outer_lr: float | None = None  # default: the mode's (diloco/config.py)
    outer_momentum: float | None = None
    extra: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode != "data-parallel" and self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: allowed data-parallel, {', '.join(MODES)}")
        if self.codec not in CODECS:
            raise ValueError(f"codec {self.codec!r}: allowed {', '.join(CODECS)}")

    @property
    def name(self) -> str:
        if self.mode == "data-parallel":
            return f"data-parallel M={self.workers}"
        parts = [self.mode, self.codec, f"M={self.workers}", f"H={self.sync_every}"]
        if self.fragments is not None:
            parts.append(f"P={self.fragments}")
        if self.outer_lr is not None or self.outer_momentum is not None:
            parts.append(f"lr={self.outer_lr} mu={self.outer_momentum}")
        return " ".join(parts)

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.name.lower()).strip("-")

    def overrides(self) -> list[str]:
        workers = "[" + ", ".join(f"w{i}" for i in range(self.workers)) + "]"
        out = [f"workers={workers}", f"name=bench-{self.slug}"[:60]]
        if self.mode == "data-parallel":
            return [*out, "train.strategy=data_parallel", *self.extra]
        out += [*MODES[self.mode], *CODECS[self.codec], f"sync.sync_every={self.sync_every}"]
        if self.fragments is not None:
            out.append(f"sync.fragments={self.fragments}")
        if self.outer_lr is not None:
            out.append(f"sync.outer_lr={self.outer_lr}")
        if self.outer_momentum is not None:
            out.append(f"sync.outer_momentum={self.outer_momentum}")
        return [*out, *self.extra]

    def with_outer(self, lr: float | None, mu: float | None) -> Contender:
        return replace(self, outer_lr=lr, outer_momentum=mu)


def load(contender: Contender, base: Sequence[str]):
    """The RunConfig of ``contender`` on top of the ``base`` overrides of tiny."""
    from workers.config import load_config  # noqa: PLC0415

    return load_config("tiny", [*base, *contender.overrides()])


# -- data and stores ------------------------------------------------------------------


def default_data_dir() -> Path:
    return Path(tempfile.gettempdir()) / "diloco-bench-data"


def ensure_dataset(where: Path | None = None) -> str:
    """The byte-level Shakespeare dataset, prepared once into a local directory."""
    from workers.data import DatasetMissing, open_dataset, prepare_data  # noqa: PLC0415

    where = (where or default_data_dir()) / "shakespeare-byte"
    url = where.as_uri()
    try:
        open_dataset(url)
    except DatasetMissing:
        log.info("preparing byte-level Shakespeare at %s", where)
        where.parent.mkdir(parents=True, exist_ok=True)
        prepare_data(["builtin:shakespeare"], url, tokenizer="byte", val_fraction=0.01)
    return url


class MotoServer:
    """moto's S3 server in a child process, bound to ``host`` (any local address:
    loopback, or a bridge's address so that namespaces reach it over capped links)."""

    KEY = SECRET = "testing"
    REGION = "us-east-1"
    _SERVE = (
        "import logging, sys\n"
        "from moto.server import ThreadedMotoServer\n"
        "logging.getLogger('werkzeug').setLevel(logging.ERROR)\n"
        "s = ThreadedMotoServer(ip_address=sys.argv[1], port=0, verbose=False)\n"
        "s.start()\n"
        "print('PORT', s.get_host_and_port()[1], flush=True)\n"
        "sys.stdin.read()\n"
        "s.stop()\n"
    )

    def __init__(self, host: str = "127.0.0.1", prefix: Sequence[str] = ()):
        self.host = host
        self.prefix = list(prefix)
        self.endpoint_url = ""
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> MotoServer:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": self.KEY,
               "AWS_SECRET_ACCESS_KEY": self.SECRET, "AWS_DEFAULT_REGION": self.REGION}
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-c", self._SERVE, self.host],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if len(line) != 2 or line[0] != "PORT":
            self.__exit__(None, None, None)
            raise RuntimeError(f"moto server on {self.host} did not start (said {line})")
        self.endpoint_url = f"http://{self.host}:{line[1]}"
        return self

    def __exit__(self, *exc: object) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.stdin:
                proc.stdin.close()
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def options(self, endpoint_url: str | None = None) -> dict[str, Any]:
        return {"endpoint_url": endpoint_url or self.endpoint_url, "key": self.KEY,
                "secret": self.SECRET, "client_kwargs": {"region_name": self.REGION}}

    def new_bucket(self, name: str | None = None) -> str:
        import boto3  # noqa: PLC0415

        name = name or f"bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.KEY,
                     aws_secret_access_key=self.SECRET,
                     region_name=self.REGION).create_bucket(Bucket=name)
        return name


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -- traffic ---------------------------------------------------------------------------


def summarise_traffic(snapshot: dict[str, Any]) -> dict[str, Any]:
    """A TrafficCounter snapshot split into the exchange (``frag/...``, per fragment
    round) and the rest (manifest, initial parameters, dataset reads are not here)."""
    rounds: dict[str, dict[str, int]] = {}
    exchange = {"requests": 0, "bytes_up": 0, "bytes_down": 0}
    for cat, t in snapshot["by_category"].items():
        if not cat.startswith("frag/"):
            continue
        for k in exchange:
            exchange[k] += t[k]
        parts = cat.split("/")
        if len(parts) >= 3:
            key = f"{parts[1]}/{parts[2]}"
            row = rounds.setdefault(key, {"requests": 0, "bytes_up": 0, "bytes_down": 0})
            for k in row:
                row[k] += t[k]
    return {
        "total": {k: snapshot[k] for k in ("requests", "bytes_up", "bytes_down")},
        "exchange": exchange,
        "other": {k: snapshot[k] - exchange[k] for k in exchange},
        "per_round": dict(sorted(rounds.items())),
        "delta_payload_bytes": _payloads(snapshot.get("objects_up", {}), "delta"),
        "mean_payload_bytes": _payloads(snapshot.get("objects_down", {}), "mean"),
    }


def _payloads(objects: dict[str, int], kind: str) -> dict[str, int]:
    """Bytes of the ``frag/{p}/{round}/{kind}...`` objects, per fragment round."""
    out: dict[str, int] = {}
    for key, size in objects.items():
        parts = key.split("/")
        if key.startswith("frag/") and len(parts) > 3 and parts[3] == kind:
            name = f"{parts[1]}/{parts[2]}"
            out[name] = out.get(name, 0) + size
    return dict(sorted(out.items()))


# -- running a contender --------------------------------------------------------------


@dataclass
class Outcome:
    """What one contender's run produced."""

    contender: Contender
    eval_loss: float
    seconds: float
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    aggregator: dict[str, Any] = field(default_factory=dict)
    rounds: list[int] = field(default_factory=list)
    num_parameters: int = 0

    def to_dict(self) -> dict[str, Any]:
        c = self.contender
        return {"name": c.name, "mode": c.mode, "codec": c.codec, "workers": c.workers,
                "sync_every": c.sync_every, "fragments": c.fragments, "outer_lr": c.outer_lr,
                "outer_momentum": c.outer_momentum, "eval_loss": self.eval_loss,
                "seconds": self.seconds, "rounds": self.rounds,
                "num_parameters": self.num_parameters,
                "per_worker": self.workers, "aggregator": self.aggregator}


def canonical_eval(run_url: str, cfg, storage_options: dict | None = None) -> float:
    """Eval loss of the run's canonical model: the aggregator's outer parameters after
    every round (ALGORITHMS.md section 4, last point), on the workers' val batches."""
    import torch  # noqa: PLC0415

    from diloco.run import load_canonical, open_exchange, plan_for  # noqa: PLC0415
    from workers.data import open_dataset, val_batches  # noqa: PLC0415
    from workers.model import build_model  # noqa: PLC0415
    from workers.train import evaluate  # noqa: PLC0415

    ex = open_exchange(run_url, storage_options)
    model = build_model(cfg.model_config_resolved, seed=cfg.train.seed)
    plan = plan_for(model, cfg.sync)
    load_canonical(ex, plan, model)
    data = open_dataset(cfg.dataset_url(run_url), storage_options)
    val = val_batches(data, seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size,
                      num_batches=cfg.train.eval_batches)
    return evaluate(model, val, torch.device("cpu"))


def status_totals(loop) -> dict[str, int]:
    """Requests and bodies of a WorkerLoop's status object writes."""
    if loop.status is None:
        return {"requests": 0, "bytes_up": 0, "bytes_down": 0}
    snap = loop.status.store.traffic.snapshot()
    return {k: snap[k] for k in ("requests", "bytes_up", "bytes_down")}


def sync_summary(stats) -> dict[str, Any]:
    return {"wait_seconds": stats.wait_seconds, "rounds_sent": stats.rounds_sent,
            "rounds_merged": stats.rounds_merged, "late_means": stats.late_means,
            "max_staleness": max(stats.staleness, default=0),
            "waits": len(stats.waits)}


def run_processes(
    contender: Contender,
    cfg,
    run_url: str,
    *,
    storage_options: dict | None = None,
    worker_options: dict[str, dict] | None = None,
    prefixes: Sequence[Sequence[str]] | None = None,
    master: tuple[str, int] | None = None,
    ifnames: Sequence[str] | None = None,
    on_ready: Callable[[], None] | None = None,
    hooks: Any = None,
    log_dir: Path | None = None,
    timeout: float = 3600,
) -> tuple[list[dict[str, Any]], Any, float]:
    """Train an existing run: one ``benchmarks.timed_worker`` process per worker
    (``prefixes[i]``, e.g. ``ip netns exec``, runs worker i elsewhere), the aggregator
    in a thread of this process for DiLoCo, gloo for data-parallel (rank 0 hosts the
    rendezvous at ``master``, default loopback). Every worker loads the run first;
    then ``on_ready`` runs (e.g. capping the links) and all start together.

    Returns the workers' results (in order), the aggregator (None for
    data-parallel) and the wall time from the start signal to the last result.
    """
    from benchmarks import timed_worker  # noqa: PLC0415
    from diloco.aggregator import Aggregator  # noqa: PLC0415
    from diloco.run import open_exchange  # noqa: PLC0415
    from storage.objectstore import ObjectStore  # noqa: PLC0415

    dp = contender.mode == "data-parallel"
    m = len(cfg.workers)
    master = master or ("127.0.0.1", free_port())
    procs: list[subprocess.Popen[str]] = []
    agg, agg_thread, stop = None, None, threading.Event()
    agg_errors: list[BaseException] = []
    try:
        for i, worker in enumerate(cfg.workers):
            env = (timed_worker.rank_env(i, m, master[0], master[1],
                                         ifnames[i] if ifnames else None) if dp else None)
            log_file = None
            if log_dir is not None:
                log_file = open(log_dir / f"{contender.slug}-{uuid.uuid4().hex[:4]}-{i}.log",  # noqa: SIM115
                                "w")
            procs.append(timed_worker.launch(
                run_url, "auto" if dp else worker, env=env,
                prefix=prefixes[i] if prefixes else (),
                storage_options=(worker_options or {}).get(worker, storage_options),
                wait_go=True, log_file=log_file))
            if log_file is not None:
                log_file.close()  # the child holds its own descriptor
        if not dp:
            on_round = (lambda rep: hooks.aggregator_round(asdict(rep))) if hooks else None
            agg = Aggregator(open_exchange(ObjectStore(run_url, storage_options=storage_options,
                                                       name="aggregator")), on_round=on_round)

            def aggregate() -> None:
                try:
                    agg.run(stop, timeout)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    agg_errors.append(exc)
                    timed_worker.stop(procs)

            agg_thread = threading.Thread(target=aggregate, name="aggregator", daemon=True)
            agg_thread.start()
        timed_worker.wait_ready(procs)
        if on_ready is not None:
            on_ready()
        start = time.perf_counter()
        timed_worker.go(procs)
        results = timed_worker.collect(
            procs, timeout=timeout,
            on_metric=(lambda m: hooks.worker_metrics(m["worker"], m)) if hooks else None)
        wall = time.perf_counter() - start
    except BaseException:
        if agg_errors:
            raise agg_errors[0] from None
        raise
    finally:
        timed_worker.stop(procs)
        if agg_thread is not None:
            agg_thread.join(120)
        stop.set()
    if agg_errors:
        raise agg_errors[0]
    if agg is not None and not agg.done:
        raise RuntimeError(f"{contender.name}: the aggregator did not finish every round")
    if hooks:
        for r in results:
            hooks.worker_finished(r["worker"], {k: v for k, v in r.items()
                                                if not isinstance(v, dict | list)}, "finished")
    return results, agg, wall


def outcome(contender: Contender, cfg, run_url: str, results: list[dict[str, Any]], agg: Any,
            wall: float, storage_options: dict | None = None) -> Outcome:
    """The score of a trained run: data-parallel's final model (rank 0; every rank
    holds the same parameters), or DiLoCo's canonical model."""
    if agg is None:
        losses = {round(r["eval_loss"], 6) for r in results}
        if len(losses) != 1:
            log.warning("%s: ranks disagree on the eval loss: %s", contender.name, losses)
        eval_loss = results[0]["eval_loss"]
        aggregator: dict[str, Any] = {}
        rounds: list[int] = []
    else:
        eval_loss = canonical_eval(run_url, cfg, storage_options)
        aggregator = {"rounds": len(agg.stats.rounds), "rejected": agg.stats.rejected,
                      "traffic": summarise_traffic(agg.exchange.store.traffic.snapshot())["total"]}
        rounds = list(agg.manifest.rounds)
    return Outcome(contender, eval_loss, wall, {r["worker"]: r for r in results}, aggregator,
                   rounds, cfg.model_config_resolved.num_parameters())


def run_contender(contender: Contender, base: Sequence[str], workdir: Path, *,
                  mlflow: bool = True, storage_url: str | None = None,
                  storage_options: dict | None = None, **kwargs: Any) -> Outcome:
    """Create a fresh run (under ``workdir`` as file://, or under ``storage_url``) and
    train it to the end with ``run_processes``."""
    from workers.runs import create_run  # noqa: PLC0415

    cfg = load(contender, base)
    name = f"{contender.slug}-{uuid.uuid4().hex[:6]}"
    run_url = f"{storage_url.rstrip('/')}/{name}" if storage_url else (workdir / name).as_uri()
    create_run(cfg, run_url, storage_options=storage_options)
    hooks = tracking_hooks(run_url, cfg, storage_options) if mlflow else None
    try:
        results, agg, wall = run_processes(contender, cfg, run_url,
                                           storage_options=storage_options, hooks=hooks,
                                           log_dir=workdir, **kwargs)
        out = outcome(contender, cfg, run_url, results, agg, wall, storage_options)
        if hooks and agg is not None and agg.stats.rounds:
            # the canonical model's eval loss, on the aggregator's last round
            last = asdict(agg.stats.rounds[-1])
            hooks.aggregator_round({**last, "eval_loss": out.eval_loss,
                                    "perplexity": math.exp(min(out.eval_loss, 50.0))})
        if hooks:
            hooks.run_finished({"benchmark_contender": contender.name,
                                "eval_loss": out.eval_loss, "seconds": out.seconds})
        return out
    finally:
        if hooks:
            hooks.close()


def tracking_hooks(run_url: str, cfg, storage_options: dict | None = None) -> Any:
    """MLflow hooks for the run (tracking.mlflow_hooks.hooks_for), else None. A
    failure here never stops a benchmark."""
    try:
        from tracking.mlflow_hooks import hooks_for  # noqa: PLC0415
    except ImportError:
        return None
    try:
        hooks = hooks_for(run_url, role="train", storage_options=storage_options)
        hooks.run_started(cfg.model_dump(mode="json"), run_url, resumed=False,
                          n_params=cfg.model_config_resolved.num_parameters())
        return hooks
    except Exception as exc:  # noqa: BLE001 - tracking is best effort
        log.warning("MLflow hooks unavailable for %s: %s", run_url, exc)
        return None


def mlflow_status() -> str:
    """Whether contenders' runs reach MLflow, for the report."""
    try:
        import tracking.mlflow_hooks  # noqa: F401, PLC0415
    except ImportError:
        return "tracking.mlflow_hooks is not importable: no MLflow hooks"
    return "tracking.mlflow_hooks.hooks_for(run_url, role='train') per contender"


# -- reports ----------------------------------------------------------------------------


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "numpy", "zarr", "s3fs", "moto"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def environment(argv: Sequence[str] | None, module: str) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python", "-m", module,
                             *(argv if argv is not None else sys.argv[1:])]),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "versions": versions(),
        "mlflow": mlflow_status(),
    }


def write_report(name: str, report: dict[str, Any], markdown: str,
                 out_dir: Path | None = None) -> tuple[Path, Path]:
    """``{name}.json`` and ``{name}.md`` under ``out_dir`` (benchmarks/results)."""
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / f"{name}.json", out_dir / f"{name}.md"
    js.write_text(json.dumps(report, indent=2, default=str) + "\n")
    md.write_text(markdown.rstrip() + "\n")
    return js, md


def publish(name: str, report: dict[str, Any], markdown: Callable[[dict[str, Any]], str],
            out_dir: Path | None = None, *, saved: bool = False) -> dict[str, Any]:
    """Render ``report`` with ``markdown`` plus the benchmark's wall time, write
    ``{name}.json`` and ``{name}.md``, and print the Markdown. ``saved``: the
    report was read back from a JSON file (``--from-json``), only re-rendered."""
    md = markdown(report) + \
        f"\n\nWall time of the whole benchmark: {report['wall_seconds']:.0f} s.\n"
    js, mdp = write_report(name, report, md, out_dir)
    print(md)
    if not saved:
        print(f"wrote {js} and {mdp}")
    return report


def cli_logging(*noisy: str) -> None:
    """The benchmarks' command-line logging: INFO, minus the chatty libraries."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in ("workers", "diloco", "storage", *noisy):
        logging.getLogger(name).setLevel(logging.WARNING)


def md_table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; numbers right-aligned."""
    def cell(x: Any) -> str:
        return "" if x is None else str(x)

    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


class Workdir:
    """A temporary directory for the runs of one benchmark, removed at the end
    unless ``keep``."""

    def __init__(self, prefix: str, keep: bool = False):
        self.path = Path(tempfile.mkdtemp(prefix=f"diloco-{prefix}-"))
        self.keep = keep

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: object) -> None:
        if self.keep:
            log.info("runs kept in %s", self.path)
        else:
            shutil.rmtree(self.path, ignore_errors=True)


def stop_on_sigterm() -> None:
    """Turn SIGTERM into KeyboardInterrupt in the main thread, so that a killed
    benchmark runs its ``finally`` blocks: stops its worker processes and servers and
    removes its namespaces."""
    import signal  # noqa: PLC0415

    def handler(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


class Cache:
    """Finished contenders' outcomes as JSON files, so that an interrupted benchmark
    resumes (``--resume``) where it stopped. The key is the contender and the whole
    base recipe; a changed recipe is a different key."""

    def __init__(self, where: Path | None, base: Sequence[str]):
        self.where = where
        self.base = list(base)

    def _path(self, contender: Contender) -> Path | None:
        if self.where is None:
            return None
        import hashlib  # noqa: PLC0415

        key = json.dumps([contender.name, contender.overrides(), self.base])
        return self.where / f"{contender.slug}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"

    def get(self, contender: Contender) -> Outcome | None:
        path = self._path(contender)
        if path is None or not path.exists():
            return None
        d = json.loads(path.read_text())
        return Outcome(contender, d["eval_loss"], d["seconds"], d["per_worker"],
                       d["aggregator"], d["rounds"], d["num_parameters"])

    def put(self, out: Outcome) -> None:
        path = self._path(out.contender)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out.to_dict(), default=str))
        tmp.replace(path)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0
