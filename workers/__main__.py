"""Run one worker, create a run, or run the aggregator, from the command line.

    python -m workers --run URL --create [--config tiny] [--set train.steps=100 ...]
    python -m workers --run URL --worker region-a
    python -m workers --run URL --aggregate
    torchrun --nproc-per-node 2 -m workers -- --run URL --worker region-a   # a 2-process island

(The "--" keeps torchrun from reading --run as an abbreviation of its --run-path.)

A worker needs only the run's URL (and the bucket's credentials): its whole
configuration is in the run manifest. On SIGTERM or SIGINT it saves a checkpoint and
exits with status 143; started again with the same arguments, it resumes exactly. The
ranks of an island stop together, after the same step, whichever rank got the signal
(and torchrun passes a SIGTERM on to every rank); rank 0 alone prints the result line.

Credentials come from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN; AWS_ENDPOINT_URL_S3 for the endpoint), never from the command
line, where every user of the machine sees them: a --run URL carrying credentials
and a credential given as --storage-option are refused. Other storage options may
also come as JSON in DILOCO_STORAGE_OPTIONS (what a launcher passes). Before
anything is written, the store must answer, its bucket must exist, and (but for
--create) a run must be there; else one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

import yaml

EXIT_INTERRUPTED = 143


class UsageError(Exception):
    """A command line that cannot work; the message is the one line printed."""


def _options(items: list[str]) -> dict[str, Any]:
    """``DILOCO_STORAGE_OPTIONS`` (JSON, from a launcher) updated by ``--storage-option``
    items; a credential on the command line is refused."""
    from storage.backends import USE_THE_ENVIRONMENT, secret_options  # noqa: PLC0415

    out: dict[str, Any] = json.loads(os.environ.get("DILOCO_STORAGE_OPTIONS") or "{}")
    for item in items:
        if "=" not in item:
            raise UsageError(f"--storage-option {item!r}: expected key=value")
        k, v = item.split("=", 1)
        out[k] = yaml.safe_load(v)
        secrets = secret_options({k: out[k]}, "--storage-option")
        if secrets:
            name = secrets[0].removeprefix("--storage-option.")
            raise UsageError(f"--storage-option {name}: a credential on the command line is "
                             f"visible to every user of the machine (ps); {USE_THE_ENVIRONMENT}")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m workers", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--run", required=True, help="the run's URL: a path, file://, memory:// or s3://")
    action = p.add_mutually_exclusive_group(required=True)
    action.add_argument("--worker", help="train as this worker (a name from the run's workers; "
                        "'auto' under torchrun for the data-parallel baseline: rank i is worker i)")
    action.add_argument("--create", action="store_true", help="create the run from --config")
    action.add_argument("--aggregate", action="store_true", help="run the aggregator")
    p.add_argument("--config", default=None, help="a shipped recipe (tiny, small, ...) or a YAML path (--create)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. train.steps=100 (repeatable; --create)")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option, e.g. endpoint_url=http://127.0.0.1:9000")
    p.add_argument("--join", action="store_true",
                   help="with --worker: join the running run as a new member of that name")
    p.add_argument("--claim", default=None,
                   help="with --join: the id of this join (a relaunch passes the same one)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        opts = _options(args.storage_option) or None
        _check_store(args, opts)
        if args.create:
            return _create(args, opts)
        if args.aggregate:
            return _aggregate(args, opts)
        return _train(args, opts)
    except KeyboardInterrupt:
        return 130
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a message a user can act on, not a traceback
        if args.log_level == "DEBUG":
            raise
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


def _check_store(args: argparse.Namespace, opts: dict | None) -> None:
    """Before anything is written: no credentials in --run, a store that answers, a
    bucket that exists, and (to train or aggregate) a run at --run."""
    from diloco.run import open_run  # noqa: PLC0415 - torch
    from storage.backends import CredentialsInURL, refuse_credentials  # noqa: PLC0415
    from storage.errors import RunNotFound  # noqa: PLC0415
    from storage.reach import (  # noqa: PLC0415
        JOB_START_PATIENCE_S,
        REACH_POLICY,
        StoreUnreachable,
        is_url,
        reach_store,
    )

    try:
        refuse_credentials(args.run, what="--run")
        if args.create or (is_url(args.run) and not args.run.startswith("file://")):
            reach_store(args.run, opts, what="--run",  # a local one: makes the folder
                        patience_s=0.0 if args.create else JOB_START_PATIENCE_S)
        if not args.create:
            open_run(args.run, opts, patience_s=JOB_START_PATIENCE_S, retry=REACH_POLICY,
                     what="--run")
    except (CredentialsInURL, StoreUnreachable, RunNotFound) as exc:
        raise UsageError(str(exc)) from None


def _create(args: argparse.Namespace, opts: dict | None) -> int:
    from workers.config import load_config  # noqa: PLC0415
    from workers.runs import create_run  # noqa: PLC0415

    cfg = load_config(args.config, args.overrides)
    ex = create_run(cfg, args.run, storage_options=opts)
    print(json.dumps({"run": args.run, "workers": ex.manifest.workers,
                      "rounds": ex.manifest.rounds}))
    return 0


def _aggregate(args: argparse.Namespace, opts: dict | None) -> int:
    from diloco.aggregator import Aggregator  # noqa: PLC0415
    from diloco.run import open_run  # noqa: PLC0415
    from storage.objectstore import ObjectStore  # noqa: PLC0415
    from workers.status import StatusBoard  # noqa: PLC0415

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ex = open_run(ObjectStore(args.run, storage_options=opts))  # a run, or nothing written
    board = StatusBoard(ObjectStore(args.run, storage_options=opts, name="status"), "aggregator")
    board.register()
    total = sum(ex.manifest.rounds)

    def on_round(report) -> None:
        board.update("running", rounds=len(agg.stats.rounds), total_rounds=total,
                     rejected=agg.stats.rejected)

    from workers.config import RunConfig  # noqa: PLC0415

    cfg = RunConfig.stored(ex.manifest.config)
    agg = Aggregator(ex, on_round=on_round, keep_checkpoints=cfg.train.keep_checkpoints,
                     slots=cfg.data.slot_count(len(ex.manifest.workers)))
    stats = agg.run(stop)
    board.update("finished" if agg.done else "interrupted", force=True,
                 rounds=len(stats.rounds), total_rounds=total, rejected=stats.rejected)
    print(json.dumps({"rounds": len(stats.rounds), "rejected": stats.rejected,
                      "done": agg.done}))
    return 0 if agg.done else EXIT_INTERRUPTED


def _train(args: argparse.Namespace, opts: dict | None) -> int:
    import torch.distributed as dist  # noqa: PLC0415

    from workers.loop import Group, Interrupted, WorkerLoop  # noqa: PLC0415

    group = Group.from_env()
    if group.size > 1:
        import torch  # noqa: PLC0415

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if signum == signal.SIGINT and stop.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C: out now, without a checkpoint
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):  # a launcher's stop, or Ctrl-C on torchrun
        signal.signal(sig, on_signal)
    loop = WorkerLoop.open(args.run, args.worker, storage_options=opts, stop=stop, group=group,
                      metrics=_log_metrics(args.worker), join=args.join, claim=args.claim)
    try:
        result = loop.run()
    except Interrupted as exc:
        _say(loop, {"worker": loop.worker, "interrupted_after": exc.step})
        return EXIT_INTERRUPTED
    finally:
        loop.close()
        if group.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
    _say(loop, result.to_dict())
    return 0


def _say(loop, result: dict[str, Any]) -> None:
    """The result line on stdout: one per worker, so an island's rank 0 alone prints it
    (in the data-parallel baseline every rank is a worker)."""
    if loop.group.leader or loop.cfg.train.strategy == "data_parallel":
        print(json.dumps(result))


def _log_metrics(worker: str):
    log = logging.getLogger("workers.progress")

    def emit(m: dict[str, Any]) -> None:
        if "loss" in m:
            log.info("%s step %d loss %.4f lr %.2e %.0f tok/s wait %.2fs up %d B down %d B",
                     m["worker"], m["step"], m["loss"], m["lr"], m["tokens_per_s"],
                     m.get("wait_s", 0.0), m["bytes_up"], m["bytes_down"])
        elif "eval_loss" in m:
            log.info("%s step %d eval loss %.4f", m["worker"], m["step"], m["eval_loss"])

    return emit


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    from workers.group_exit import leave  # noqa: PLC0415

    leave(main())  # a rank of a group: no interpreter teardown (workers/group_exit.py)
