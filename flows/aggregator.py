"""The aggregator job: the core's `diloco.Aggregator` as a restartable service.

    python -m flows.aggregator --run URL

It reduces every round of every fragment, writes ``members/aggregator/status.json``
(rounds, total_rounds, rejected, the canonical model's eval loss) and evaluates the
canonical model on the run's validation batches (the workers' own: same seq_len,
batch_size and eval_batches) each time every fragment has advanced one more round,
i.e. every P rounds, and at the end. Each round goes to the tracking hooks.

All its state is in the store: killed and started again, it resumes from the last
canonical checkpoints in ``global/``. On the run's cancel request it keeps reducing
until the workers have stopped (so their last rounds land) and then stops; on
SIGTERM it stops at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

from prefect import flow, get_run_logger
from prefect.exceptions import MissingContextError
from prefect.states import Cancelled

from diloco.aggregator import Aggregator, RoundReport, Stall
from diloco.run import load_initial, open_run, plan_for
from flows import launcher_gone
from flows.control import cancel_request, shard_board, watching
from flows.jobs import (
    EXIT_CODES,
    EXIT_USAGE,
    close_hooks,
    flow_log,
    job_hooks,
    print_result,
    refuse_secret_parameters,
    run_id_of,
    set_state,
    stop_on_signals,
    usage_errors,
)
from storage import layout
from storage.exchange import Exchange
from storage.objectstore import ObjectStore
from storage.reach import JOB_START_PATIENCE_S, REACH_POLICY
from tracking.hooks import Hooks
from workers.memory import fixed_mmap_threshold
from workers.report import TRAFFIC_KEYS, party_meter
from workers.status import StatusBoard, read_all, read_status

log = logging.getLogger(__name__)

NAME = "aggregator"
#: After a cancel request, how long the aggregator waits for the workers to stop.
DRAIN_S = 120.0
#: A shard job (1..K-1) writes its status after a poll at most this often: its last
#: poll, so a dead shard's status ages (`shard_board`).
SHARD_HEARTBEAT_S = 5.0
#: After SIGTERM/SIGINT, the same, within the grace period of those who send them
#: (Prefect kills a cancelled flow run's process 30 s after SIGTERM). A second
#: signal stops it at once.
SIGNAL_DRAIN_S = 20.0


class CanonicalEval:
    """The canonical model on the run's validation batches: the aggregator's own
    (K = 1), or, with a sharded aggregator (each shard holds a slice), the whole
    canonical checkpoints shard 0 assembles from the K parts (`at`)."""

    def __init__(self, exchange: Exchange, run_url: str, storage_options: dict | None):
        import torch  # noqa: PLC0415

        from workers.config import RunConfig  # noqa: PLC0415
        from workers.data.streams import open_dataset, val_batches  # noqa: PLC0415
        from workers.model import build_model  # noqa: PLC0415

        cfg = RunConfig.model_validate(exchange.manifest.config)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.model = build_model(cfg.model_config_resolved, seed=cfg.train.seed)
        self.plan = plan_for(self.model, cfg.sync)
        self.plan.check_against([f.model_dump() for f in exchange.manifest.fragments])
        dataset = open_dataset(cfg.dataset_url(run_url), storage_options)
        self.val = val_batches(dataset, seq_len=cfg.data.seq_len,
                               batch_size=cfg.data.batch_size,
                               num_batches=cfg.train.eval_batches)

    def __call__(self, agg: Aggregator) -> float:
        return self.of([agg.canonical(p) for p in range(len(self.plan))])

    def of(self, fragments: list) -> float:
        """The eval loss of the model made of these fragments (flat float32 each)."""
        import torch  # noqa: PLC0415

        from workers.inner import evaluate  # noqa: PLC0415

        for p, flat in enumerate(fragments):
            self.plan.scatter(self.model, p, torch.as_tensor(flat))
        return evaluate(self.model, self.val, torch.device("cpu"))

    def at(self, store: ObjectStore, rounds: list[int]) -> float | None:
        """The eval loss of the canonical model after round ``rounds[p]`` of every
        fragment ``p``, read from its whole checkpoints (None while one is not
        committed, or when retention deleted it)."""
        from storage.checkpoints import read_checkpoint  # noqa: PLC0415

        keys = [layout.global_commit(p, r) for p, r in enumerate(rounds)]
        if not all(store.exists(k) for k in keys):
            return None
        return self.of([read_checkpoint(store, k)[0]["params"] for k in keys])


def run_aggregator_job(
    run_url: str,
    storage_options: dict | None = None,
    *,
    stop: threading.Event | None = None,
    hooks: Hooks | None = None,
    evaluate: bool = True,
    exit_with_parent: bool = False,
    cancel_poll_s: float = 2.0,
    drain_s: float = DRAIN_S,
) -> dict[str, Any]:
    """Aggregate the run at ``run_url`` until every round is reduced or it is
    stopped; returns ``{"state", "rounds", "total_rounds", "rejected", "eval_loss"}``."""
    exchange = open_run(run_url, storage_options, patience_s=JOB_START_PATIENCE_S,
                        retry=REACH_POLICY, what="run_url")  # before anything is written
    stop = stop or threading.Event()
    hooks = hooks or job_hooks(run_url, NAME, storage_options)
    status_store = ObjectStore(run_url, storage_options=storage_options, name="aggregator-status")
    board = StatusBoard(status_store, NAME)
    manifest = exchange.manifest
    total = sum(manifest.rounds)
    cancelled = threading.Event()

    def drain(_request: dict | None, seconds: float = drain_s) -> None:
        """Keep reducing until the workers stopped (at most ``seconds``), then stop."""
        if _request is not None:
            cancelled.set()

        def wait_for_workers() -> None:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and not stop.is_set():
                states = read_all(status_store, manifest.workers)
                if all((s or {}).get("state") != "running" for s in states.values()):
                    break
                time.sleep(1.0)
            stop.set()

        threading.Thread(target=wait_for_workers, name="drain", daemon=True).start()

    try:
        # sharded (K > 1): shard 0 evaluates the whole checkpoints once assembled
        sharded = exchange.shards > 1
        evaluator = CanonicalEval(exchange, run_url, storage_options) if evaluate else None
        from workers.config import RunConfig  # noqa: PLC0415 - torch is slow to import

        cfg = RunConfig.model_validate(manifest.config)
        kwargs = {"keep_checkpoints": cfg.train.keep_checkpoints,
                  "slots": cfg.data.slot_count(len(manifest.workers))}
        if exchange.shards > 1:  # shard 0 of K: it decides; `run_shard_job` runs the rest
            from diloco.shards import ShardAggregator  # noqa: PLC0415

            agg = ShardAggregator(exchange, shard=0, **kwargs)
        else:
            agg = Aggregator(exchange, **kwargs)
    except Exception as exc:
        set_state(status_store, NAME, "failed", error=f"{type(exc).__name__}: {exc}")
        close_hooks(hooks)
        raise
    board.register(total_rounds=total, resumed_at=sum(agg.next_round))
    evaluated_at = [-1]  # the level (rounds every fragment has) of the last evaluation
    last_eval: dict[str, Any] = {}
    previous = read_status(status_store, NAME) or {}
    # participation, counted as rounds are applied and kept across restarts
    counted = {"rounds_by_worker": dict.fromkeys(manifest.workers, 0), "counted_rounds": 0,
               "participants_total": 0, "expected_total": 0, "on_time_total": 0,
               "late_total": 0, "dropped_total": 0, "absent_total": 0}
    if previous.get("rounds_by_worker"):
        counted.update({k: previous[k] for k in counted if k in previous})
    # the bytes it moves, cumulative across restarts like the workers' (each life adds
    # what the previous status recorded); its canonical checkpoints apart, as they are
    # most of it
    moved_before = {k: int(previous.get(k) or 0) for k in TRAFFIC_KEYS}
    # its bill: the exchange's and the status board's requests and bytes, cumulative too
    meter = party_meter(cfg, NAME, [exchange.store], board)

    def moved() -> dict[str, int]:
        t = exchange.store.traffic
        ckpt = sum(c.bytes_up for cat, c in t.by_category().items()
                   if cat.startswith(layout.CANONICAL_STATES))
        now = {"bytes_up": t.bytes_up, "bytes_down": t.bytes_down, "bytes_checkpoints": ckpt}
        return {**{k: moved_before[k] + now[k] for k in TRAFFIC_KEYS}, **meter.figures()}
    if "initial_eval_loss" in previous:  # kept across restarts
        last_eval["initial_eval_loss"] = previous["initial_eval_loss"]
    elif evaluator is not None and sum(agg.next_round) == 0:
        # the baseline the rounds improve on (a shard's canonical is only its slice)
        last_eval["initial_eval_loss"] = (evaluator.of(load_initial(exchange, len(agg.outer)))
                                          if sharded else evaluator(agg))
    #: sharded: the rounds (per fragment) of evaluations due, in order, each done once
    #: shard 0 has assembled the whole checkpoints of those rounds (a round or so later)
    pending: list[list[int]] = []
    eval_store = ObjectStore(run_url, storage_options=storage_options, name="aggregator-eval")

    def evaluated(loss: float, rounds: list[int]) -> dict[str, Any]:
        last_eval.update(eval_loss=loss, perplexity=math.exp(min(loss, 50.0)),
                         eval_round=sum(r + 1 for r in rounds))
        log.info("aggregator: canonical model after %d of %d rounds: eval loss %.4f",
                 last_eval["eval_round"], total, loss)
        return dict(last_eval)

    def maybe_evaluate(final: bool = False) -> dict[str, Any]:
        level = min(agg.next_round)
        if evaluator is None:
            return {}
        if final:
            if last_eval.get("eval_round") == sum(agg.next_round) or (
                    pending and sum(r + 1 for r in pending[-1]) == sum(agg.next_round)):
                return {}
        elif level <= evaluated_at[0] or level == 0:
            return {}
        evaluated_at[0] = level
        rounds = [n - 1 for n in agg.next_round]
        if sharded:
            pending.append(rounds)
            return {}
        return evaluated(evaluator(agg), rounds)

    def evaluate_pending() -> None:
        """Sharded: the evaluations due whose checkpoints are assembled, logged as the
        round's report would have carried them (at the same step), in order."""
        while pending:
            loss = evaluator.at(eval_store, pending[0])
            if loss is None and all(exchange.store.exists(layout.global_commit(p, r + 1))
                                    for p, r in enumerate(pending[0])):
                log.warning("aggregator: no canonical checkpoint of rounds %s left to "
                            "evaluate (train.keep_checkpoints)", pending[0])
                pending.pop(0)
                continue
            if loss is None:
                return
            report = evaluated(loss, pending.pop(0))
            hooks.aggregator_eval({**report, "rounds": report["eval_round"]})
            flow_log("canonical model after %d of %d rounds: eval loss %.4f",
                     report["eval_round"], total, loss)

    def on_round(report: RoundReport) -> None:
        present = [w for w in report.weights if "@" not in w]  # on time; joiners too
        # a late contribution (``w@r``, applied in this mean) counts for its round
        applied = [w.partition("@")[0] for w in report.weights]
        for w in applied:
            counted["rounds_by_worker"][w] = counted["rounds_by_worker"].get(w, 0) + 1
        counted["counted_rounds"] += 1
        counted["participants_total"] += len(applied)
        counted["expected_total"] += max(report.expected, len(present))
        # each expected contribution ends once: in its round's mean (on time), in a
        # later one (late), past max_staleness (dropped) or never committed (absent)
        counted["on_time_total"] += len(present)
        counted["late_total"] += report.late
        counted["dropped_total"] += report.dropped
        counted["absent_total"] += report.absent
        if pending:
            evaluate_pending()
        now = maybe_evaluate()
        progress("running", force=True)  # a small write per round: the counts stay exact
        traffic = moved()
        hooks.aggregator_round({**asdict(report), **now, **traffic})
        evaluated_text = (f"; canonical eval loss {now['eval_loss']:.4f}"
                          if "eval_loss" in now else "")
        rejected = (f" ({len(report.rejected)} rejected: {', '.join(report.rejected)})"
                    if report.rejected else "")
        late = (f" (+{report.late} late)" if report.late else "") + (
            f" ({report.dropped} dropped as stale)" if report.dropped else "")
        flow_log("round %d of fragment %d applied (%d of %d rounds): %d of %d members%s%s%s; "
                 "aggregator up %.2f MB, down %.2f MB", report.round, report.fragment,
                 sum(agg.next_round), total, len(present),
                 report.expected or len(manifest.workers), late, rejected,
                 evaluated_text, traffic["bytes_up"] / 1e6, traffic["bytes_down"] / 1e6)

    stalled: list[dict[str, Any]] = []

    def on_stall(stalls: list[Stall]) -> None:
        """A run must never wait silently: who is missing, since when, in the status
        board (`diloco status`), MLflow, and the Prefect flow run's log."""
        stalled[:] = [{**asdict(s), "text": s.describe()} for s in stalls]
        progress("running", force=True)
        hooks.aggregator_stalled(list(stalled))
        if stalled:
            prefect_log("aggregator stalled: " + "; ".join(s["text"] for s in stalled))

    def progress(state: str, force: bool = False, **extra: Any) -> None:
        board.update(state, force=force, rounds=sum(agg.next_round), total_rounds=total,
                     rejected=agg.stats.rejected, stalled=stalled, **counted, **last_eval,
                     **moved(), **extra)

    agg.on_round = on_round
    agg.on_stall = on_stall
    progress("running", force=True)
    try:
        # A signal usually comes with the workers' own (a cancelled parent, a pool
        # shutting down): reduce their last rounds first, so none stays blocked.
        with watching(status_store, drain, stop, interval=cancel_poll_s,
                      exit_with_parent=exit_with_parent), \
                stop_on_signals(stop, first=lambda: drain(None, SIGNAL_DRAIN_S)):
            agg.run(stop)
            if agg.done:
                final = maybe_evaluate(final=True)
                evaluate_pending()  # done: every whole checkpoint is assembled
                if final:
                    flow_log("canonical model after all %d rounds: eval loss %.4f",
                             sum(agg.next_round), final["eval_loss"])
                    hooks.aggregator_eval({**final, "rounds": sum(agg.next_round),
                                           "final": True})
    except Exception as exc:
        set_state(status_store, NAME, "failed", error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        not_logged = close_hooks(hooks)
    if agg.done:
        state = "finished"
    elif cancelled.is_set() or cancel_request(status_store) is not None:
        state = "cancelled"
    else:
        state = "interrupted"
    # the final status also says what tracking could not log, for the train job's report
    lost = {"not_logged": not_logged} if not_logged else {}
    progress(state, force=True, **lost)
    return {"state": state, "rounds": sum(agg.next_round), "total_rounds": total,
            "rejected": agg.stats.rejected, **last_eval, **lost}


def run_shard_job(run_url: str, storage_options: dict | None = None, *, shard: int,
                  stop: threading.Event | None = None, exit_with_parent: bool = False,
                  cancel_poll_s: float = 2.0) -> dict[str, Any]:
    """Shard ``shard`` >= 1 of a sharded aggregator (``aggregator.shards``): reduce its
    slice of every round, following shard 0's decisions (`diloco.shards`), until every
    round is reduced or it is stopped. Shard 0 is the aggregator job itself (status,
    evaluation, tracking); this one only reduces. On the run's cancel request it keeps
    following until shard 0 has stopped (so the rounds it decided get their parts)."""
    from diloco.shards import ShardAggregator  # noqa: PLC0415

    exchange = open_run(run_url, storage_options, patience_s=JOB_START_PATIENCE_S,
                        retry=REACH_POLICY, what="run_url")
    if not 1 <= shard < exchange.shards:
        raise ValueError(f"--shard must be in 1..{exchange.shards - 1} for a run with "
                         f"aggregator.shards = {exchange.shards}, got {shard}")
    stop = stop or threading.Event()
    status_store = ObjectStore(run_url, storage_options=storage_options, name="aggregator-status")
    board = StatusBoard(status_store, shard_board(shard))
    total = sum(exchange.manifest.rounds)
    try:
        agg = ShardAggregator(exchange, shard=shard)
    except Exception as exc:
        set_state(status_store, board.name, "failed", error=f"{type(exc).__name__}: {exc}")
        raise
    board.register(shard=shard, resumed_at=sum(agg.next_round))
    heartbeat = max(SHARD_HEARTBEAT_S, agg.config.poll_max_s)
    stalled: list[dict[str, Any]] = []

    def progress(state: str = "running", force: bool = False, **extra: Any) -> None:
        """Its rounds and, every ``heartbeat`` s at most, its last poll (the status's
        ``updated``): a shard that stops polling (a dead job) shows in diloco status."""
        board.update(state, force=force, min_interval=heartbeat, shard=shard,
                     rounds=sum(agg.next_round), total_rounds=total, stalled=stalled,
                     heartbeat_s=heartbeat, **extra)

    def on_stall(stalls: list[Stall]) -> None:
        stalled[:] = [{**asdict(s), "text": s.describe()} for s in stalls]
        progress(force=True)

    poll = agg.poll_once

    def polled() -> bool:
        progressed = poll()
        progress(force=progressed)
        return progressed

    agg.poll_once, agg.on_stall = polled, on_stall
    progress(force=True)

    def after_shard_0(_request: dict | None) -> None:
        def wait() -> None:
            deadline = time.monotonic() + DRAIN_S + 30.0
            while time.monotonic() < deadline and not stop.is_set():
                if (read_status(status_store, NAME) or {}).get("state") != "running":
                    break
                time.sleep(1.0)
            stop.set()

        threading.Thread(target=wait, name="follow-shard-0", daemon=True).start()

    try:
        with watching(status_store, after_shard_0, stop, interval=cancel_poll_s,
                      exit_with_parent=exit_with_parent), stop_on_signals(stop):
            agg.run(stop)
    except Exception as exc:
        progress("failed", force=True, error=f"{type(exc).__name__}: {exc}")
        raise
    state = ("finished" if agg.done else
             "cancelled" if cancel_request(status_store) is not None else "interrupted")
    progress(state, force=True)
    return {"state": state, "shard": shard, "rounds": sum(agg.next_round),
            "total_rounds": total}


def prefect_log(message: str) -> None:
    """A warning in the Prefect flow run's log, when the job runs as a flow run (a
    job started by the local launcher has none; its own log has the line)."""
    with contextlib.suppress(MissingContextError):
        get_run_logger().warning(message)


def aggregator_run_name() -> str:
    """``<run id>/aggregator``: the name of the aggregator's flow run."""
    from prefect.runtime import flow_run  # noqa: PLC0415

    params = flow_run.parameters or {}
    shard = f"-s{params['shard']}" if params.get("shard") else ""
    return f"{run_id_of(params.get('run_url'))}/{NAME}{shard}"


@flow(name="aggregator", log_prints=True, flow_run_name=aggregator_run_name)
def aggregator(run_url: str, storage_options: dict | None = None, evaluate: bool = True,
               shard: int = 0):
    """The run's aggregator: reduces every round and steps the canonical model;
    restartable at any moment (it resumes from the store). ``shard`` >= 1: one more
    shard of a sharded aggregator (``aggregator.shards``), one flow run each."""
    refuse_secret_parameters(storage_options)
    if shard:
        out = run_shard_job(run_url, storage_options, shard=shard)
        if out["state"] != "finished":
            return Cancelled(message=f"aggregator shard {shard} {out['state']}")
        return out
    out = run_aggregator_job(run_url, storage_options, evaluate=evaluate)
    if out["state"] != "finished":
        return Cancelled(message=f"aggregator {out['state']} after {out['rounds']} of "
                                 f"{out['total_rounds']} rounds")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.aggregator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="the run's URL")
    p.add_argument("--no-eval", action="store_true", help="do not evaluate the canonical model")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop if the launching process dies")
    p.add_argument("--shard", type=int, default=0,
                   help="a sharded aggregator's shard (aggregator.shards > 1); 0 is this job")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    if args.exit_with_parent and launcher_gone():
        log.warning("aggregator: the launcher died while this job started; exiting")
        return EXIT_CODES["interrupted"]
    options = json.loads(os.environ.get("DILOCO_STORAGE_OPTIONS") or "null")
    fixed_mmap_threshold()  # freed fragment-sized arrays go back to the system
    try:
        if args.shard:
            out = run_shard_job(args.run, options, shard=args.shard,
                                exit_with_parent=args.exit_with_parent)
        else:
            out = run_aggregator_job(args.run, options, evaluate=not args.no_eval,
                                     exit_with_parent=args.exit_with_parent)
    except usage_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - one line a user can act on
        if args.log_level == "DEBUG":
            raise
        log.error("aggregator failed: %s: %s", type(exc).__name__, exc)
        return EXIT_CODES["failed"]
    print_result(out)
    return EXIT_CODES[out["state"]]


if __name__ == "__main__":
    sys.exit(main())
