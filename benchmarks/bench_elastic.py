"""Elastic membership under faults: workers killed, restarted, slow, joining.

    .venv/bin/python -m benchmarks.bench_elastic [--steps 120] [--sync-every 10] \\
        [--scenarios fault-free,kill-restart,kill,straggler,join] [--step-s 0.25]

Four workers (w0..w3) on the tiny recipe (streaming, P = 2, int4 up / int8 down)
with a small model (``MODEL``, 2 x 32 wide, so that the run fits two shared
cores; ``--model`` for another) and ``--step-s`` of simulated accelerator time a
step (a sleep, so that a worker's speed does not depend on how many others share
the CPU), 64-token sequences, batch 8, every party a real
process on a local directory store: ``python -m workers --run DIR --aggregate`` and
one ``python -m benchmarks.bench_elastic worker ...`` per worker (the same
WorkerLoop as ``python -m workers --worker W [--join]``, plus a line per step for
the benchmark and, for the straggler, a sleep per step). Same config and seeds in
every scenario; the faults hit w3 (w4 joins):

- ``kill-restart``: w3 is SIGKILLed when w0 is a third of the way in and started
  again (same name: it resumes from its checkpoint and heals) at two thirds;
- ``kill``: w3 is SIGKILLed a third of the way in and never comes back;
- ``straggler``: w3 sleeps (factor - 1) x its own step time after every step;
- ``join``: w4 joins (``--join``) when w0 is halfway.

The lease and the grace bounds are short (sync.liveness.lease_s, grace_min_s, grace_max_s)
so that a scenario lasts a minute or two instead of a cross-region run's minutes.

Measured from the store after each run: *applied tokens* (each mean commit's weight
keys, ``worker`` or ``worker@round``, name delta commits; their ``tokens``, summed,
averaged over the fragments, as every fragment carries every token); *goodput* =
applied tokens / seconds from the workers' launch to the last mean, relative to the
fault-free goodput scaled by the live workers (worker-seconds alive / (4 x wall));
the fast workers' (w0..w2) steps per second, wall clock, relative to fault-free;
the canonical model's eval loss at the end against the fault-free run's canonical
model at the same applied tokens (the fault-free run keeps every round's canonical
checkpoint; its curve is evaluated after the run and interpolated linearly in
tokens); the rounds from the joiner's first step to its first applied
contribution; and ``diloco.audit.audit`` (lost and double must be 0).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.contenders import Workdir
from benchmarks.recipe import ensure_dataset
from benchmarks.report import (
    ROOT,
    cli_logging,
    environment,
    md_table,
    output_args,
    publish,
    rerendered,
    stop_on_sigterm,
    timed,
)

# small enough that five scenarios of five processes fit in ~15 minutes on 2 cores
MODEL = "{d_model: 32, n_layers: 2, n_heads: 2, max_seq_len: 64}"
STEP_S = [0.0]  # --step-s, for every worker this benchmark starts
SCENARIOS = ("fault-free", "kill-restart", "kill", "straggler", "join")
#: run on request only: w3 killed at 1/3 and w4 joining at 1/2 in one run (claim C3)
MORE_SCENARIOS = ("drop-join",)
FAULTED, JOINER, FAST = "w3", "w4", ("w0", "w1", "w2")
log = logging.getLogger("benchmarks.elastic")


def overrides(args: argparse.Namespace, data_url: str) -> list[str]:
    return [
        f"model.overrides={args.model}",
        "workers=[w0, w1, w2, w3]",
        f"data.dataset={data_url}", "data.seq_len=64", f"data.batch_size={args.batch_size}",
        "optim.warmup_steps=10", f"train.steps={args.steps}", "train.eval_every=0",
        "train.eval_batches=16", f"train.checkpoint_every={args.sync_every}",
        "train.log_every=1", "train.threads=1", f"train.seed={args.seed}", "train.keep_checkpoints=0",
        f"sync.schedule.sync_every={args.sync_every}", f"sync.liveness.lease_s={args.lease_s}",
        f"sync.membership.grace_min_s={args.grace_min_s}", f"sync.membership.grace_max_s={args.grace_max_s}",
        "sync.liveness.poll_max_s=0.1", "sync.membership.absent_deadline_s=5", "sync.liveness.stall_after_s=600",
    ]


# -- the worker process ------------------------------------------------------------


def worker_main(argv: Sequence[str]) -> int:
    """One worker: WorkerLoop, a ``STEP worker step time`` line per step, ``RESULT``."""
    p = argparse.ArgumentParser(prog="benchmarks.bench_elastic worker")
    p.add_argument("--run", required=True)
    p.add_argument("--worker", required=True)
    p.add_argument("--join", action="store_true")
    p.add_argument("--slow", type=float, default=1.0, help="step time factor (sleep)")
    p.add_argument("--step-s", type=float, default=0.0,
                   help="simulated accelerator time per step (a sleep)")
    p.add_argument("--wait-go", action="store_true", help="READY, then wait for a line")
    p.add_argument("--preload", action="store_true",
                   help="with --wait-go: only import before READY; open the run after GO")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import torch  # noqa: PLC0415

    from workers.elastic import RunFinished  # noqa: PLC0415
    from workers.loop import WorkerLoop  # noqa: PLC0415

    torch.set_num_threads(1)
    last = [time.perf_counter()]

    def metrics(m: dict[str, Any]) -> None:
        if "loss" not in m:
            return
        if a.step_s:
            time.sleep(a.step_s)
        now = time.perf_counter()
        if a.slow > 1.0:
            time.sleep((a.slow - 1.0) * (now - last[0]))
        print(f"STEP {a.worker} {m['step']} {time.time():.3f}", flush=True)
        last[0] = time.perf_counter()

    def setup() -> WorkerLoop:
        return WorkerLoop.open(a.run, a.worker, join=a.join, metrics=metrics)

    loop = None
    try:
        loop = None if a.preload else setup()
        print("READY", flush=True)
        if a.wait_go:
            sys.stdin.readline()
        last[0] = time.perf_counter()
        loop = loop or setup()
        out = loop.run().to_dict()
    except RunFinished as exc:  # a straggler or a late restart: the others finished it
        out = {"worker": a.worker, "state": "run-finished", "message": str(exc)}
    finally:
        if loop is not None:
            loop.close()
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# -- the parent ---------------------------------------------------------------------


class Proc:
    """A party's process; its STEP lines kept with their times."""

    def __init__(self, name: str, cmd: list[str], log_file: Path, wait_go: bool = False):
        self.name, self.start = name, time.time()
        self.ready = threading.Event()
        self.end: float | None = None
        self.steps: list[tuple[int, float]] = []
        self.result: dict[str, Any] | None = None
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                           os.environ.get("PYTHONPATH")]))}
        self.err = log_file.open("a")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                                     stderr=self.err,
                                     stdin=subprocess.PIPE if wait_go else subprocess.DEVNULL)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("READY"):
                self.ready.set()
            elif line.startswith("STEP "):
                _, _, step, t = line.split()
                self.steps.append((int(step), float(t)))
            elif line.startswith("RESULT "):
                self.result = json.loads(line[7:])
        self.proc.wait()
        self.end = time.time()

    def go(self) -> None:
        """Start training (the process waits after READY); the clock starts here."""
        self.start = time.time()
        assert self.proc.stdin is not None
        self.proc.stdin.write("GO\n")
        self.proc.stdin.close()

    @property
    def step(self) -> int:
        return self.steps[-1][0] if self.steps else 0

    def kill(self) -> None:  # SIGKILL, by our own pid
        if self.proc.poll() is None:
            os.kill(self.proc.pid, 9)
            self.proc.wait()
        self.end = self.end or time.time()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(5)
        self.err.close()


def _worker_cmd(url: str, name: str, *, join: bool = False, slow: float = 1.0,
                wait_go: bool = False, preload: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.bench_elastic", "worker", "--run", url,
           "--worker", name, "--step-s", str(STEP_S[0])] + (["--wait-go"] if wait_go else []) + \
        (["--wait-go", "--preload"] if preload else [])
    return cmd + (["--join"] if join else []) + (["--slow", str(slow)] if slow > 1 else [])


def run_scenario(name: str, args: argparse.Namespace, data_url: str, wd: Path) -> dict:
    """Create the run, start the parties, apply the scenario's fault, measure."""
    from workers.config import load_config  # noqa: PLC0415
    from workers.runs import create_run  # noqa: PLC0415

    url = str(wd / (name if not args.seed else f"{name}-s{args.seed}"))
    create_run(load_config("tiny", overrides(args, data_url)), url)
    logs = wd / f"{Path(url).name}.log"
    agg = Proc("aggregator", [sys.executable, "-m", "workers", "--run", url, "--aggregate",
                              "--log-level", "WARNING"], logs)
    slow = args.slow_factor if name == "straggler" else 1.0
    procs = [Proc(w, _worker_cmd(url, w, slow=slow if w == FAULTED else 1.0, wait_go=True),
                  logs, wait_go=True) for w in (*FAST, FAULTED)]
    everyone = [agg, *procs]
    events: list[dict[str, Any]] = []
    steps = args.steps
    try:
        # every party set up (imports, dataset, run; the aggregator registered) before
        # the clock starts, so that start-up on a loaded machine is not in the figures
        deadline = time.monotonic() + args.timeout
        while not (all(p.ready.is_set() for p in procs)
                   and Path(url, "members", "aggregator.json").exists()):
            if time.monotonic() > deadline or any(p.proc.poll() is not None
                                                  for p in everyone):
                raise RuntimeError(f"{name}: a party did not start; see {logs}")
            time.sleep(0.1)
        t0 = time.time()
        for p in procs:
            p.go()
        # the restarted w3 and the joiner are started now, importing only, and told
        # to go at their moment: the figures show the elastic path, not Python's imports
        late = None
        joins = name in ("join", "drop-join")
        if name == "kill-restart" or joins:
            who = FAULTED if name == "kill-restart" else JOINER
            late = Proc(who, _worker_cmd(url, who, join=joins, preload=True), logs,
                        wait_go=True)
            everyone.append(late)
        done_kill = done_restart = done_join = False
        while any(p.proc.poll() is None for p in everyone):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: not finished after {args.timeout:.0f} s")
            lead = procs[0].step
            if name in ("kill", "kill-restart", "drop-join") and not done_kill \
                    and lead >= steps // 3:
                procs[3].kill()
                done_kill = True
                events.append({"event": "kill", "worker": FAULTED, "at_step": procs[3].step,
                               "lead_step": lead, "t": time.time() - t0})
            if name == "kill-restart" and done_kill and not done_restart \
                    and lead >= 2 * steps // 3:
                late.go()
                procs.append(late)
                done_restart = True
                events.append({"event": "restart", "worker": FAULTED, "lead_step": lead,
                               "t": time.time() - t0})
            if joins and not done_join and lead >= steps // 2:
                late.go()
                procs.append(late)
                done_join = True
                events.append({"event": "join", "worker": JOINER, "lead_step": lead,
                               "t": time.time() - t0})
            _check(everyone, name, logs)
            time.sleep(0.2)
        _check(everyone, name, logs)
    finally:
        for p in everyone:
            p.stop()
    return measure(name, url, t0, procs, events)


def _check(procs: list[Proc], name: str, logs: Path) -> None:
    failed = [p for p in procs if p.proc.poll() not in (None, 0, -9)]
    if failed:
        raise RuntimeError(f"{name}: {failed[0].name} exited {failed[0].proc.returncode}; "
                           f"see {logs}")


def _ts(s: str) -> float:
    return datetime.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def applied_tokens(ex) -> tuple[list[list[tuple[int, float, float, dict]]], float]:
    """Per fragment, per round: (round, tokens applied by its mean, mean created, commit);
    and the last mean's time."""
    from storage.exchange import contribution_of  # noqa: PLC0415

    out, last = [], 0.0
    for p, rounds in enumerate(ex.manifest.rounds):
        rows = []
        for r in range(rounds):
            c = ex.mean_commit(p, r)
            if c is None:
                continue
            tok = 0
            for key in c.get("weights", {}):
                w, k = contribution_of(key, r)
                tok += int(ex.delta_commit(p, k, w)["tokens"])
            rows.append((r, float(tok), _ts(c["created"]), c))
            last = max(last, _ts(c["created"]))
        out.append(rows)
    return out, last


def measure(name: str, url: str, t0: float, procs: list[Proc], events: list) -> dict:
    from diloco.audit import audit  # noqa: PLC0415
    from diloco.run import open_run  # noqa: PLC0415

    ex = open_run(url)
    per, t_end = applied_tokens(ex)
    fragments = len(per)
    tokens = sum(tok for rows in per for _, tok, _, _ in rows) / fragments
    wall = t_end - t0
    alive = sum(min(p.end or t_end, t_end) - max(p.start, t0) for p in procs)
    fast = {}
    for p in procs:
        if p.name in FAST and len(p.steps) > 1:
            (s0, a), (s1, b) = p.steps[0], p.steps[-1]
            fast[p.name] = (s1 - s0) / (b - a)
    joiner = None
    if name == "join":
        j = next(p for p in procs if p.name == JOINER)
        start = j.steps[0][1] if j.steps else j.start
        best = None
        for rows in per:
            after = [c for _, _, t, c in rows if t >= start]
            for i, c in enumerate(after):
                if any(k.split("@")[0] == JOINER for k in c.get("weights", {})):
                    best = i + 1 if best is None else min(best, i + 1)
                    break
        joiner = {"rounds_to_first_contribution": best,
                  "from_step": (j.result or {}).get("resumed_from"),
                  "steps": (j.result or {}).get("steps")}
    late = sum(len(c.get("late", [])) for rows in per for *_, c in rows)
    dropped = sum(len(c.get("dropped", [])) for rows in per for *_, c in rows)
    return {"scenario": name, "url": url, "applied_tokens": tokens, "wall_s": wall,
            "goodput": tokens / wall, "live_workers": alive / wall,
            "fast_steps_per_s": fast, "events": events, "joiner": joiner,
            "late": late, "dropped": dropped, "audit": audit(ex),
            "eval_loss": CanonicalEval(ex, url).final(),
            "workers": {p.name: p.result for p in procs if p.result}}


class CanonicalEval:
    """The canonical model of a run (its round checkpoints) on the validation batches."""

    def __init__(self, ex, url: str):
        import torch  # noqa: PLC0415

        from diloco.run import plan_for  # noqa: PLC0415
        from workers.config import RunConfig  # noqa: PLC0415
        from workers.data.streams import open_dataset, val_batches  # noqa: PLC0415
        from workers.model import build_model  # noqa: PLC0415

        torch.set_num_threads(1)
        self.ex = ex
        cfg = RunConfig.stored(ex.manifest.config)
        self.model = build_model(cfg.model_config_resolved, seed=cfg.train.seed)
        self.plan = plan_for(self.model, cfg.sync)
        ds = open_dataset(cfg.dataset_url(url))
        self.val = val_batches(ds, seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size,
                               num_batches=cfg.train.eval_batches)

    def _eval(self) -> float:
        import torch  # noqa: PLC0415

        from workers.loop import evaluate  # noqa: PLC0415

        return evaluate(self.model, self.val, torch.device("cpu"))

    def final(self) -> float:
        from diloco.run import load_canonical  # noqa: PLC0415

        load_canonical(self.ex, self.plan, self.model)
        return self._eval()

    def curve(self, per: list) -> list[tuple[float, float]]:
        """(applied tokens, eval loss) at every level every fragment's round reached."""
        import torch  # noqa: PLC0415

        from storage import layout  # noqa: PLC0415
        from storage.checkpoints import read_checkpoint  # noqa: PLC0415

        out = []
        levels = min(len(rows) for rows in per)
        for level in range(1, levels + 1):
            for p in range(len(per)):
                arrays, _ = read_checkpoint(self.ex.store, layout.global_commit(p, level - 1))
                self.plan.scatter(self.model, p, torch.from_numpy(arrays["params"].copy()))
            tok = sum(sum(t for _, t, _, _ in rows[:level]) for rows in per) / len(per)
            out.append((tok, self._eval()))
        return out


def interpolate(curve: list[tuple[float, float]], x: float) -> tuple[float, bool]:
    """The loss at ``x`` tokens, linear between points; (value, within the curve)."""
    if x <= curve[0][0]:
        return curve[0][1], x == curve[0][0]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0), True
    return curve[-1][1], x <= curve[-1][0] * 1.0001


def compare(rows: list[dict], curve: list[tuple[float, float]]) -> None:
    base = next(r for r in rows if r["scenario"] == "fault-free")
    per_worker = base["goodput"] / base["live_workers"]
    for r in rows:
        r["goodput_rel"] = r["goodput"] / (per_worker * r["live_workers"])
        rel = [r["fast_steps_per_s"][w] / base["fast_steps_per_s"][w]
               for w in FAST if w in r["fast_steps_per_s"] and w in base["fast_steps_per_s"]]
        r["fast_rel"] = sum(rel) / len(rel) if rel else None
        ref, within = interpolate(curve, r["applied_tokens"])
        r["eval_ref"], r["eval_ref_within_curve"] = ref, within
        r["eval_gap"] = r["eval_loss"] / ref - 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    data = ensure_dataset(args.data)
    names = [s for s in args.scenarios.split(",") if s]
    if "fault-free" not in names:
        names.insert(0, "fault-free")
    rows: list[dict] = []
    with Workdir("elastic", keep=args.keep) as wd:
        curve: list[tuple[float, float]] = []
        for name in names:
            log.info("scenario %s", name)
            r = run_scenario(name, args, data, wd)
            if name == "fault-free":
                from diloco.run import open_run  # noqa: PLC0415

                ex = open_run(r["url"])
                curve = CanonicalEval(ex, r["url"]).curve(applied_tokens(ex)[0])
            log.info("%s: %.0f tokens applied in %.0f s, eval %.4f, audit %s", name,
                     r["applied_tokens"], r["wall_s"], r["eval_loss"], r["audit"])
            rows.append(r)
    compare(rows, curve)
    return {"rows": rows, "fault_free_curve": curve}


LABELS = {"fault-free": "fault-free (4 workers)",
          "kill-restart": "w3 SIGKILLed at 1/3, restarted at 2/3",
          "kill": "w3 SIGKILLed at 1/3, never back",
          "straggler": "w3 slowed x{f:g} throughout", "join": "w4 joins at 1/2",
          "drop-join": "w3 SIGKILLed at 1/3, never back; w4 joins at 1/2"}


def _pct(x: float | None, plus: bool = True) -> str:
    if x is None:
        return ""
    return f"{x * 100:+.1f}%" if plus else f"{x:.3f}"


def targets(rows: list[dict]) -> list[dict]:
    by = {r["scenario"]: r for r in rows}
    out = []
    for s in ("kill-restart", "kill"):
        if s in by:
            g = by[s]["goodput_rel"]
            out.append({"target": f"{s}: goodput >= 0.88", "measured": f"{g:.3f}",
                        "met": "yes" if g >= 0.88 else "no"})
    if "straggler" in by and by["straggler"]["fast_rel"] is not None:
        f = by["straggler"]["fast_rel"]
        out.append({"target": "straggler: fast workers lose <= 5% throughput",
                    "measured": _pct(f - 1), "met": "yes" if f >= 0.95 else "no"})
    if "join" in by:
        n = (by["join"]["joiner"] or {}).get("rounds_to_first_contribution")
        out.append({"target": "joiner's first contribution within 2 rounds",
                    "measured": str(n), "met": "yes" if n is not None and n <= 2 else "no"})
    for r in rows:
        if r["scenario"] == "fault-free":
            continue
        note = "" if r["eval_ref_within_curve"] else " (beyond the curve: vs its end)"
        out.append({"target": f"{r['scenario']}: eval loss within 1% at equal tokens",
                    "measured": _pct(r["eval_gap"]) + note,
                    "met": "yes" if abs(r["eval_gap"]) <= 0.01 else "no"})
    ok = all(not r["audit"]["lost"] and not r["audit"]["double"] for r in rows)
    out.append({"target": "audit: lost = double = 0 in every scenario",
                "measured": "0 / 0" if ok else "see table", "met": "yes" if ok else "no"})
    return out


def markdown(report: dict[str, Any]) -> str:
    env, s = report["environment"], report["settings"]
    rows = report["results"]["rows"]
    lines = [
        f"Elastic membership under faults ({env['date'][:10]}; `{env['command']}`)", "",
        f"4 workers (w0..w3), tiny recipe with model.overrides = "
        f"{s['model']}, {s['steps']} steps x {s['tokens_per_step']} tokens per worker, "
        f"streaming P = 2, H = {s['sync_every']}, int4 up / int8 down, seed 0; every party "
        "a process on a local directory store. Short lease and grace so that a scenario "
        f"takes minutes: sync.liveness.lease_s = {s['lease_s']:g}, grace_min_s = "
        f"{s['grace_min_s']:g}, grace_max_s = {s['grace_max_s']:g}. Every worker sleeps "
        f"{s.get('step_s', 0):g} s a step (simulated accelerator time: with 4-5 CPU-bound "
        "workers on 2 cores, killing one would speed up the others); the straggler "
        "sleeps so that its whole step takes 3x as long. "
        f"{env['machine']['cpu_count']} cores shared by the 5-6 processes and by other "
        "jobs on the machine (load average at start "
        f"{', '.join(f'{x:.1f}' for x in env['machine']['load_average_at_start'] or [])}): "
        "wall-clock figures carry that contention.", "",
    ]
    head = ["scenario", "applied tokens", "wall s", "goodput (rel.)", "fast workers (rel.)",
            "eval loss", "vs fault-free at equal tokens", "joiner rounds",
            "late / dropped", "audit lost / double"]
    table = []
    for r in rows:
        a = r["audit"]
        table.append([
            LABELS[r["scenario"]].format(f=s["slow_factor"]), f"{r['applied_tokens']:,.0f}",
            f"{r['wall_s']:.0f}", f"{r['goodput']:,.0f} tok/s ({r['goodput_rel']:.3f})",
            "" if r["fast_rel"] is None else f"{r['fast_rel']:.3f}",
            f"{r['eval_loss']:.4f}",
            _pct(r["eval_gap"]) + ("" if r["eval_ref_within_curve"] else " *"),
            "" if not r["joiner"] else str(r["joiner"]["rounds_to_first_contribution"]),
            f"{r['late']} / {r['dropped']}", f"{len(a['lost'])} / {len(a['double'])}"])
    lines += [md_table(head, table), ""]
    lines.append(
        "Goodput: tokens applied to the canonical model (the mean commits' weight keys, "
        "their delta commits' tokens, averaged over fragments) per second from the "
        "workers' launch to the last mean; (rel.) against the fault-free goodput per live "
        "worker times the scenario's live workers (worker-seconds alive / wall). Fast "
        "workers: w0..w2's steps per second, wall clock, against the same workers "
        "fault-free. Eval loss: the canonical model at the end, against the fault-free "
        "run's canonical checkpoints evaluated after the run and interpolated linearly at "
        "the same applied tokens (* beyond the fault-free curve's end: compared with its "
        "end). Joiner rounds: means of a fragment committed from the joiner's first step "
        "to the first that applies its contribution. Audit: diloco.audit.audit.")
    lines += ["", md_table(["target", "measured", "met"],
                           [[t["target"], t["measured"], t["met"]]
                            for t in report["targets"]])]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks.bench_elastic",
                                description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120, help="inner steps per worker")
    p.add_argument("--sync-every", type=int, default=10, help="H")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--model", default=MODEL, help="model.overrides")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0, help="train.seed: model init and data order")
    p.add_argument("--step-s", type=float, default=0.25,
                   help="simulated accelerator seconds per step (a sleep in every worker), "
                   "so that on a few shared cores a worker's speed does not depend on how "
                   "many others compete for the CPU; 0: CPU only")
    p.add_argument("--lease-s", type=float, default=5.0)
    p.add_argument("--grace-min-s", type=float, default=0.1)
    p.add_argument("--grace-max-s", type=float, default=3.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per scenario")
    p.add_argument("--data", type=Path, default=None, help="where the dataset is cached")
    p.add_argument("--keep", action="store_true", help="keep the runs' stores")
    output_args(p, "elastic", "accepted for run_all; this benchmark logs nothing to MLflow")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    if (saved := rerendered(args, markdown)) is not None:
        return saved
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS) - set(MORE_SCENARIOS) - {""}
    if unknown:
        parser().error(f"--scenarios: unknown {', '.join(sorted(unknown))}; allowed: "
                       f"{', '.join(SCENARIOS + MORE_SCENARIOS)}")
    STEP_S[0] = args.step_s
    env = environment(argv, "benchmarks.bench_elastic")
    stop_on_sigterm()
    results, seconds = timed(lambda: run(args))
    report = {
        "environment": env, "wall_seconds": seconds,
        "settings": {"steps": args.steps, "sync_every": args.sync_every, "seed": args.seed,
                     "model": args.model, "slow_factor": args.slow_factor,
                     "tokens_per_step": args.batch_size * 64, "lease_s": args.lease_s,
                     "step_s": args.step_s,
                     "grace_min_s": args.grace_min_s, "grace_max_s": args.grace_max_s},
        "results": results, "targets": targets(results["rows"]),
    }
    return publish(args.out, report, markdown, args.results_dir)


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        sys.exit(worker_main(sys.argv[2:]))
    cli_logging()
    main()
    sys.exit(0)
