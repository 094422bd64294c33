"""Streaming preparation: text read in blocks, tokens written as flat shards.

`text_blocks` reads a text file in blocks of `TEXT_BLOCK` bytes, each cut after
its last newline (the rest starts the next block), so a file of any size is
tokenised with one block in memory. A BPE tokenizer may tokenise across a cut
(and, with `encode_text`, across a line break) differently from the whole file
at once; the byte tokenizer gives exactly the file's bytes either way.

`ShardWriter` appends token ids in order and uploads them as flat little-endian
token objects (``tokens/00000.bin``, ...) of at most `SHARD_BYTES`, each as it
fills, recording a crc32c per block and a sha256 per object: the same shards
`workers.data.lazy` reads for user-provided ``.bin`` files, so readers have one
lazy path for everything.
"""

from __future__ import annotations

import base64
import codecs
import hashlib
from collections.abc import Iterator

import google_crc32c
import numpy as np

from storage.objectstore import ObjectStore
from workers.data.errors import DataError
from workers.data.manifest import ShardEntry
from workers.data.sources import SourceFile
from workers.data.token_shards import BLOCK_BYTES
from workers.tokenizer import HFTokenizer, Tokenizer

#: Bytes of text read and tokenised at a time.
TEXT_BLOCK = 16 << 20
#: Largest token object written (a multiple of BLOCK_BYTES).
SHARD_BYTES = 64 << 20
#: Where the token objects go in the dataset store.
TOKENS_PREFIX = "tokens"


def text_blocks(
    src: SourceFile, limit: int | None, block_bytes: int | None = None
) -> Iterator[tuple[str, int]]:
    """(text, bytes of the file consumed so far) per block of ``src``, reading at
    most ``limit`` bytes (None: all; a character cut by the limit is dropped).
    Raises `DataError` naming the file if it is not UTF-8."""
    block_bytes = block_bytes or TEXT_BLOCK
    decoder = codecs.getincrementaldecoder("utf-8")()
    consumed, carry = 0, b""
    with src.open() as f:
        while True:
            want = block_bytes if limit is None else min(block_bytes, limit - consumed)
            data = f.read(want) if want > 0 else b""
            consumed += len(data)
            truncated = limit is not None and consumed >= limit and src.size > limit
            eof = not data or (limit is not None and consumed >= limit)
            start, buf = consumed - len(data) - len(carry), carry + data
            carry = b""
            if not eof:
                cut = buf.rfind(b"\n") + 1 or len(buf)
                buf, carry = buf[:cut], buf[cut:]
            try:
                text = decoder.decode(buf, final=eof and not truncated)
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"source file {src.name!r} is not UTF-8 text (byte {start + exc.start}: "
                    f"{exc.reason})"
                ) from None
            if text:
                yield text, consumed
            if eof:
                return


def encode_text(tok: Tokenizer, text: str, dtype: np.dtype, name: str) -> np.ndarray:
    """The ids of ``text`` as ``dtype``, checked against the vocabulary. A Hugging
    Face tokenizer encodes the block's lines in one parallel batch (much faster
    than one call on the whole block)."""
    if isinstance(tok, HFTokenizer):
        ids = tok.encode_lines(text)
    else:
        ids = np.asarray(tok.encode(text))
    if ids.size == 0:
        return np.zeros(0, dtype)
    if ids.min() < 0 or ids.max() >= tok.vocab_size:
        raise DataError(
            f"{name}: tokenizer {tok.name} produced ids outside 0..{tok.vocab_size - 1}"
        )
    return ids.astype(dtype, copy=False)


class ShardWriter:
    """Token ids appended in order, uploaded as flat token objects (see the module
    docstring). `close` uploads the last one and returns their index entries."""

    def __init__(self, store: ObjectStore, dtype: np.dtype, *, shard_bytes: int | None = None,
                 block_bytes: int = BLOCK_BYTES) -> None:
        shard_bytes = shard_bytes or SHARD_BYTES
        if shard_bytes % block_bytes or block_bytes % 4:
            raise ValueError(f"shard_bytes {shard_bytes} must be a multiple of block_bytes "
                             f"{block_bytes}, itself a multiple of 4")
        self.store, self.dtype = store, np.dtype(dtype)
        self.shard_bytes, self.block_bytes = shard_bytes, block_bytes
        self._buf = bytearray()
        self.shards: list[ShardEntry] = []
        self.bytes_written = 0

    def append(self, ids: np.ndarray) -> None:
        self._buf += np.asarray(ids, dtype=self.dtype).astype(
            self.dtype.newbyteorder("<"), copy=False).tobytes()
        while len(self._buf) >= self.shard_bytes:
            self._upload(bytes(self._buf[: self.shard_bytes]))
            del self._buf[: self.shard_bytes]

    def close(self) -> list[ShardEntry]:
        if self._buf:
            self._upload(bytes(self._buf))
            self._buf.clear()
        return self.shards

    def _upload(self, data: bytes) -> None:
        key = f"{TOKENS_PREFIX}/{len(self.shards):05d}.bin"
        crcs = np.asarray([google_crc32c.value(data[i: i + self.block_bytes])
                           for i in range(0, len(data), self.block_bytes)], dtype="<u4")
        self.store.put(key, data)
        self.bytes_written += len(data)
        self.shards.append(ShardEntry(
            url=key, stored=True, kind="bin", dtype=str(self.dtype), header_bytes=0,
            tokens=len(data) // self.dtype.itemsize, block_bytes=self.block_bytes,
            crc32c=base64.b64encode(crcs.tobytes()).decode(),
            sha256=hashlib.sha256(data).hexdigest(),
        ))
