"""The papers' claims, reproduced with seeds: each claim's smallest set of contenders,
3 seeds each, and a verdict.

    .venv/bin/python -m benchmarks.bench_claims [--claims C4,C5] [--profile quick|full] \\
        [--seeds 0,1,2] [--resume] [--plan] [--report] [--results FILE.jsonl] [--out claims]
    diloco bench claims [same options]

Claims C1..C9 and what tests each: ``benchmarks.claims_plan`` (docs/claims.md has the
table). Every run reuses the benchmarks' contenders (``benchmarks.contenders``: one
process per worker, the aggregator in a thread, the canonical model evaluated at the
end) on the reference recipe at the profile's sizes, with ``train.seed`` = the seed
(model init and data order) and every round waiting for every member (quorum 1).
C3 runs bench_elastic's parties (``benchmarks.claims_elastic``).

Each finished run appends one line to the JSONL (``--results``, default
benchmarks/results/claims.jsonl, claims-quick.jsonl for ``--profile quick``) at once,
so an interrupted invocation loses at most the run in progress; ``--resume`` skips
every (run, seed) already there (same config: the key hashes the whole recipe).
Without it the runs are done again and the newest line of a key is the one read.
The verdicts are computed from the JSONL by the rule of ``benchmarks.claims_verdict``
(fixed before any run) and written as claims.json and claims.md. ``--plan`` prints
the runs, their count and the budget estimate without running anything;
``--report`` only computes the verdicts of what the results file holds.

Exit status: 0 done, 1 a run failed (the ones before it are kept), 2 bad options
(one line naming the option and what is allowed), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.claims_plan import CLAIMS, PROFILES, Claim, Profile, Spec, claims, unique_specs
from benchmarks.claims_verdict import NOT_RUN
from benchmarks.report import RESULTS, cli_logging, environment, md_table, stop_on_sigterm

log = logging.getLogger("benchmarks.claims")
PROG = "benchmarks.bench_claims"

#: CPU seconds of one run on this kind of machine (2 vCPU), per 1,000 worker-steps of
#: the full profile's reference model (M x steps): measured, see docs/claims.md
CPU_S_PER_KSTEP = 150.0
#: the same for C3's pair of elastic runs (four workers, 120 steps, 0.25 s sleeps)
ELASTIC_WALL_S = 150.0
#: a step's CPU cost grows about as the parameters to this power (measured, one
#: thread, 16 x 64 tokens: 0.14 s at 0.9M, 0.35 s at 3.3M, 2.0 s at 21M)
SIZE_EXPONENT = 0.75


class UsageError(ValueError):
    """A bad option: the message names it and what is allowed."""


# -- the results file ------------------------------------------------------------------


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSONL's rows, oldest first (a torn last line, from a kill mid-write, is
    skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s: skipping a line that is not JSON", path)
    return rows


def append_row(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def lookup_from(rows: Sequence[dict[str, Any]], profile: Profile,
                seeds: Sequence[int]) -> Callable[[Spec], list[dict[str, Any]]]:
    """A spec's newest row per seed of ``seeds``, by seed."""
    newest: dict[str, dict[str, Any]] = {}
    for r in rows:
        newest[r["key"]] = r

    def lookup(spec: Spec) -> list[dict[str, Any]]:
        found = [newest[k] for s in seeds if (k := spec.key(profile, s)) in newest]
        if not found:
            raise KeyError(spec.name)
        return sorted(found, key=lambda r: r["seed"])

    return lookup


# -- running -----------------------------------------------------------------------------


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the worker processes)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def train(spec: Spec, profile: Profile, seed: int, data: dict[str, str], wd: Path,
          mlflow: bool) -> dict[str, Any]:
    """One seed of one training spec, through ``contenders.run_contender``; the
    figures a claim reads."""
    from benchmarks.bench_quality import row as quality_row  # noqa: PLC0415
    from benchmarks.contenders import run_contender  # noqa: PLC0415

    base = [*spec.overrides(profile, seed), f"data.dataset={data[spec.data]}"]
    out = run_contender(spec.contender, base, wd, mlflow=mlflow)
    q = quality_row(out, None)
    peaks = [max(w["traffic"]["delta_payload_bytes"].values(), default=0)
             for w in out.workers.values() if "traffic" in w]
    return {"eval_loss": out.eval_loss, "seconds": out.seconds,
            "num_parameters": out.num_parameters, "rounds": out.rounds,
            "bytes_per_step": q["bytes_per_step"], "up_per_step": q["up_per_step"],
            "up_less_than_dp": q["up_less_than_dp"], "late_means": q["late_means"],
            "peak_up": max(peaks) if any(peaks) else None}


def run_one(spec: Spec, profile: Profile, seed: int, data: dict[str, str], wd: Path,
            mlflow: bool) -> dict[str, Any]:
    """A row of the JSONL: the spec, its seed, and what its run measured."""
    cpu0, t0 = _cpu(), time.perf_counter()
    if spec.kind == "elastic":
        from benchmarks.claims_elastic import pair  # noqa: PLC0415

        got = pair(list(profile.elastic), data["reference"], wd, seed)
    else:
        got = train(spec, profile, seed, data, wd, mlflow)
    return {"key": spec.key(profile, seed), "profile": profile.name, "spec": spec.name,
            "seed": seed, **got, "wall_s": time.perf_counter() - t0, "cpu_s": _cpu() - cpu0,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def estimate(spec: Spec, profile: Profile) -> float:
    """Planned CPU seconds of one seed of ``spec`` (the budget of docs/claims.md):
    worker-steps times the measured cost of the reference model, scaled by size."""
    if spec.kind == "elastic":
        return ELASTIC_WALL_S * (1 if profile.name == "full" else 0.2)
    scale = 1.0
    if spec.model is not None and spec.model != profile.model:
        from benchmarks.claims_plan import parameters  # noqa: PLC0415

        scale = (parameters(spec.preset, spec.model)
                 / parameters("tiny", profile.model)) ** SIZE_EXPONENT
    if profile.name != "full":
        scale *= 0.05
    return spec.contender.workers * spec.steps / 1000 * CPU_S_PER_KSTEP * scale


def execute(chosen: Sequence[Claim], profile: Profile, seeds: Sequence[int], results: Path,
            *, resume: bool, data: dict[str, str], mlflow: bool = False,
            runner: Callable[..., dict[str, Any]] = run_one) -> list[dict[str, Any]]:
    """Run every (spec, seed) of ``chosen`` not yet in ``results`` (with ``resume``),
    appending each row as it ends; a rich progress bar on a terminal."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

    from benchmarks.contenders import Workdir  # noqa: PLC0415

    done = {r["key"] for r in read_rows(results)} if resume else set()
    todo = [(s, seed) for s in unique_specs(chosen, profile) for seed in seeds
            if s.key(profile, seed) not in done]
    skipped = len(unique_specs(chosen, profile)) * len(seeds) - len(todo)
    if skipped:
        log.info("--resume: %d run(s) already in %s", skipped, results)
    new: list[dict[str, Any]] = []
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
               "{task.total} runs"), TimeElapsedColumn())
    with Workdir("claims") as wd, Progress(*columns, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task("claims", total=len(todo))
        for i, (spec, seed) in enumerate(todo, 1):
            bar.update(task, description=f"{spec.name[:60]} seed {seed}")
            log.info("[%d/%d] %s, seed %d (planned %.0f CPU s)", i, len(todo), spec.name,
                     seed, estimate(spec, profile))
            row = runner(spec, profile, seed, data, wd, mlflow)
            append_row(results, row)
            new.append(row)
            log.info("[%d/%d] eval loss %.4f, %.0f s, %.0f CPU s", i, len(todo),
                     row["eval_loss"], row["wall_s"], row["cpu_s"])
            bar.advance(task)
    return new


# -- the report --------------------------------------------------------------------------


def figures(values: Sequence[float]) -> str:
    """mean +- sd over seeds (sd only with two or more)."""
    if not values:
        return NOT_RUN
    if len(values) == 1:
        return f"{values[0]:.4f} (1 seed)"
    return f"{statistics.fmean(values):.4f} +- {statistics.stdev(values):.4f}"


def report(chosen: Sequence[Claim], profile: Profile, seeds: Sequence[int],
           rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per claim: every run's figures over seeds, each check and the verdict."""
    lookup = lookup_from(rows, profile, seeds)
    out = []
    for c in chosen:
        runs = []
        for s in c.specs:
            try:
                got = lookup(s)
            except KeyError:
                got = []
            runs.append({"spec": s.name, "seeds": [r["seed"] for r in got],
                         "eval_loss": [r["eval_loss"] for r in got],
                         "peak_up": got[0].get("peak_up") if got else None,
                         "up_per_step": got[0].get("up_per_step") if got else None,
                         "cpu_s": sum(r.get("cpu_s", 0.0) for r in got)})
        shows = []
        for label, series in c.shows:
            try:
                shows.append({"label": label, "values": series.values(lookup)})
            except (KeyError, ZeroDivisionError):
                shows.append({"label": label, "values": []})
        out.append({"claim": c.id, "sentence": c.sentence, "source": c.source,
                    "paper": c.paper, "note": c.note, "runs": runs, "shows": shows,
                    **c.judge(lookup)})
    return {"profile": profile.name, "seeds": list(seeds), "claims": out}


def _num(x: Any, fmt: str) -> str:
    return "" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


def markdown(rep: dict[str, Any]) -> str:
    lines = [f"Claims, profile {rep['profile']}, seeds {', '.join(map(str, rep['seeds']))} "
             "(eval loss in nats per byte, mean +- sd over seeds)", ""]
    lines.append(md_table(["claim", "verdict"], [[c["claim"], c["verdict"]]
                                                  for c in rep["claims"]]))
    for c in rep["claims"]:
        lines += ["", f"## {c['claim']}: {c['sentence']} ({c['source']})", ""]
        if c["note"]:
            lines += [c["note"], ""]
        lines.append(md_table(
            ["run", "eval loss", "peak upload / sync", "upload / worker / step", "CPU s"],
            [[r["spec"], figures(r["eval_loss"]), _num(r["peak_up"], "{:,.0f} B"),
              _num(r["up_per_step"], "{:,.0f} B"), _num(r["cpu_s"], "{:.0f}")]
             for r in c["runs"]]))
        lines += ["", md_table(
            ["test", "d", "95% interval", "tolerance", "verdict"],
            [[k["label"], _num(k.get("d"), "{:+.4f}"),
              "" if k.get("lo") is None else f"[{k['lo']:+.4f}, {k['hi']:+.4f}]",
              _num(k.get("tol") if k["kind"] in ("within", "at_least") else None, "{:.4f}"),
              k["verdict"]] for k in c["checks"]])]
        for s in c["shows"]:
            pct = [100 * v for v in s["values"]]
            lines.append(f"- {s['label']} (%): {figures(pct)}")
        lines += ["", f"Verdict: **{c['verdict']}**"]
    return "\n".join(lines)


# -- the command -------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--claims", default=",".join(CLAIMS), help=f"comma list of {', '.join(CLAIMS)}")
    p.add_argument("--profile", default="full", help=f"one of {', '.join(PROFILES)}")
    p.add_argument("--seeds", default=None,
                   help="comma list of seeds (non-negative integers); default: the profile's")
    p.add_argument("--resume", action="store_true",
                   help="skip the (run, seed) pairs already in the results file")
    p.add_argument("--plan", action="store_true",
                   help="print the runs and the planned CPU time; run nothing")
    p.add_argument("--report", action="store_true",
                   help="only the verdicts of what the results file holds; run nothing")
    p.add_argument("--results", type=Path, default=None,
                   help="the JSONL (default benchmarks/results/claims.jsonl, "
                   "claims-quick.jsonl for --profile quick)")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--out", default=None, help="results/<out>.json and .md (default claims, "
                   "claims-quick for --profile quick)")
    p.add_argument("--data", type=Path, default=None, help="where the datasets are cached")
    p.add_argument("--no-mlflow", dest="mlflow", action="store_false")
    return p


def options(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[Claim], Profile,
                                                  list[int]]:
    """The parsed options; ``UsageError`` naming the option and what is allowed."""
    args = parser().parse_args(argv)
    if args.profile not in PROFILES:
        raise UsageError(f"--profile: unknown {args.profile!r}; allowed: {', '.join(PROFILES)}")
    profile = PROFILES[args.profile]
    ids = [c.strip().upper() for c in args.claims.split(",") if c.strip()]
    unknown = [c for c in ids if c not in CLAIMS]
    if unknown or not ids:
        raise UsageError(f"--claims: unknown {', '.join(unknown) or '(empty)'}; allowed: "
                         f"{', '.join(CLAIMS)}")
    try:
        seeds = ([int(s) for s in args.seeds.split(",") if s.strip()] if args.seeds
                 else list(profile.seeds))
    except ValueError:
        raise UsageError(f"--seeds: {args.seeds!r} is not a comma list of integers; "
                         "allowed: non-negative integers, e.g. 0,1,2") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds: {args.seeds!r}; allowed: distinct non-negative "
                         "integers, e.g. 0,1,2")
    plan = claims(profile)
    suffix = "" if profile.name == "full" else f"-{profile.name}"
    args.results = args.results or args.results_dir / f"claims{suffix}.jsonl"
    args.out = args.out or f"claims{suffix}"
    return args, [plan[c] for c in CLAIMS if c in ids], profile, seeds


def plan_text(chosen: Sequence[Claim], profile: Profile, seeds: Sequence[int]) -> str:
    """Every claim's runs and the planned CPU seconds (per claim, runs shared with an
    earlier claim counted there)."""
    seen: set[str] = set()
    lines, total = [], 0.0
    for c in chosen:
        new = {s.key(profile, 0): s for s in c.specs if s.key(profile, 0) not in seen}
        cost = sum(estimate(s, profile) for s in new.values()) * len(seeds)
        seen.update(new)
        total += cost
        lines.append(f"{c.id}: {len(c.specs)} runs x {len(seeds)} seeds, planned "
                     f"{cost / 3600:.2f} CPU h ({cost / 7200:.2f} h on 2 cores)")
        lines += [f"    {s.name}" for s in c.specs]
    lines.append(f"total: {total / 3600:.2f} CPU h, about {total / 7200:.1f} h on 2 cores")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args, chosen, profile, seeds = options(argv)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if args.plan:
        print(plan_text(chosen, profile, seeds))
        return 0
    from benchmarks.claims_data import ensure_shuffled  # noqa: PLC0415
    from benchmarks.recipe import ensure_dataset  # noqa: PLC0415
    from benchmarks.report import write_report  # noqa: PLC0415

    env = environment(argv, PROG)
    data: dict[str, str] = {}
    if not args.report:
        data["reference"] = ensure_dataset(args.data)
        if any(s.data == "shuffled" for s in unique_specs(chosen, profile)):
            data["shuffled"] = ensure_shuffled(data["reference"])
    t0 = time.perf_counter()
    failed = None
    try:
        if not args.report:
            execute(chosen, profile, seeds, args.results, resume=args.resume, data=data,
                    mlflow=args.mlflow)
    except Exception as exc:  # noqa: BLE001 - reported; the finished runs are kept
        failed = exc
        log.error("a run failed: %s", exc)
    rep = report(chosen, profile, seeds, read_rows(args.results))
    rep.update(environment=env, wall_seconds=time.perf_counter() - t0,
               results=str(args.results))
    md = markdown(rep)
    write_report(args.out, rep, md, args.results_dir)
    print(md)
    return 1 if failed else 0


if __name__ == "__main__":
    cli_logging("mlflow", "alembic")
    stop_on_sigterm()
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        sys.exit(130)
