"""``dataset.json``: what a prepared dataset holds, in one schema.

The writer (`workers.data.prepare`) and the reader (`workers.data.streams`) share
these models and names, so the two sides cannot drift apart.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from workers.data.errors import DatasetInvalid

#: The one format of ``dataset.json``: the tokens live in flat token shards, read
#: lazily. (The earlier one, zarr token arrays loaded whole, is no longer read:
#: `check_format` tells its owner to prepare the data again.)
FORMAT_SHARDS = "diloco-flows/dataset/2"
MANIFEST = "dataset.json"
#: The copy of a tokenizer file in the dataset store (so export/sample have it).
TOKENIZER_FILE = "tokenizer.json"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizerEntry(_Strict):
    spec: str
    name: str
    vocab_size: int = Field(gt=0)
    sha256: str | None = Field(default=None, description="of the tokenizer file, if any")
    file: str | None = Field(default=None, description="its copy's key in the dataset store")


class FileEntry(_Strict):
    name: str
    bytes: int = Field(ge=0, description="bytes of text read from the file")
    tokens: int = Field(ge=0)
    train_tokens: int = Field(ge=0)
    val_tokens: int = Field(ge=0)
    truncated: bool = Field(default=False, description="cut short by max_bytes")


class Counts(_Strict):
    files: int
    bytes: int
    tokens: int
    train_tokens: int
    val_tokens: int


class ShardEntry(_Strict):
    """One flat token shard: ``tokens`` ids of ``dtype`` after ``header_bytes``."""

    url: str = Field(description="absolute URL, or a key in the dataset store if stored")
    stored: bool = Field(default=False, description="inside the dataset store (copied there)")
    kind: Literal["bin", "llmc", "npy"]
    dtype: Literal["uint16", "uint32"]
    header_bytes: int = Field(ge=0)
    tokens: int = Field(ge=0)
    block_bytes: int = Field(gt=0, description="bytes per checksum block of the token data")
    crc32c: str = Field(description="base64 of one little-endian uint32 crc32c per block")
    sha256: str | None = Field(default=None, description="of the whole object, when written")


class ShardedManifest(_Strict):
    """The contents of ``dataset.json``: the dataset's token stream is its shards,
    concatenated; the files are consecutive ranges of that stream, each split into
    train (its first ``train_tokens``) and val (the rest)."""

    created: str = Field(default_factory=lambda: datetime.now(UTC).isoformat())
    tokenizer: TokenizerEntry
    dtype: Literal["uint16", "uint32"]
    val_fraction: float = Field(ge=0.0, lt=1.0)
    sources: list[str] = Field(description="the sources as given to prepare_data")
    files: list[FileEntry]
    counts: Counts
    format: Literal["diloco-flows/dataset/2"] = FORMAT_SHARDS
    shards: list[ShardEntry]

    def to_json(self) -> bytes:
        return json.dumps(self.model_dump(), indent=2).encode()


def check_format(manifest: Any, where: str) -> None:
    """`DatasetInvalid` in one line unless ``manifest`` (a parsed ``dataset.json``,
    named ``where``) is of `FORMAT_SHARDS`: data prepared by an older version must
    be prepared again, and its owner should read that, not a schema error."""
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found == FORMAT_SHARDS:
        return
    raise DatasetInvalid(
        f"{where} is a dataset of format {found!r}, which this version no longer reads "
        f"(it reads {FORMAT_SHARDS!r}, token shards); prepare the data again with "
        "`diloco prepare-data SOURCE... --out URL` (or `python -m workers.data prepare`), "
        "into a new URL or after deleting this dataset"
    )


def manifest_fingerprint(manifest: dict[str, Any]) -> str:
    """A short hash of a dataset's token contents (not of names or times), from its
    ``dataset.json``: equal fingerprints mean equal tokens and splits. The one
    definition `TokenDataset.fingerprint` and the tracking use."""
    check_format(manifest, MANIFEST)
    shards = [(s["dtype"], s["tokens"], s["block_bytes"], s["crc32c"])
              for s in manifest["shards"]]
    files = [(f["train_tokens"], f["val_tokens"]) for f in manifest["files"]]
    blob = json.dumps({"shards": shards, "files": files}).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
