"""Preparing a dataset from token shards: an index, not a copy.

`index_sources` checks every shard in one streaming pass (`shards.index_shard`)
before anything is written, then writes only ``dataset.json`` (format 2): the
shards by absolute URL with their block checksums, one file entry per shard
with its train/val split (the last ``val_fraction`` of its tokens, as for a text
file). A local shard is referenced where it is, unless the dataset store is
remote (S3 and the like), where workers elsewhere could not read it: then it is
copied (streamed) into the store under ``shards/``.
"""

from __future__ import annotations

from dataclasses import dataclass

import fsspec

from workers.data.errors import DataError
from workers.data.manifest import Counts, FileEntry, ShardedManifest, ShardEntry, TokenizerEntry
from workers.data.token_shards import ShardFile, find_shards, index_shard

#: Store protocols whose workers can read a local path of the preparing machine.
LOCAL_PROTOCOLS = ("file", "memory")


@dataclass(frozen=True)
class IndexResult:
    """What `index_sources` decided; nothing is written yet."""

    manifest: ShardedManifest
    copies: list[tuple[ShardFile, str]]  # (local shard, key in the dataset store)
    bytes_read: int


def collect_shards(
    sources: list[str], opts_for: dict[str, dict]
) -> list[ShardFile] | None:
    """The shards of ``sources``, or None if none of them names shards (text)."""
    found = [find_shards(s, opts_for.get(s)) for s in sources]
    if all(f is None for f in found):
        return None
    if any(f is None for f in found):
        text = [s for s, f in zip(sources, found, strict=True) if f is None]
        raise DataError(
            f"sources {text!r} are text while the others are token shards; prepare text and "
            "shards as separate datasets"
        )
    out, seen = [], set()
    for group in found:
        for f in group or []:
            if f.url not in seen:
                seen.add(f.url)
                out.append(f)
    return out


def index_sources(
    shards: list[ShardFile], sources: list[str], *, tokenizer: TokenizerEntry,
    dtype: str | None, val_fraction: float, min_tokens: int, out_protocol: str,
    progress=None,  # noqa: ANN001 - prepare.Progress; kept loose to avoid a cycle
) -> IndexResult:
    """Index ``shards`` (see the module docstring); raises `ShardInvalid` for the
    first shard that fails a check."""
    total = sum(f.size for f in shards)
    entries: list[ShardEntry] = []
    files: list[FileEntry] = []
    copies: list[tuple[ShardFile, str]] = []
    done = 0
    for i, f in enumerate(shards):
        entry = index_shard(f, dtype=dtype, vocab_size=tokenizer.vocab_size,
                            min_tokens=min_tokens)
        if f.local and out_protocol not in LOCAL_PROTOCOLS:
            key = f"shards/{i:05d}-{f.path.rsplit('/', 1)[-1]}"
            copies.append((f, key))
            entry = entry.model_copy(update={"url": key, "stored": True})
        entries.append(entry)
        n_val = min(entry.tokens, int(entry.tokens * val_fraction + 0.5))
        files.append(FileEntry(name=f.name, bytes=f.size, tokens=entry.tokens,
                               train_tokens=entry.tokens - n_val, val_tokens=n_val))
        done += f.size
        if progress is not None:
            progress(f.name, done, total)
    dtype_all = "uint32" if any(e.dtype == "uint32" for e in entries) else "uint16"
    manifest = ShardedManifest(
        tokenizer=tokenizer, dtype=dtype_all, val_fraction=val_fraction, sources=list(sources),
        files=files, shards=entries,
        counts=Counts(files=len(files), bytes=total, tokens=sum(e.tokens for e in entries),
                      train_tokens=sum(x.train_tokens for x in files),
                      val_tokens=sum(x.val_tokens for x in files)),
    )
    return IndexResult(manifest, copies, total)


def copy_shards(copies: list[tuple[ShardFile, str]], store_url_of, storage_options: dict | None
                ) -> int:  # noqa: ANN001
    """Upload the local shards to their keys (streamed by fsspec); bytes copied."""
    copied = 0
    for f, key in copies:
        fs, path = fsspec.core.url_to_fs(store_url_of(key), **(storage_options or {}))
        fs.put_file(f.path, path)
        copied += f.size
    return copied
