"""Flat token shards users already have, used in place: finding and indexing them.

Formats (one 1-D array of token ids per file, little-endian):

- ``.bin`` raw: nanoGPT's convention, the ids back to back, uint16 (the default)
  or uint32 (``dtype="uint32"``, the run's ``data.dtype``);
- ``.bin`` with llm.c's header (also modded-nanogpt's): 256 int32, magic
  20240520 / version 1 for uint16 ids (GPT-2) or magic 20240801 / version 7 for
  uint32 ids (Llama 3), the token count third; recognised by the magic;
- ``.npy``: a 1-D uint16 or uint32 array (the header says which).

Indexing (`index_shard`) reads a shard once, streaming in `READ_BYTES` pieces,
never whole: it checks every id against the vocabulary (uint16 data read as
uint32 shows up as huge ids; uint32 read as uint16 as every second id being 0)
and records a crc32c per `BLOCK_BYTES` of token data, which readers
(`workers.data.lazy`) verify block by block. Every check runs before anything is
written, so a bad shard leaves the output empty.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any

import fsspec
import google_crc32c
import numpy as np

from workers.data.errors import ShardInvalid, SourceNotFound
from workers.data.manifest import ShardEntry

SHARD_SUFFIXES = (".bin", ".npy")
#: Bytes of token data per checksum block (a multiple of every item size).
BLOCK_BYTES = 1 << 16
#: Bytes read at a time while indexing (a multiple of BLOCK_BYTES).
READ_BYTES = 1 << 24
#: llm.c header magics: magic -> (version, dtype)
LLMC_MAGICS = {20240520: (1, "uint16"), 20240801: (7, "uint32")}
LLMC_HEADER_BYTES = 256 * 4
DTYPES = ("uint16", "uint32")


@dataclass(frozen=True)
class ShardFile:
    """A token shard found by `find_shards`."""

    name: str  # as found (for messages)
    url: str  # absolute URL
    size: int
    fs: Any
    path: str

    @property
    def local(self) -> bool:
        protocol = self.fs.protocol
        return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))


def is_shard(name: str) -> bool:
    """Whether ``name`` is a flat token shard (by its suffix)."""
    return name.lower().endswith(SHARD_SUFFIXES)


def find_shards(src: str, storage_options: dict | None = None) -> list[ShardFile] | None:
    """The shards ``src`` names (a file, a glob, or a directory holding shards and
    no text files), or None if ``src`` names no shard (then it is text)."""
    try:
        fs, root = fsspec.core.url_to_fs(src, **(storage_options or {}))
    except (ValueError, ImportError):
        return None
    if any(c in root for c in "*?["):
        found = {p: i for p, i in fs.glob(root, detail=True).items() if i.get("type") == "file"}
    elif fs.isdir(root):
        found = fs.find(root, detail=True)
        if any(p.lower().endswith((".txt", ".md")) for p in found):
            return None
    elif fs.isfile(root):
        found = {root: fs.info(root)}
    else:
        return None
    shards = {p: i for p, i in sorted(found.items()) if is_shard(p)}
    if not shards:
        return None
    if len(shards) != len(found) and any(c in root for c in "*?["):
        others = sorted(set(found) - set(shards))[:3]
        raise SourceNotFound(
            f"the pattern {src!r} matches token shards and other files ({others}); "
            f"name only {'/'.join(SHARD_SUFFIXES)} shards, or only text"
        )
    return [
        ShardFile(p if "://" not in src else fs.unstrip_protocol(p), fs.unstrip_protocol(p),
                  int(info.get("size") or 0), fs, p)
        for p, info in shards.items()
    ]


def _layout(f: ShardFile, head: bytes, dtype: str | None) -> tuple[str, str, int]:
    """(kind, dtype, header bytes) of shard ``f`` from its first bytes."""
    if f.path.lower().endswith(".npy"):
        return ("npy", *_npy_layout(f, head, dtype))
    if len(head) >= LLMC_HEADER_BYTES:
        header = np.frombuffer(head[:LLMC_HEADER_BYTES], dtype="<i4")
        if int(header[0]) in LLMC_MAGICS:
            version, kind_dtype = LLMC_MAGICS[int(header[0])]
            if int(header[1]) != version:
                raise ShardInvalid(
                    f"shard {f.name}: llm.c header magic {int(header[0])} with version "
                    f"{int(header[1])}; known: version {version} ({kind_dtype} ids)"
                )
            _agree(f, kind_dtype, dtype, "its llm.c header")
            expected = LLMC_HEADER_BYTES + int(header[2]) * np.dtype(kind_dtype).itemsize
            if f.size != expected:
                raise ShardInvalid(
                    f"shard {f.name}: its llm.c header says {int(header[2])} {kind_dtype} "
                    f"tokens ({expected} bytes with the header), the file has {f.size} bytes"
                )
            return "llmc", kind_dtype, LLMC_HEADER_BYTES
    chosen = dtype or "uint16"
    if f.size % np.dtype(chosen).itemsize:
        raise ShardInvalid(
            f"shard {f.name}: {f.size} bytes is not a whole number of {chosen} ids; "
            f"data.dtype must be one of {DTYPES} and match the file"
        )
    return "bin", chosen, 0


def _npy_layout(f: ShardFile, head: bytes, dtype: str | None) -> tuple[str, int]:
    fp = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(fp)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        shape, _, found = read(fp)
    except Exception as exc:  # noqa: BLE001 - numpy raises several kinds here
        raise ShardInvalid(f"shard {f.name}: not a readable .npy file: {exc}") from None
    if found.kind != "u" or found.itemsize not in (2, 4) or found.byteorder == ">":
        raise ShardInvalid(
            f"shard {f.name}: the .npy dtype is {found.name} ({found.str}); token shards "
            f"hold little-endian {' or '.join(DTYPES)} ids: convert it, e.g. "
            "np.save(path, ids.astype(np.uint16))"
        )
    if len(shape) != 1:
        raise ShardInvalid(f"shard {f.name}: the .npy array has shape {shape}; it must be 1-D")
    _agree(f, found.name, dtype, "its .npy header")
    return found.name, fp.tell()


def _agree(f: ShardFile, found: str, dtype: str | None, where: str) -> None:
    if dtype is not None and dtype != found:
        raise ShardInvalid(f"shard {f.name}: data.dtype is {dtype}, but {where} says {found}")


def index_shard(
    f: ShardFile, *, dtype: str | None, vocab_size: int, min_tokens: int = 1,
    block_bytes: int = BLOCK_BYTES,
) -> ShardEntry:
    """Check shard ``f`` in one streaming pass and describe it (see the module
    docstring). Raises `ShardInvalid` naming the file and what is wrong."""
    if dtype is not None and dtype not in DTYPES:
        raise ShardInvalid(f"data.dtype must be one of {DTYPES}, got {dtype!r}")
    with f.fs.open(f.path, "rb") as fh:
        head = fh.read(4096)
        kind, found, header = _layout(f, head, dtype)
        item = np.dtype(found).itemsize
        tokens = (f.size - header) // item
        if tokens < min_tokens:
            raise ShardInvalid(
                f"shard {f.name} holds {tokens} tokens, fewer than one sequence of "
                f"seq_len + 1 = {min_tokens}"
            )
        fh.seek(header)
        crcs: list[int] = []
        odd_zero, any_even = True, False
        done = 0
        while done < tokens:
            chunk = fh.read(min(READ_BYTES, (tokens - done) * item))
            if not chunk:
                raise ShardInvalid(f"shard {f.name}: ends early, at token {done} of {tokens}")
            crcs.extend(
                google_crc32c.value(chunk[i : i + block_bytes])
                for i in range(0, len(chunk), block_bytes)
            )
            ids = np.frombuffer(chunk, dtype=f"<u{item}")
            top = int(ids.max())
            if top >= vocab_size:
                at = done + int(np.argmax(ids >= vocab_size))
                raise ShardInvalid(
                    f"shard {f.name}: id {top} (first bad one at token {at}) is outside the "
                    f"vocabulary of {vocab_size} as {found}; is data.dtype right "
                    f"({'/'.join(DTYPES)}), and the tokenizer?"
                )
            odd_zero = odd_zero and not ids[1::2].any()
            any_even = any_even or bool(ids[::2].any())
            done += len(ids)
    if found == "uint16" and tokens >= 4 and odd_zero and any_even:
        raise ShardInvalid(
            f"shard {f.name}: every second id is 0: this looks like uint32 ids read as "
            "uint16; set data.dtype to uint32"
        )
    crc = np.asarray(crcs, dtype="<u4").tobytes()
    return ShardEntry(url=f.url, kind=kind, dtype=found, header_bytes=header, tokens=tokens,
                      block_bytes=block_bytes, crc32c=base64.b64encode(crc).decode())
