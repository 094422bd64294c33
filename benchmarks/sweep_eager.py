"""Which outer step hides a whole round best: eval loss of the eager rules against
outer lr and momentum, on the quality benchmark's recipe (600 steps, H = 50, P = 2,
tau = 1, alpha = 0.5, int4 up / int8 down unless overridden).

    .venv/bin/python -m benchmarks.sweep_eager OUT.jsonl SPEC [SPEC ...]
    SPEC = rule:M:lr:mu[:override,override...]   e.g. adaptive:2:1.0:0:sync.schedule.overlap=12

``rule`` is an ``eager_rule`` (adaptive, pure) or ``streaming`` for the
reference that waits; the overrides are any config fields (``codec=fp32`` picks a
codec pair of benchmarks/recipe.py). Each finished contender appends one JSON line
to OUT.jsonl (an interrupted sweep keeps what it measured) and prints it: eval loss
of the canonical model, and how many merges found their mean late. It is a tool for
choosing eager's default rule and outer optimizer, not one of ``diloco bench``'s
benchmarks.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import get_args

from benchmarks.contenders import Contender, Workdir, run_contender
from benchmarks.recipe import ensure_dataset, reference_overrides
from diloco.config import EagerRule

STEPS = 600
RULES = ("streaming", *get_args(EagerRule))


def parse(spec: str) -> Contender:
    """``rule:M:lr:mu[:overrides]`` as a contender of benchmarks/recipe.py's modes."""
    parts = spec.split(":")
    if len(parts) < 4 or parts[0] not in RULES:
        raise SystemExit(f"spec {spec!r}: expected rule:M:lr:mu[:override,...] with rule "
                         f"one of {', '.join(RULES)}")
    extra = [o for o in parts[4].split(",") if o] if len(parts) > 4 else []
    codec = next((o.split("=", 1)[1] for o in extra if o.startswith("codec=")), "int4")
    extra = [o for o in extra if not o.startswith("codec=")]
    rule = parts[0]
    if rule == "pure":
        mode = "pure-eager"
    elif rule == "streaming":
        mode = "streaming"
    else:
        mode, extra = "eager", [f"sync.schedule.eager_rule={rule}", *extra]
    return Contender(mode, codec, int(parts[1]), outer_lr=float(parts[2]),
                     outer_momentum=float(parts[3]), extra=tuple(extra))


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        raise SystemExit(__doc__)
    out, specs = Path(args[0]), args[1:]
    contenders = [parse(s) for s in specs]  # every spec checked before anything runs
    base = reference_overrides(STEPS, ensure_dataset(None))
    with Workdir("sweep-eager", keep=False) as wd:
        for spec, c in zip(specs, contenders, strict=True):
            start = time.time()
            o = run_contender(c, base, wd, mlflow=False)
            late = sum(w.get("sync", {}).get("late_means", 0) for w in o.workers.values())
            merged = sum(w.get("sync", {}).get("rounds_merged", 0) for w in o.workers.values())
            line = {"spec": spec, "eval_loss": round(o.eval_loss, 4),
                    "late_means": f"{late}/{merged}", "s": round(time.time() - start)}
            print(json.dumps(line), flush=True)
            with out.open("a") as f:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
