"""The recipe every benchmark shares: model, data, optimizer, and the sync settings.

The benchmarks compare training strategies on the same model, data, seed and token
budget. This module holds that common ground:

- the reference recipe (``reference_overrides``): a 0.89M-parameter byte-level
  Llama on the installed Shakespeare corpus, close to the 0.87M reference model of
  the reference measurements (docs/results.md);
- the synchronisation modes (``MODES``) and codec pairs (``CODECS``) a contender
  picks from, and the labels the reports print for them;
- the dataset, prepared once into a local directory (``ensure_dataset``).

What a contender is and how one runs is in ``benchmarks.contenders``.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

log = logging.getLogger("benchmarks")


# About the reference model of the reference measurements (docs/results.md) (0.87M parameters, byte level):
# 4 blocks of width 128, 4 heads, SwiGLU 384: 885,888 parameters.
REFERENCE_MODEL = "{d_model: 128, n_layers: 4, n_heads: 4, max_seq_len: 128}"


def reference_overrides(steps: int = 600, data_url: str | None = None, *,
                        every_member: bool = False) -> list[str]:
    """The quality recipe: tiny's optimizer, the reference model, 16 x 64 tokens a step.

    ``every_member``: every round waits for all workers (quorum 1), so a loss does not
    depend on how loaded the machine was; on a busy machine the aggregator's grace
    window otherwise closes rounds without a slow worker's contribution."""
    out = [
        f"model.overrides={REFERENCE_MODEL}",
        "data.seq_len=64",
        "data.batch_size=16",
        "optim.lr=3e-3",
        "optim.warmup_steps=30",
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.eval_batches=32",
        "train.checkpoint_every=0",
        "train.log_every=10",
        "train.threads=1",
        "train.seed=0",
    ]
    if data_url:
        out.append(f"data.dataset={data_url}")
    if every_member:
        out.append("sync.membership.quorum=1.0")
    return out


# Synchronisation modes (docs/algorithms.md sections 4-6); H is set per contender.
MODES: dict[str, list[str]] = {
    "diloco": ["sync.schedule.mode=diloco", "sync.schedule.fragments=1", "sync.schedule.overlap=0"],
    "streaming": ["sync.schedule.mode=streaming", "sync.schedule.fragments=2", "sync.schedule.overlap=1",
                  "sync.schedule.alpha=0.5"],
    # tau sized per merge point to the measured exchange latency (diloco/overlap.py)
    "streaming-auto": ["sync.schedule.mode=streaming", "sync.schedule.fragments=2", "sync.schedule.overlap=auto",
                       "sync.schedule.alpha=0.5"],
    # the same, its first two merge points at tau 1 (they wait one round trip each)
    "streaming-auto-1": ["sync.schedule.mode=streaming", "sync.schedule.fragments=2", "sync.schedule.overlap=auto",
                         "sync.schedule.overlap_start=1", "sync.schedule.alpha=0.5"],
    "eager": ["sync.schedule.mode=eager", "sync.schedule.eager_rule=adaptive", "sync.schedule.fragments=2",
              "sync.schedule.overlap=1", "sync.schedule.alpha=0.5"],
    "pure-eager": ["sync.schedule.mode=eager", "sync.schedule.eager_rule=pure", "sync.schedule.fragments=2",
                   "sync.schedule.overlap=0"],
    # the eager paper's baseline: the previous round's mean alone
    "naive-eager": ["sync.schedule.mode=eager", "sync.schedule.eager_rule=naive", "sync.schedule.fragments=2",
                    "sync.schedule.overlap=0"],
    # never waits, and the means are on time: the best never-waiting setting of the
    # eager sweep (benchmarks/results/eager-sweep.jsonl); needs H/P > 12
    "eager-tau12": ["sync.schedule.mode=eager", "sync.schedule.eager_rule=adaptive", "sync.schedule.fragments=2",
                    "sync.schedule.overlap=12", "sync.schedule.alpha=0.3"],
}
MODE_LABELS = {
    "data-parallel": "data-parallel",
    "diloco": "DiLoCo (blocking)",
    "streaming": "streaming (tau=1, alpha=0.5)",
    "streaming-auto": "streaming (overlap auto, alpha=0.5)",
    "streaming-auto-1": "streaming (overlap auto from tau 1, alpha=0.5)",
    "eager-tau12": "adaptive eager (tau=12, alpha=0.3)",
    "eager": "adaptive eager (tau=1, alpha=0.5)",
    "pure-eager": "pure eager (paper's rule)",
    "naive-eager": "naive delayed (previous mean only)",
}
# Error feedback stays at the product default: on for int4 up, off for int8 down.
# The sparse codecs send the top k = 64 of every 4096 values with 2-bit codes and a
# decaying error-feedback accumulator (beta 0.95, SparseLoCo); the way down is the
# aggregator's int8 mean (``topk2``) or each worker summing its peers' contributions
# (``topk2-peers``).
CODECS: dict[str, list[str]] = {
    "fp32": ["sync.codec.up=none", "sync.codec.down=none"],
    "int4": ["sync.codec.up=int4", "sync.codec.down=int8"],
    "topk2": ["sync.codec.up=topk2", "sync.codec.down=int8", "sync.codec.mean_from=aggregator"],
    "topk2-peers": ["sync.codec.up=topk2", "sync.codec.mean_from=peers"],
    "topk4-peers": ["sync.codec.up=topk4", "sync.codec.mean_from=peers"],
    # sparse exchange pays off with frequent rounds: H = 8 with the k that keeps the
    # upload 2,000x below data-parallel's at M = 2 (33) and at M = 4 (62)
    "topk2-h8": ["sync.codec.up=topk2", "sync.codec.mean_from=peers", "sync.schedule.sync_every=8",
                 "sync.codec.k=33"],
    "topk2-h8-k62": ["sync.codec.up=topk2", "sync.codec.mean_from=peers", "sync.schedule.sync_every=8",
                     "sync.codec.k=62"],
}
CODEC_LABELS = {"fp32": "float32", "int4": "int4 up / int8 down",
                "topk2": "top-64/4096 2-bit up / int8 down",
                "topk2-peers": "top-64/4096 2-bit up / peers down",
                "topk4-peers": "top-64/4096 4-bit up / peers down",
                "topk2-h8": "top-33/4096 2-bit up / peers down, H=8",
                "topk2-h8-k62": "top-62/4096 2-bit up / peers down, H=8"}


# -- data ----------------------------------------------------------------------------


def default_data_dir() -> Path:
    return Path(tempfile.gettempdir()) / "diloco-bench-data"


def ensure_dataset(where: Path | None = None) -> str:
    """The byte-level Shakespeare dataset, prepared once into a local directory."""
    from workers.data.errors import DatasetMissing  # noqa: PLC0415
    from workers.data.prepare import prepare_data  # noqa: PLC0415
    from workers.data.streams import open_dataset  # noqa: PLC0415

    where = (where or default_data_dir()) / "shakespeare-byte"
    url = where.as_uri()
    try:
        open_dataset(url)
    except DatasetMissing:
        log.info("preparing byte-level Shakespeare at %s", where)
        where.parent.mkdir(parents=True, exist_ok=True)
        prepare_data(["builtin:shakespeare"], url, tokenizer="byte", val_fraction=0.01)
    return url
