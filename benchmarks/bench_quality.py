"""Quality at equal tokens: data-parallel against DiLoCo's modes, side by side.

    .venv/bin/python -m benchmarks.bench_quality [--steps 600] [--workers 2,4] \\
        [--modes diloco,streaming,eager,pure-eager] [--codecs fp32,int4] [--sweep grid]

Every contender trains the same model (the reference recipe of benchmarks/recipe.py:
885,888 parameters, byte-level Shakespeare, 16 x 64 tokens per worker per step),
from the same seed and initial parameters, for the same number of inner steps per
worker, so at equal M every contender sees the same tokens. Data-parallel runs
``train.strategy=data_parallel`` (gradients all-reduced every step, one process per
rank, gloo on loopback); the DiLoCo modes run their workers as threads of this
process with the aggregator in another thread, through a file:// store.

The score is the eval loss (nats per byte) of the model the run produces, on the
same 32 validation batches: data-parallel's final model, and for DiLoCo the
aggregator's canonical model after every round (for eager modes this is not any
single worker's replica). The gap is ``loss / loss(data-parallel) - 1``.

Outer learning rate and momentum are tuned per mode with a small grid (``--sweep
grid``) at M = 2 with float32 outer gradients, as the papers did; the best point of
each mode is then used for its int4 run and for M = 4. The sweep picks on the same
validation batches it reports (there is no third split), so the tuned gaps are
slightly optimistic; the whole sweep is reported.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.contenders import Cache, Contender, Outcome, Workdir, load, run_contender
from benchmarks.recipe import (
    CODEC_LABELS,
    MODE_LABELS,
    MODES,
    default_data_dir,
    ensure_dataset,
    reference_overrides,
)
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
from storage.traffic import human_bytes

# (outer lr, outer momentum) per mode. The defaults of diloco/config.py are in it.
SWEEP: dict[str, list[tuple[float, float]]] = {
    "diloco": [(0.4, 0.9), (0.7, 0.9), (1.0, 0.0)],
    "streaming": [(0.4, 0.9), (0.7, 0.9), (1.0, 0.0)],
    "streaming-auto": [(0.4, 0.9), (0.7, 0.9), (1.0, 0.0)],
    "eager": [(0.7, 0.5), (0.7, 0.0), (1.0, 0.0)],
    "pure-eager": [(0.7, 0.5), (0.7, 0.0), (1.0, 0.0)],
    "eager-tau12": [(0.7, 0.5), (0.7, 0.0), (1.0, 0.0)],
}
# the reference measurements (docs/results.md): the reference's gaps to data-parallel (M=2, 600 steps).
REFERENCE_GAPS = {
    "diloco": "+4.0% (H=50)",
    "streaming": "+3.7% (float32), +3.7% (int4/int8)",
    "eager": "+5.5% (half the means late)",
    "pure-eager": "+16% (mu 0.9), +7% (mu 0, lr 1.0)",
}
log = logging.getLogger("benchmarks.quality")


def traffic_per_step(outcome: Outcome, way: str = "both") -> float | None:
    """Exchange bytes (``up``, ``down`` or ``both``) per worker per inner step, from
    the store clients."""
    rows = [w["traffic"]["exchange"] for w in outcome.workers.values() if "traffic" in w]
    if not rows:
        return None
    steps = outcome.workers[next(iter(outcome.workers))]["steps"]
    keys = {"up": ["bytes_up"], "down": ["bytes_down"]}.get(way, ["bytes_up", "bytes_down"])
    return sum(r[k] for r in rows for k in keys) / len(rows) / steps


def dp_bytes_per_step(num_parameters: int, workers: int) -> float:
    """fp32 ring all-reduce, docs/algorithms.md section 8: 2 (M-1)/M x 4 bytes a parameter,
    each way, per worker per step (up + down)."""
    return 2 * (2 * (workers - 1) / workers * 4 * num_parameters)


def row(outcome: Outcome, dp_loss: float | None) -> dict[str, Any]:
    c = outcome.contender
    late = [w.get("sync", {}).get("late_means", 0) for w in outcome.workers.values()]
    merged = [w.get("sync", {}).get("rounds_merged", 0) for w in outcome.workers.values()]
    per_step, up = traffic_per_step(outcome), traffic_per_step(outcome, "up")
    dp_up = dp_bytes_per_step(outcome.num_parameters, c.workers) / 2
    if c.mode == "data-parallel":
        per_step, up = 2 * dp_up, dp_up
    return {
        **outcome.to_dict(),
        "gap": None if dp_loss is None else outcome.eval_loss / dp_loss - 1,
        "bytes_per_step": per_step, "up_per_step": up,
        "up_less_than_dp": dp_up / up if up else None,
        "late_means": sum(late), "merges": sum(merged),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    data = ensure_dataset(args.data)
    base = reference_overrides(args.steps, data, every_member=True)
    modes = [m for m in args.modes.split(",") if m]
    codecs = [c for c in args.codecs.split(",") if c]
    workers = [int(m) for m in args.workers.split(",") if m]
    sweep_rows: list[dict[str, Any]] = []
    best: dict[str, tuple[float | None, float | None]] = {m: (None, None) for m in modes}
    done: dict[Contender, Outcome] = {}

    cache = Cache(args.cache_dir if args.resume else None, base)

    def contender_run(c: Contender) -> Outcome:
        if c not in done:
            cached = cache.get(c)
            if cached is not None:
                log.info("%s: from the cache (eval loss %.4f)", c.name, cached.eval_loss)
                done[c] = cached
                return cached
            log.info("running %s", c.name)
            done[c] = run_contender(c, base, wd, mlflow=args.mlflow)
            cache.put(done[c])
            log.info("%s: eval loss %.4f in %.0f s", c.name, done[c].eval_loss,
                     done[c].seconds)
        return done[c]

    with Workdir("quality", keep=args.keep) as wd:
        sweep_m = workers[0]
        dp_sweep = contender_run(Contender("data-parallel", workers=sweep_m))
        if args.sweep == "grid":
            for mode in modes:
                points = []
                for lr, mu in SWEEP[mode]:
                    c = Contender(mode, args.sweep_codec, sweep_m, args.sync_every,
                                  outer_lr=lr, outer_momentum=mu)
                    out = contender_run(c)
                    points.append((out.eval_loss, lr, mu))
                    sweep_rows.append(row(out, dp_sweep.eval_loss))
                finite = [p for p in points if math.isfinite(p[0])]
                if finite:
                    _, lr, mu = min(finite)
                    best[mode] = (lr, mu)
        if args.outer:
            lr, mu = (float(v) for v in args.outer.split(","))
            best = {mode: (lr, mu) for mode in modes}
        rows: list[dict[str, Any]] = []
        for m in workers:
            dp = contender_run(Contender("data-parallel", workers=m))
            rows.append(row(dp, dp.eval_loss))
            for mode in modes:
                for codec in codecs:
                    lr, mu = best[mode]
                    c = Contender(mode, codec, m, args.sync_every,
                                  outer_lr=lr, outer_momentum=mu)
                    rows.append(row(contender_run(c), dp.eval_loss))
    return {"rows": rows, "sweep": sweep_rows,
            "best_outer": {m: {"outer_lr": v[0], "outer_momentum": v[1]}
                           for m, v in best.items()}}


def _outer(r: dict[str, Any]) -> str:
    if r["mode"] == "data-parallel":
        return ""
    from diloco.config import OUTER_DEFAULTS  # noqa: PLC0415

    # the config's mode (pure-eager is eager, streaming-auto streaming)
    mode = next(o.split("=", 1)[1] for o in MODES[r["mode"]] if o.startswith("sync.schedule.mode="))
    lr = r["outer_lr"] if r["outer_lr"] is not None else OUTER_DEFAULTS[mode][0]
    mu = r["outer_momentum"] if r["outer_momentum"] is not None else OUTER_DEFAULTS[mode][1]
    return f"{lr:g} / {mu:g}"


def _gap(g: float | None) -> str:
    return "" if g is None or not math.isfinite(g) else f"{g * 100:+.1f}%"


def _bytes(b: float | None) -> str:
    return "" if b is None else human_bytes(b, 2)


def markdown(report: dict[str, Any]) -> str:
    res, env = report["results"], report["environment"]
    p = report["settings"]
    lines = [
        f"Quality at equal tokens ({env['date'][:10]}; `{env['command']}`)",
        "",
        f"{p['num_parameters']:,} parameters, byte-level Shakespeare, {p['steps']} inner "
        f"steps x {p['tokens_per_step']} tokens per worker, seed 0, H = {p['sync_every']}, "
        "P = 2 for streaming and eager. Eval loss in nats per byte of the final model "
        "(DiLoCo: the aggregator's canonical model).",
        "",
    ]
    head = ["contender", "codec", "M", "outer lr / mu", "eval loss", "vs data-parallel",
            "traffic / worker / step", "upload / step", "upload less than DP", "late means",
            "wall s"]
    table = []
    for r in res["rows"]:
        less = r.get("up_less_than_dp")
        table.append([
            MODE_LABELS[r["mode"]], "" if r["mode"] == "data-parallel"
            else CODEC_LABELS[r["codec"]], r["workers"], _outer(r), f"{r['eval_loss']:.4f}",
            _gap(r["gap"]), _bytes(r["bytes_per_step"]), _bytes(r.get("up_per_step")),
            f"{less:,.0f}x" if less else "",
            "" if r["mode"] == "data-parallel" else f"{r['late_means']}/{r['merges']}",
            f"{r['seconds']:.0f}"])
    lines += [md_table(head, table), ""]
    lines.append("Data-parallel traffic is the fp32 ring all-reduce arithmetic "
                 "(docs/algorithms.md section 8); DiLoCo's is the exchange's object bodies "
                 "counted by each worker's store client, up + down. Late means: merges "
                 "at which an eager worker did not yet have that round's mean.")
    if res["sweep"]:
        lines += ["", f"Outer optimizer sweep (M = {res['sweep'][0]['workers']}, "
                  f"{CODEC_LABELS[res['sweep'][0]['codec']]}):", ""]
        table = [[MODE_LABELS[r["mode"]], _outer(r), f"{r['eval_loss']:.4f}",
                  _gap(r["gap"])] for r in res["sweep"]]
        lines.append(md_table(["mode", "outer lr / mu", "eval loss", "vs data-parallel"],
                              table))
    targets = report.get("targets")
    if targets:
        lines += ["", "Targets (equal tokens):", ""]
        lines.append(md_table(["target", "measured", "met"],
                              [[t["target"], t["measured"], t["met"]] for t in targets]))
    return "\n".join(lines)


def sparse_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 17's, at each M: a sparse contender uploads >= 2,000x less than
    data-parallel at an eval loss no worse than streaming int4's, side by side."""
    out = []
    for m in sorted({r["workers"] for r in rows}):
        base = [r for r in rows if r["workers"] == m and r["mode"] == "streaming"
                and r["codec"] == "int4"]
        sparse = [r for r in rows if r["workers"] == m and r["codec"].startswith("topk")]
        if not base or not sparse:
            continue
        for r in sparse:
            ok = r["up_less_than_dp"] >= 2000 and r["eval_loss"] <= base[0]["eval_loss"]
            out.append({"target": f"M = {m}: {CODEC_LABELS[r['codec']]} uploads >= 2,000x "
                                  f"less than data-parallel at eval loss <= streaming int4's "
                                  f"{base[0]['eval_loss']:.4f}",
                        "measured": f"{r['up_less_than_dp']:,.0f}x, {r['eval_loss']:.4f}",
                        "met": "yes" if ok else "no"})
    return out


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets at M = 2: streaming with int4 within the reference's
    +3.7%; the best mode hiding a whole round (eager) within 5%; the sparse codecs'
    (`sparse_targets`)."""
    m2 = [r for r in rows if r["workers"] == 2 and r["gap"] is not None]
    out = sparse_targets(rows)
    s = [r for r in m2 if r["mode"] == "streaming" and r["codec"] == "int4"]
    if s:
        out.append({"target": "streaming int4/int8 gap <= +3.7% (reference)",
                    "measured": _gap(s[0]["gap"]), "met": "yes" if s[0]["gap"] <= 0.037
                    else "no"})
    e = [r for r in m2 if r["mode"] in ("eager", "pure-eager")]
    if e:
        b = min(e, key=lambda r: r["gap"])
        out.append({"target": "best whole-round-hiding mode gap <= +5%",
                    "measured": f"{_gap(b['gap'])} ({MODE_LABELS[b['mode']]}, "
                                f"{CODEC_LABELS[b['codec']]})",
                    "met": "yes" if b["gap"] <= 0.05 else "no"})
    return out


def tokens_per_step() -> int:
    """Tokens one worker processes per inner step in the reference recipe."""
    cfg = load(Contender("diloco"), reference_overrides())
    return cfg.data.batch_size * cfg.data.seq_len * cfg.optim.grad_accum


#: ``--long``: the long horizon, at least 100 rounds per fragment (3,000 steps at H = 30,
#: P = 2), for data-parallel, streaming at tau 1 and the two modes that hide the
#: exchange, at M = 2 (about an hour on 2 cores); an explicit option still wins
LONG = {"steps": 3000, "sync_every": 30, "workers": "2",
        "modes": "streaming,streaming-auto,eager-tau12", "codecs": "int4",
        "sweep": "none", "outer": "1.0,0", "out": "quality-long"}


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, with ``--long``'s settings as the defaults when it is given."""
    p = parser()
    if p.parse_known_args(argv)[0].long:
        p.set_defaults(**LONG)
    return p.parse_args(argv)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks.bench_quality",
                                description=__doc__.splitlines()[0])
    p.add_argument("--long", action="store_true",
                   help="the long horizon: " + " ".join(f"{k}={v}" for k, v in LONG.items()))
    p.add_argument("--steps", type=int, default=600, help="inner steps per worker")
    p.add_argument("--sync-every", type=int, default=50, help="H for every DiLoCo mode")
    p.add_argument("--workers", default="2,4", help="values of M (the first is swept)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--codecs", default="fp32,int4")
    p.add_argument("--sweep", choices=["grid", "none"], default="grid",
                   help="grid: tune outer lr/momentum per mode; none: the modes' defaults")
    p.add_argument("--sweep-codec", default="fp32")
    p.add_argument("--outer", default=None, metavar="LR,MU",
                   help="outer lr and momentum for every mode (instead of the sweep's best)")
    p.add_argument("--data", type=Path, default=None, help="where the dataset is cached")
    output_args(p, "quality")
    p.add_argument("--keep", action="store_true", help="keep the runs' stores")
    p.add_argument("--resume", action="store_true",
                   help="reuse contenders finished by an earlier, interrupted invocation")
    p.add_argument("--cache-dir", type=Path, default=default_data_dir() / "cache-quality")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if (saved := rerendered(args, markdown)) is not None:
        return saved
    env = environment(argv, "benchmarks.bench_quality")
    stop_on_sigterm()
    results, seconds = timed(lambda: run(args))
    rows = results["rows"]
    num = rows[0]["num_parameters"] if rows else 0
    report = {
        "environment": env, "wall_seconds": seconds,
        "settings": {"steps": args.steps, "sync_every": args.sync_every,
                     "num_parameters": num, "tokens_per_step": tokens_per_step(),
                     "reference_gaps": REFERENCE_GAPS, "sweep_grid": SWEEP},
        "results": results, "targets": targets(rows),
    }
    return publish(args.out, report, markdown, args.results_dir)


if __name__ == "__main__":
    cli_logging("mlflow", "alembic")
    main()
    sys.exit(0)
