"""The product of a run, taken away: its canonical model as a Hugging Face model
directory (`export_run`), or a continuation of a prompt (`sample`).

The canonical model is what the aggregator holds: per fragment, the newest canonical
checkpoint at or before the chosen round, then the committed means after it replayed
through the outer step (`diloco.bootstrap.canonical_after`). "Round N" counts rounds
applied to every fragment: 0 is the initial parameters, the newest is the last round
every fragment has committed, so an export of a run still training is a consistent
model, never half of one round.

The export is ``config.json`` (the user's own ``model.hf_config`` when the run was
built from one, else a Llama config), safetensors weights (sharded above
``max_shard_bytes``) and, when the run's tokenizer is a file, ``tokenizer.json``:
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads it, with nothing
from this project installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.bootstrap import canonical_after
from diloco.run import plan_for
from storage.exchange import Exchange
from workers.config import RunConfig
from workers.data.streams import open_dataset
from workers.hf_weights import write_hf_model
from workers.model import Transformer, build_model
from workers.tokenizer import Tokenizer


@dataclass
class Canonical:
    """A run's canonical model after ``rounds`` of its ``total_rounds`` rounds."""

    model: Transformer
    config: RunConfig
    rounds: int
    total_rounds: int


def canonical_model(exchange: Exchange, rounds: int | None = None) -> Canonical:
    """The canonical model of the run after ``rounds`` rounds of every fragment
    (``None``: the newest such round). ValueError names the rounds there are."""
    cfg = RunConfig.stored(exchange.manifest.config)
    model = build_model(cfg.model_config_resolved, seed=cfg.train.seed)
    plan = plan_for(model, cfg.sync)
    sizes = [f.numel for f in exchange.manifest.fragments]
    if [f.numel for f in plan.fragments] != sizes:
        raise ValueError(
            f"the run's fragments hold {sizes} parameters, but its config builds "
            f"{[f.numel for f in plan.fragments]}: the run was written by another version")
    rounds, params = canonical_after(exchange, cfg.sync, rounds)
    with torch.no_grad():
        for p, flat in enumerate(params):
            plan.scatter(model, p, flat.detach())
    model.eval()
    return Canonical(model, cfg, rounds, min(exchange.manifest.rounds))


def run_tokenizer(exchange: Exchange, storage_options: dict | None = None
                  ) -> tuple[Tokenizer, bytes | None]:
    """The run's tokenizer, and its ``tokenizer.json`` bytes when it is a file (read
    from the run's dataset, so any machine that reaches the store has it)."""
    cfg = RunConfig.stored(exchange.manifest.config)
    dataset = open_dataset(cfg.dataset_url(exchange.store.url), storage_options)
    return dataset.tokenizer(storage_options), dataset.tokenizer_file(storage_options)


@dataclass
class Exported:
    """What `export_run` wrote."""

    out: str
    files: list[str]
    rounds: int
    total_rounds: int
    parameters: int
    bytes: int


def export_run(exchange: Exchange, out_dir: str | Path, *, rounds: int | None = None,
               storage_options: dict | None = None,
               max_shard_bytes: int = 2 << 30) -> Exported:
    """Write the canonical model after ``rounds`` rounds as a Hugging Face model
    directory at ``out_dir`` (which must not exist or be empty; written in a sibling
    temporary directory and renamed, so a crash leaves no half model)."""
    canon = canonical_model(exchange, rounds)
    _, tokenizer_json = run_tokenizer(exchange, storage_options)
    extra = {"tokenizer.json": tokenizer_json} if tokenizer_json is not None else {}
    files = write_hf_model(canon.model, out_dir, base_config=canon.config.model.hf,
                           max_shard_bytes=max_shard_bytes, extra_files=extra)
    out = Path(out_dir)
    return Exported(
        out=str(out), files=files, rounds=canon.rounds, total_rounds=canon.total_rounds,
        parameters=sum(p.numel() for p in canon.model.parameters()),
        bytes=sum((out / f).stat().st_size for f in files))


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], *, max_new_tokens: int,
             temperature: float = 0.8, top_k: int = 50, seed: int = 0) -> list[int]:
    """``max_new_tokens`` ids after ``prompt``, sampled from the model: temperature 0
    is greedy; ``top_k`` > 0 keeps only the k likeliest; the same seed gives the same
    ids. The context is the last ``max_seq_len`` ids (no cache: this is for a look at
    what a run learned, not for serving)."""
    if max_new_tokens < 0 or temperature < 0 or top_k < 0:
        raise ValueError("tokens, temperature and top_k must be >= 0")
    if not prompt:
        raise ValueError("the prompt is empty: give at least one character")
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    window = model.config.max_seq_len
    for _ in range(max_new_tokens):
        x = torch.tensor([ids[-window:]], dtype=torch.long)
        logits, _ = model(x)
        last = logits[0, -1].float()
        if temperature == 0:
            ids.append(int(last.argmax()))
            continue
        last = last / temperature
        if 0 < top_k < last.numel():
            cut = torch.topk(last, top_k).values[-1]
            last = last.masked_fill(last < cut, float("-inf"))
        ids.append(int(torch.multinomial(torch.softmax(last, -1), 1, generator=gen)))
    return ids[len(prompt):]


def sample(exchange: Exchange, prompt: str, *, rounds: int | None = None,
           max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 50,
           seed: int = 0, storage_options: dict | None = None) -> tuple[str, Canonical]:
    """The continuation of ``prompt`` by the run's canonical model (see `generate`)."""
    tokenizer, _ = run_tokenizer(exchange, storage_options)
    canon = canonical_model(exchange, rounds)
    ids = [int(i) for i in tokenizer.encode(prompt)]
    out = generate(canon.model, ids, max_new_tokens=max_new_tokens,
                   temperature=temperature, top_k=top_k, seed=seed)
    return tokenizer.decode(out), canon
