"""Our model class against building the `transformers` class itself: what the choice
costs (the numbers behind "The model" in docs/own-model.md).

    .venv/bin/python -m benchmarks.bench_model [--presets tiny,small] [--steps 10]

Per preset: milliseconds per training step (forward, backward and AdamW, batch 16 x
``--seq-len`` 128, ``--threads`` 2) of `workers.model.Transformer` and of
``transformers.LlamaForCausalLM`` built from the same shapes (sdpa attention). The
two are stepped alternately and the median of ``--steps`` steps after two warm-up
steps is reported, so a change of load hits both alike. Then what each costs every
process that imports it: the seconds and resident memory of ``import torch`` alone
and of ``import torch`` plus ``from transformers import LlamaForCausalLM``, each in a
fresh interpreter (median of three).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.report import (
    environment,
    md_table,
    output_args,
    publish,
    rerendered,
    stop_on_sigterm,
)

# VmHWM, not ru_maxrss: the latter survives exec, so it would report this process's peak
_IMPORT = ("import time; t = time.perf_counter(); {code}; s = time.perf_counter() - t; "
           "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]; "
           "print(s, hwm.split()[1])")


def import_cost(code: str, repeats: int = 3) -> dict[str, float]:
    """Median seconds and peak RSS (MB) of running ``code`` in a fresh interpreter."""
    seconds, rss = [], []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", _IMPORT.format(code=code)], check=True,
                             capture_output=True, text=True).stdout.split()
        seconds.append(float(out[0]))
        rss.append(int(out[1]) / 1024)
    return {"seconds": statistics.median(seconds), "rss_mb": statistics.median(rss)}


def step_times(preset: str, steps: int, seq_len: int, threads: int) -> dict[str, Any]:
    import torch  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    from workers.model import build_model  # noqa: PLC0415
    from workers.model_config import PRESETS  # noqa: PLC0415

    torch.set_num_threads(threads)
    c = PRESETS[preset]
    ours = build_model(c)
    theirs = LlamaForCausalLM(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.mlp_dim,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.kv_heads, max_position_embeddings=c.max_seq_len,
        rope_theta=c.rope_theta, rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings, attn_implementation="sdpa"))
    x = torch.randint(0, c.vocab_size, (16, seq_len), generator=torch.Generator().manual_seed(0))
    losses = {"ours": lambda: ours(x, x)[1], "transformers": lambda: theirs(
        input_ids=x, labels=x).loss}
    opts = {"ours": torch.optim.AdamW(ours.parameters(), lr=1e-4),
            "transformers": torch.optim.AdamW(theirs.parameters(), lr=1e-4)}
    times: dict[str, list[float]] = {k: [] for k in losses}
    for i in range(steps + 2):
        for name, loss in losses.items():
            t0 = time.perf_counter()
            loss().backward()
            opts[name].step()
            opts[name].zero_grad()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    return {"preset": preset, "parameters": sum(p.numel() for p in ours.parameters()),
            **{f"{k}_ms": 1000 * statistics.median(v) for k, v in times.items()}}


def markdown(report: dict[str, Any]) -> str:
    rows = [[r["preset"], f"{r['parameters']:,}", f"{r['ours_ms']:.0f}",
             f"{r['transformers_ms']:.0f}", f"{r['transformers_ms'] / r['ours_ms']:.2f}"]
            for r in report["steps"]]
    imp = report["imports"]
    extra = [["import torch", f"{imp['torch']['seconds']:.2f}", f"{imp['torch']['rss_mb']:.0f}"],
             ["+ transformers", f"{imp['transformers']['seconds']:.2f}",
              f"{imp['transformers']['rss_mb']:.0f}"]]
    env = report["environment"]
    return "\n\n".join([
        "# Our model class against transformers' LlamaForCausalLM",
        f"ms per training step (fwd + bwd + AdamW), batch 16 x {report['seq_len']}, "
        f"{report['threads']} threads, median of {report['steps_measured']} alternated steps.",
        md_table(["preset", "parameters", "ours ms", "transformers ms", "ratio"], rows),
        f"What importing costs each process (fresh interpreter, median of {report['import_repeats']}):",
        md_table(["import", "seconds", "peak RSS MB"], extra),
        f"Command: `{env['command']}`; load average at start {env['machine'].get('load_average_at_start')}.",
    ])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks.bench_model", description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--import-repeats", type=int, default=3)
    output_args(p, "model", "accepted for run_all; nothing is logged")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    if (saved := rerendered(args, markdown)) is not None:
        return saved
    env = environment(argv, "benchmarks.bench_model")
    t0 = time.perf_counter()
    steps = [step_times(p.strip(), args.steps, args.seq_len, args.threads)
             for p in args.presets.split(",") if p.strip()]
    n = args.import_repeats
    imports = {"torch": import_cost("import torch", n),
               "transformers": import_cost(
                   "import torch; from transformers import LlamaForCausalLM", n)}
    report = {"steps": steps, "imports": imports, "seq_len": args.seq_len,
              "threads": args.threads, "steps_measured": args.steps, "import_repeats": n,
              "environment": env,
              "wall_seconds": time.perf_counter() - t0}
    return publish(args.out, report, markdown, args.results_dir)


if __name__ == "__main__":
    stop_on_sigterm()
    main()
