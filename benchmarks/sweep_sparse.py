"""Where sparse exchange pays off: eval loss against upload for settings of the
sparse codecs, on the quality benchmark's recipe (600 steps, M workers, streaming
P = 2, tau = 1, outer lr 1 / momentum 0).

    .venv/bin/python -m benchmarks.sweep_sparse OUT.jsonl SPEC [SPEC ...]
    SPEC = codec:M:H[:override,override...]   e.g. topk2-peers:2:10:sync.codec.k=34

``codec`` is a codec pair of benchmarks/recipe.py; the overrides are any config
fields. Each finished contender appends one JSON line to OUT.jsonl (so an
interrupted sweep keeps what it measured) and prints it: eval loss of the canonical
model, exchange bytes up and down per worker per inner step, and how much less it
uploads than data-parallel at the same M. It is a tool for choosing the sparse
contenders of ``bench_quality``, not one of ``diloco bench``'s benchmarks.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.contenders import Contender, Workdir, run_contender
from benchmarks.recipe import ensure_dataset, reference_overrides

STEPS = 600


def parse(spec: str) -> Contender:
    """``codec:M:H[:overrides]`` as a streaming contender with outer lr 1, momentum 0."""
    parts = spec.split(":")
    if len(parts) < 3:
        raise SystemExit(f"spec {spec!r}: expected codec:M:H[:override,...]")
    extra = tuple(o for o in parts[3].split(",") if o) if len(parts) > 3 else ()
    return Contender("streaming", parts[0], int(parts[1]), int(parts[2]), outer_lr=1.0,
                     outer_momentum=0.0, extra=extra)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        raise SystemExit(__doc__)
    out, specs = Path(args[0]), args[1:]
    contenders = [parse(s) for s in specs]  # every spec checked before anything runs
    base = reference_overrides(STEPS, ensure_dataset(None), every_member=True)
    with Workdir("sweep-sparse", keep=False) as wd:
        for spec, c in zip(specs, contenders, strict=True):
            start = time.time()
            o = run_contender(c, base, wd, mlflow=False)
            rows = [w["traffic"]["exchange"] for w in o.workers.values() if "traffic" in w]
            up = sum(r["bytes_up"] for r in rows) / len(rows) / STEPS
            down = sum(r["bytes_down"] for r in rows) / len(rows) / STEPS
            dp_up = 2 * (c.workers - 1) / c.workers * 4 * o.num_parameters
            line = {"spec": spec, "eval_loss": round(o.eval_loss, 4), "up_per_step": round(up),
                    "down_per_step": round(down), "up_less_than_dp": round(dp_up / up),
                    "s": round(time.time() - start)}
            print(json.dumps(line), flush=True)
            with out.open("a") as f:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
