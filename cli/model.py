"""``diloco export`` and ``diloco sample``: take a run's canonical model away as a
Hugging Face model directory, or look at what it learned (`workers.export` does the
work; torch is imported only when a command runs)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from cli.console import console, errors, fail, shown, user_errors
from cli.run import open_named_run

_ROUND_HELP = ("rounds applied to every fragment: 0 is the initial model; default the "
               "newest round every fragment has committed")


def _non_empty(out: Path) -> bool:
    return out.exists() and (not out.is_dir() or any(out.iterdir()))


def export(
    run: Annotated[str, typer.Argument(help="a run URL, or a run's name under runs/")],
    out: Annotated[Path, typer.Option(help="the directory to write (new or empty)")],
    round: Annotated[int | None, typer.Option(  # noqa: A002 - the option's name
        "--round", help=_ROUND_HELP)] = None,
    max_shard_mb: Annotated[int, typer.Option(
        help="largest safetensors file; bigger models are sharded with an index")] = 2048,
) -> None:
    """Write the run's canonical model as safetensors + config.json (+ tokenizer.json):
    transformers.AutoModelForCausalLM.from_pretrained(OUT) loads it."""
    if _non_empty(out):
        raise fail(f"--out {out} exists and is not an empty directory; an export never "
                   "overwrites: choose a new directory")
    if max_shard_mb < 1:
        raise fail(f"--max-shard-mb must be >= 1, got {max_shard_mb}")
    url, exchange = open_named_run(run)
    from workers.export import export_run  # noqa: PLC0415 - torch

    try:
        with console.status("reading the canonical model ..."):
            done = export_run(exchange, out, rounds=round,
                              max_shard_bytes=max_shard_mb << 20)
    except (*user_errors(), ValueError, OSError) as exc:
        raise fail(str(exc)) from None
    console.print(f"exported {shown(url)} after round {done.rounds}/{done.total_rounds}: "
                  f"{done.parameters:,} parameters, {done.bytes / 1e6:.1f} MB in {done.out}")
    console.print("  " + ", ".join(done.files))
    console.print("load it with: transformers.AutoModelForCausalLM.from_pretrained("
                  f"{str(done.out)!r})")


def sample(
    run: Annotated[str, typer.Argument(help="a run URL, or a run's name under runs/")],
    prompt: Annotated[str, typer.Option(help="the text to continue")],
    tokens: Annotated[int, typer.Option(help="how many tokens to generate")] = 200,
    temperature: Annotated[float, typer.Option(help="0 is greedy")] = 0.8,
    top_k: Annotated[int, typer.Option(help="sample among the k likeliest; 0: all")] = 50,
    seed: Annotated[int, typer.Option(help="the same seed gives the same text")] = 0,
    round: Annotated[int | None, typer.Option(  # noqa: A002 - the option's name
        "--round", help=_ROUND_HELP)] = None,
) -> None:
    """Print a continuation of PROMPT by the run's canonical model."""
    for name, value in (("--tokens", tokens), ("--temperature", temperature),
                        ("--top-k", top_k)):
        if value < 0:
            raise fail(f"{name} must be >= 0, got {value}")
    if not prompt:
        raise fail("--prompt is empty: give the text to continue")
    _, exchange = open_named_run(run)
    from workers.export import sample as continue_text  # noqa: PLC0415 - torch

    try:
        with console.status("sampling ..."):
            text, canon = continue_text(exchange, prompt, rounds=round, max_new_tokens=tokens,
                                        temperature=temperature, top_k=top_k, seed=seed)
    except (*user_errors(), ValueError, OSError) as exc:
        raise fail(str(exc)) from None
    errors.print(f"round {canon.rounds}/{canon.total_rounds}, {tokens} tokens, temperature "
                 f"{temperature}, top-k {top_k}, seed {seed}", markup=False, highlight=False)
    sys.stdout.write(prompt + text + "\n")  # exactly the text: no wrapping, no markup
