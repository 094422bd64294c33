"""``diloco prepare-data``: tokenise text into a dataset in a store, with a progress
bar (`workers.data` does the work)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from cli.console import console, fail, user_errors
from workers.data.prepare import prepare_data as prepare


def prepare_data(
    sources: Annotated[list[str], typer.Argument(
        help="files, folders, glob patterns, fsspec URLs, or builtin:shakespeare[/part]")],
    out: Annotated[str, typer.Option(help="the dataset's URL: a path, file://, s3://...")],
    tokenizer: Annotated[str, typer.Option(
        help="'byte', or a Hugging Face tokenizers .json file")] = "byte",
    val_fraction: Annotated[float, typer.Option(
        help="fraction of each file's tokens held out for validation")] = 0.01,
    max_files: Annotated[int | None, typer.Option(help="read only the first N files")] = None,
    max_bytes: Annotated[int | None, typer.Option(help="stop after N bytes of text")] = None,
    dtype: Annotated[str | None, typer.Option(
        help="id type of raw .bin token shards: uint16 (default) or uint32")] = None,
    column: Annotated[str | None, typer.Option(
        help="the text or token column of Parquet/Arrow sources")] = None,
) -> None:
    """Tokenise text into a dataset in a store (what a run's data.dataset points at)."""
    try:
        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("tokenising", total=None)

            def show(name: str, done: int, total: int) -> None:  # bytes of the sources
                bar.update(task, completed=done, total=total, description=name[-40:])

            info = prepare(sources, out, tokenizer=tokenizer, val_fraction=val_fraction,
                           progress=show, max_files=max_files, max_bytes=max_bytes,
                           dtype=dtype, column=column)
    except (*user_errors(), ValueError, OSError, ImportError) as exc:
        raise fail(str(exc)) from None
    console.print(f"dataset {info.url}: {info.files} files, {info.bytes_read:,} bytes read, "
                  f"{info.train_tokens:,} train and {info.val_tokens:,} val tokens "
                  f"({info.seconds:.1f} s, "
                  f"{info.bytes_read / 1e6 / max(info.seconds, 1e-9):.1f} MB/s)")
    for note in info.notes:
        console.print(note)
    console.print(f"use it with: diloco run --set data.dataset={info.url}")
