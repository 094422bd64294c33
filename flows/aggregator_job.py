"""The aggregator job: the core's `diloco.Aggregator` as a restartable service.

    python -m flows.aggregator --run URL

This module imports no Prefect: the local launcher starts it as ``python -m
flows.aggregator_job`` (the same job), and a work pool runs it through the
`aggregator` flow of flows/aggregator.py.

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
import json
import logging
import math
import os
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

from diloco.aggregator import Aggregator, RoundReport, Stall
from diloco.run import load_initial, open_run
from flows import launcher_gone
from flows.control import cancel_request, shard_board, watching
from flows.jobs import (
    EXIT_CODES,
    EXIT_USAGE,
    close_hooks,
    flow_log,
    job_hooks,
    print_result,
    set_state,
    stop_on_signals,
    usage_errors,
)
from storage import layout
from storage.objectstore import ObjectStore
from storage.reach import JOB_START_PATIENCE_S, REACH_POLICY
from tracking.exit_threads import record_threads_at_exit
from tracking.hooks import Hooks
from workers.memory import fixed_mmap_threshold
from workers.report import TRAFFIC_KEYS, Participation, party_meter
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
    job = AggregatorJob(run_url, storage_options, stop=stop, hooks=hooks, evaluate=evaluate,
                        drain_s=drain_s)
    return job.run(exit_with_parent=exit_with_parent, cancel_poll_s=cancel_poll_s)


class AggregatorJob:
    """The aggregator job: the `Aggregator` (or shard 0 of a sharded one) on the run,
    with what a job adds around it: its status board, participation counts, the
    canonical model's evaluations, tracking hooks, the bytes and bill it runs up,
    and draining the workers' last rounds on a cancel or a signal."""

    def __init__(self, run_url: str, storage_options: dict | None = None, *,
                 stop: threading.Event | None = None, hooks: Hooks | None = None,
                 evaluate: bool = True, drain_s: float = DRAIN_S):
        self.run_url, self.storage_options, self.drain_s = run_url, storage_options, drain_s
        self.exchange = exchange = open_run(  # before anything is written
            run_url, storage_options, patience_s=JOB_START_PATIENCE_S, retry=REACH_POLICY,
            what="run_url")
        self.stop = stop or threading.Event()
        self.hooks = hooks or job_hooks(run_url, NAME, storage_options)
        self.status_store = ObjectStore(run_url, storage_options=storage_options,
                                        name="aggregator-status")
        self.board = StatusBoard(self.status_store, NAME)
        self.manifest = exchange.manifest
        self.total = sum(self.manifest.rounds)
        self.cancelled = threading.Event()
        try:
            # sharded (K > 1): shard 0 evaluates the whole checkpoints once assembled
            self.sharded = exchange.shards > 1
            from workers.canonical import CanonicalEval  # noqa: PLC0415 - torch: slow import
            from workers.config import RunConfig  # noqa: PLC0415

            self.evaluator = (CanonicalEval(exchange, run_url, storage_options) if evaluate
                              else None)

            cfg = RunConfig.stored(self.manifest.config)
            kwargs = {"keep_checkpoints": cfg.train.keep_checkpoints,
                      "slots": cfg.data.slot_count(len(self.manifest.workers))}
            if self.sharded:  # shard 0 of K: it decides; `run_shard_job` runs the rest
                from diloco.shards import ShardAggregator  # noqa: PLC0415

                self.agg: Aggregator = ShardAggregator(exchange, shard=0, **kwargs)
            else:
                self.agg = Aggregator(exchange, **kwargs)
        except Exception as exc:
            set_state(self.status_store, NAME, "failed", error=f"{type(exc).__name__}: {exc}")
            close_hooks(self.hooks)
            raise
        self.board.register(total_rounds=self.total, resumed_at=sum(self.agg.next_round))
        #: the level (rounds every fragment has) of the last evaluation
        self.evaluated_at = -1
        self.last_eval: dict[str, Any] = {}
        previous = read_status(self.status_store, NAME) or {}
        self.participation = Participation(self.manifest.workers, previous)
        # the bytes it moves, cumulative across restarts like the workers' (each life
        # adds what the previous status recorded); its canonical checkpoints apart, as
        # they are most of it
        self.moved_before = {k: int(previous.get(k) or 0) for k in TRAFFIC_KEYS}
        # its bill: the exchange's and the status board's requests and bytes, cumulative
        self.meter = party_meter(cfg, NAME, [exchange.store], self.board)
        if "initial_eval_loss" in previous:  # kept across restarts
            self.last_eval["initial_eval_loss"] = previous["initial_eval_loss"]
        elif self.evaluator is not None and sum(self.agg.next_round) == 0:
            # the baseline the rounds improve on (a shard's canonical is only its slice)
            self.last_eval["initial_eval_loss"] = (
                self.evaluator.of(load_initial(exchange, len(self.agg.outer)))
                if self.sharded else self.evaluator(self.agg))
        #: sharded: the rounds (per fragment) of evaluations due, in order, each done
        #: once shard 0 has assembled the whole checkpoints of those rounds
        self.pending: list[list[int]] = []
        self.eval_store = ObjectStore(run_url, storage_options=storage_options,
                                      name="aggregator-eval")
        self.stalled: list[dict[str, Any]] = []

    # -- the run ------------------------------------------------------------------
    def run(self, *, exit_with_parent: bool = False, cancel_poll_s: float = 2.0
            ) -> dict[str, Any]:
        """Reduce until every round is or the job is stopped; the job's result."""
        agg = self.agg
        agg.on_round = self.on_round
        agg.on_stall = self.on_stall
        self.progress("running", force=True)
        try:
            # A signal usually comes with the workers' own (a cancelled parent, a pool
            # shutting down): reduce their last rounds first, so none stays blocked.
            with watching(self.status_store, self.drain, self.stop, interval=cancel_poll_s,
                          exit_with_parent=exit_with_parent), \
                    stop_on_signals(self.stop, first=lambda: self.drain(None, SIGNAL_DRAIN_S)):
                agg.run(self.stop)
                if agg.done:
                    self.evaluate_final()
        except Exception as exc:
            set_state(self.status_store, NAME, "failed", error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            not_logged = close_hooks(self.hooks)
        if agg.done:
            state = "finished"
        elif self.cancelled.is_set() or cancel_request(self.status_store) is not None:
            state = "cancelled"
        else:
            state = "interrupted"
        # the final status also says what tracking could not log, for the train job's report
        lost = {"not_logged": not_logged} if not_logged else {}
        self.progress(state, force=True, **lost)
        return {"state": state, "rounds": sum(agg.next_round), "total_rounds": self.total,
                "rejected": agg.stats.rejected, **self.last_eval, **lost}

    def drain(self, request: dict | None, seconds: float | None = None) -> None:
        """Keep reducing until the workers stopped (at most ``seconds``), then stop."""
        if request is not None:
            self.cancelled.set()
        deadline = time.monotonic() + (self.drain_s if seconds is None else seconds)

        def wait_for_workers() -> None:
            while time.monotonic() < deadline and not self.stop.is_set():
                states = read_all(self.status_store, self.manifest.workers)
                if all((s or {}).get("state") != "running" for s in states.values()):
                    break
                time.sleep(1.0)
            self.stop.set()

        threading.Thread(target=wait_for_workers, name="drain", daemon=True).start()

    # -- what each round adds ------------------------------------------------------
    def on_round(self, report: RoundReport) -> None:
        present = self.participation.add(report)
        if self.pending:
            self.evaluate_pending()
        now = self.maybe_evaluate()
        self.progress("running", force=True)  # a small write per round: counts stay exact
        traffic = self.moved()
        self.hooks.aggregator_round({**asdict(report), **now, **traffic})
        evaluated_text = (f"; canonical eval loss {now['eval_loss']:.4f}"
                          if "eval_loss" in now else "")
        rejected = (f" ({len(report.rejected)} rejected: {', '.join(report.rejected)})"
                    if report.rejected else "")
        late = (f" (+{report.late} late)" if report.late else "") + (
            f" ({report.dropped} dropped as stale)" if report.dropped else "")
        flow_log("round %d of fragment %d applied (%d of %d rounds): %d of %d members%s%s%s; "
                 "aggregator up %.2f MB, down %.2f MB", report.round, report.fragment,
                 sum(self.agg.next_round), self.total, len(present),
                 report.expected or len(self.manifest.workers), late, rejected,
                 evaluated_text, traffic["bytes_up"] / 1e6, traffic["bytes_down"] / 1e6)

    def on_stall(self, stalls: list[Stall]) -> None:
        """A run must never wait silently: who is missing, since when, in the status
        board (`diloco status`), MLflow, and the Prefect flow run's log."""
        self.stalled[:] = [{**asdict(s), "text": s.describe()} for s in stalls]
        self.progress("running", force=True)
        self.hooks.aggregator_stalled(list(self.stalled))
        if self.stalled:
            flow_log("aggregator stalled: %s", "; ".join(s["text"] for s in self.stalled),
                     level=logging.WARNING)

    def progress(self, state: str, force: bool = False, **extra: Any) -> None:
        self.board.update(state, force=force, rounds=sum(self.agg.next_round),
                          total_rounds=self.total, rejected=self.agg.stats.rejected,
                          stalled=self.stalled, **self.participation.counts,
                          **self.last_eval, **self.moved(), **extra)

    def moved(self) -> dict[str, int]:
        """The bytes moved and the bill so far, this life's added to the previous."""
        t = self.exchange.store.traffic
        ckpt = sum(c.bytes_up for cat, c in t.by_category().items()
                   if cat.startswith(layout.CANONICAL_STATES))
        now = {"bytes_up": t.bytes_up, "bytes_down": t.bytes_down, "bytes_checkpoints": ckpt}
        return {**{k: self.moved_before[k] + now[k] for k in TRAFFIC_KEYS},
                **self.meter.figures()}

    # -- evaluations of the canonical model -----------------------------------------
    def evaluated(self, loss: float, rounds: list[int]) -> dict[str, Any]:
        self.last_eval.update(eval_loss=loss, perplexity=math.exp(min(loss, 50.0)),
                              eval_round=sum(r + 1 for r in rounds))
        log.info("aggregator: canonical model after %d of %d rounds: eval loss %.4f",
                 self.last_eval["eval_round"], self.total, loss)
        return dict(self.last_eval)

    def maybe_evaluate(self, final: bool = False) -> dict[str, Any]:
        """An evaluation when every fragment has a round more than at the last one
        (sharded: queued until its checkpoints are assembled); ``final``: unless the
        last one already saw every round."""
        agg, pending = self.agg, self.pending
        level = min(agg.next_round)
        if self.evaluator is None:
            return {}
        if final:
            if self.last_eval.get("eval_round") == sum(agg.next_round) or (
                    pending and sum(r + 1 for r in pending[-1]) == sum(agg.next_round)):
                return {}
        elif level <= self.evaluated_at or level == 0:
            return {}
        self.evaluated_at = level
        rounds = [n - 1 for n in agg.next_round]
        if self.sharded:
            pending.append(rounds)
            return {}
        return self.evaluated(self.evaluator(agg), rounds)

    def evaluate_pending(self) -> None:
        """Sharded: the evaluations due whose checkpoints are assembled, logged as the
        round's report would have carried them (at the same step), in order."""
        while self.pending:
            loss = self.evaluator.at(self.eval_store, self.pending[0])
            if loss is None and all(self.exchange.store.exists(layout.global_commit(p, r + 1))
                                    for p, r in enumerate(self.pending[0])):
                log.warning("aggregator: no canonical checkpoint of rounds %s left to "
                            "evaluate (train.keep_checkpoints)", self.pending[0])
                self.pending.pop(0)
                continue
            if loss is None:
                return
            report = self.evaluated(loss, self.pending.pop(0))
            self.hooks.aggregator_eval({**report, "rounds": report["eval_round"]})
            flow_log("canonical model after %d of %d rounds: eval loss %.4f",
                     report["eval_round"], self.total, loss)

    def evaluate_final(self) -> None:
        """Every round reduced: the last evaluation, and any still pending."""
        final = self.maybe_evaluate(final=True)
        self.evaluate_pending()  # done: every whole checkpoint is assembled
        if final:
            rounds = sum(self.agg.next_round)
            flow_log("canonical model after all %d rounds: eval loss %.4f", rounds,
                     final["eval_loss"])
            self.hooks.aggregator_eval({**final, "rounds": rounds, "final": True})


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
    heartbeat = max(SHARD_HEARTBEAT_S, agg.config.liveness.poll_max_s)
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


def main(argv: list[str] | None = None) -> int:
    record_threads_at_exit()  # with DILOCO_THREADS_AT_EXIT set (tests)
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
