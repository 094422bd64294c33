"""The contenders of a benchmark and how one is run, start to end: the run, its
workers, its score.

- what a contender is (``Contender``): data-parallel, or a synchronisation mode
  (``recipe.MODES``) with a codec pair (``recipe.CODECS``), M workers, an outer
  learning rate and momentum; ``load`` gives its RunConfig on top of the recipe;
- running one: any strategy as one process per worker (``benchmarks.timed_worker``),
  the aggregator in a thread, the canonical model evaluated at the end
  (``run_contender``, ``run_processes``, ``canonical_eval``);
- what it produced (``Outcome``), kept across an interrupted benchmark (``Cache``),
  and where its runs live meanwhile (``Workdir``).

Data-parallel is the real ``train.strategy=data_parallel`` of workers/loop.py, one
process per rank, gloo over TCP, started the way torchrun starts its ranks (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment, ``env://`` rendezvous) but
without torchrun's agent, so that each rank can be put in its own network namespace.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks import timed_worker
from benchmarks.measurements import summarise_traffic
from benchmarks.recipe import CODECS, MODES

log = logging.getLogger("benchmarks")


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
        # a codec pair may set its own H (the sparse ones sync more often): it comes last
        out += [*MODES[self.mode], f"sync.schedule.sync_every={self.sync_every}", *CODECS[self.codec]]
        if self.fragments is not None:
            out.append(f"sync.schedule.fragments={self.fragments}")
        if self.outer_lr is not None:
            out.append(f"sync.outer.lr={self.outer_lr}")
        if self.outer_momentum is not None:
            out.append(f"sync.outer.momentum={self.outer_momentum}")
        return [*out, *self.extra]

    def with_outer(self, lr: float | None, mu: float | None) -> Contender:
        return replace(self, outer_lr=lr, outer_momentum=mu)


def load(contender: Contender, base: Sequence[str]):
    """The RunConfig of ``contender`` on top of the ``base`` overrides of tiny."""
    from workers.config import load_config  # noqa: PLC0415

    return load_config("tiny", [*base, *contender.overrides()])


# -- running one ---------------------------------------------------------------------


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
    from diloco.aggregator import Aggregator  # noqa: PLC0415
    from diloco.run import open_run  # noqa: PLC0415
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
            agg = Aggregator(open_run(ObjectStore(run_url, storage_options=storage_options,
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


def canonical_eval(run_url: str, cfg, storage_options: dict | None = None,
                   device: Any = None) -> float:
    """Eval loss of the run's canonical model: the aggregator's outer parameters after
    every round (docs/algorithms.md section 6, last point), on the workers' val batches,
    on the CPU (or ``device``: a GPU evaluates in bf16 autocast, as its workers do)."""
    import torch  # noqa: PLC0415

    from diloco.run import load_canonical, open_run, plan_for  # noqa: PLC0415
    from workers.data.streams import open_dataset, val_batches  # noqa: PLC0415
    from workers.loop import evaluate  # noqa: PLC0415
    from workers.model import build_model  # noqa: PLC0415

    ex = open_run(run_url, storage_options)
    model = build_model(cfg.model_config_resolved, seed=cfg.train.seed)
    plan = plan_for(model, cfg.sync)
    load_canonical(ex, plan, model)
    data = open_dataset(cfg.dataset_url(run_url), storage_options)
    val = val_batches(data, seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size,
                      num_batches=cfg.train.eval_batches)
    device = torch.device(device or "cpu")
    return evaluate(model.to(device), val, device)


def tracking_hooks(run_url: str, cfg, storage_options: dict | None = None) -> Any:
    """The run's MLflow hooks (`tracking.mlflow_hooks.hooks_for`; no-op hooks when
    tracking is off), or None if they cannot be built. A failure here never stops a
    benchmark."""
    from tracking.mlflow_hooks import hooks_for  # noqa: PLC0415 - mlflow

    try:
        hooks = hooks_for(run_url, role="train", storage_options=storage_options)
        hooks.run_started(cfg.model_dump(mode="json"), run_url, resumed=False,
                          n_params=cfg.model_config_resolved.num_parameters())
        return hooks
    except Exception as exc:  # noqa: BLE001 - tracking is best effort
        log.warning("MLflow hooks unavailable for %s: %s", run_url, exc)
        return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -- around the runs -----------------------------------------------------------------


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
