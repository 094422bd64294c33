"""What a worker reads: an opened dataset, its training stream and the val batches.

`open_dataset` reads the index; the tokens are read lazily, block by block
(`workers.data.lazy`). `WorkerStream` gives one
worker its part of the train tokens (split ``even`` or ``by_file``), as random
windows that are a pure function of (seed, worker, batch index), so a resumed
worker sees exactly the batches it would have seen: its `state_dict` is the data
position a checkpoint keeps. `val_batches` gives every party the same fixed
windows.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import ValidationError

from storage.errors import ObjectMissing
from storage.objectstore import ObjectStore
from workers.data.errors import DatasetInvalid, DatasetMissing
from workers.data.lazy import LazyTokens, ShardReader
from workers.data.manifest import MANIFEST, ShardedManifest, check_format, manifest_fingerprint
from workers.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class DatasetFile:
    """One source file of a dataset and where its tokens are (``[start, end)``)."""

    name: str
    bytes: int
    train: tuple[int, int]
    val: tuple[int, int]


@dataclass(frozen=True)
class TokenDataset:
    """A prepared dataset, its index verified. See `open_dataset`. The tokens are
    `LazyTokens`, read (and checked) on demand."""

    url: str
    manifest: ShardedManifest
    train_tokens: LazyTokens
    train_offsets: np.ndarray
    val_tokens: LazyTokens
    val_offsets: np.ndarray

    @property
    def vocab_size(self) -> int:
        return self.manifest.tokenizer.vocab_size

    @property
    def tokenizer_spec(self) -> str:
        return self.manifest.tokenizer.spec

    def tokenizer(self, storage_options: dict | None = None) -> Tokenizer:
        """The dataset's tokenizer, loaded from the copy in its store when it has a
        file (checked against the recorded sha256), so a machine without the
        original file (export, sample) has it."""
        data = self.tokenizer_file(storage_options)
        if data is None:
            return load_tokenizer(self.manifest.tokenizer.spec)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "tokenizer.json")
            with open(path, "wb") as f:
                f.write(data)
            return load_tokenizer(path)

    def tokenizer_file(self, storage_options: dict | None = None) -> bytes | None:
        """The bytes of the dataset's tokenizer file (checked against its sha256), or
        None when the tokenizer is not a file (``byte``, ``ids:N``)."""
        entry = self.manifest.tokenizer
        if entry.file is None:
            return None
        store = ObjectStore(self.url, storage_options=storage_options, name="dataset")
        data = store.get(entry.file)
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise DatasetInvalid(f"{store.full_url(entry.file)} fails its sha256 check")
        return data

    @property
    def files(self) -> list[DatasetFile]:
        t, v = self.train_offsets.tolist(), self.val_offsets.tolist()
        return [
            DatasetFile(e.name, e.bytes, (t[i], t[i + 1]), (v[i], v[i + 1]))
            for i, e in enumerate(self.manifest.files)
        ]

    @property
    def fingerprint(self) -> str:
        """A short hash of the tokens (their shards' checksums and the splits, not
        names or times): equal fingerprints mean equal tokens."""
        return manifest_fingerprint(self.manifest.model_dump())


def open_dataset(url: str, storage_options: dict | None = None) -> TokenDataset:
    """Open the dataset at ``url``: only ``dataset.json`` is read and checked;
    token blocks are read and verified against their crc32c when a batch needs
    them (`ShardCorrupt` then).

    Raises `DatasetMissing` if nothing was prepared at ``url``, `DatasetInvalid` if
    ``dataset.json`` is of another format (`check_format`: one line saying to
    prepare the data again), does not validate, or disagrees with itself.
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
        parsed = json.loads(raw)
    except ValueError as exc:
        raise DatasetInvalid(f"{where} is not JSON: {exc}") from None
    check_format(parsed, where)
    try:
        manifest = ShardedManifest.model_validate(parsed)
    except ValidationError as exc:
        raise DatasetInvalid(f"{where} does not validate:\n{exc}") from exc
    for f in manifest.files:
        if f.train_tokens + f.val_tokens != f.tokens:
            raise DatasetInvalid(f"{where}: file {f.name} splits {f.tokens} tokens into "
                                 f"{f.train_tokens} train and {f.val_tokens} val")
    total = sum(s.tokens for s in manifest.shards)
    if total != sum(f.tokens for f in manifest.files):
        raise DatasetInvalid(f"{where}: the shards hold {total} tokens, the files "
                             f"{sum(f.tokens for f in manifest.files)}")
    for s in manifest.shards:
        blocks = -(-s.tokens * np.dtype(s.dtype).itemsize // s.block_bytes)
        if len(s.crc32c) != 4 * -(-4 * blocks // 3) or s.block_bytes % 4:
            raise DatasetInvalid(f"{where}: shard {s.url} has checksums for the wrong number "
                                 f"of blocks (expected {blocks})")
    urls = [store.full_url(s.url) if s.stored else s.url for s in manifest.shards]
    reader = ShardReader(manifest.shards, urls, manifest.dtype,
                         storage_options=storage_options)
    train, val, at = [], [], 0
    for f in manifest.files:
        train.append((at, at + f.train_tokens))
        val.append((at + f.train_tokens, at + f.tokens))
        at += f.tokens
    return TokenDataset(
        url=store.url, manifest=manifest,
        train_tokens=LazyTokens(reader, train), val_tokens=LazyTokens(reader, val),
        train_offsets=_offsets([f.train_tokens for f in manifest.files]),
        val_offsets=_offsets([f.val_tokens for f in manifest.files]),
    )


def _offsets(counts: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)


# -- batches ----------------------------------------------------------------------


Batch = tuple[torch.Tensor, torch.Tensor]


def _windows(tokens: LazyTokens, starts: np.ndarray, seq_len: int) -> Batch:
    """x = tokens[s : s + seq_len], y = tokens[s + 1 : s + seq_len + 1] per start s."""
    rows = tokens.read_ranges([(int(s), int(s) + seq_len + 1) for s in starts])
    w = torch.from_numpy(np.stack(rows).astype(np.int64))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


#: A block of a worker's share (split even) holds at least this many sequences: the
#: windows that would cross from one block into the next are not drawn, at most one
#: in 16 of a block's.
MIN_BLOCK_WINDOWS = 16


class WorkerStream:
    """The training batches of worker ``worker_index`` of ``num_workers``.

    ``split="even"``: the train tokens are cut into ``num_workers * blocks`` equal
    blocks, and worker w gets blocks ``w, w + W, w + 2W, ...``: every worker reads
    from every part of the corpus, so on a corpus stored in order (play after play)
    every worker sees the same mix. ``blocks`` shrinks until a block holds
    `MIN_BLOCK_WINDOWS` sequences; ``blocks=1`` is one contiguous range per worker
    (``[w*N//W, (w+1)*N//W)``), what runs made before ``data.slot_blocks`` read.
    ``split="by_file"``: file i goes to worker ``i %
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
        blocks: int = 1,
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
        self.blocks = max(1, blocks)
        self.batch_index = 0
        self.ranges = self._assign()
        lengths = np.array([b - a for a, b in self.ranges], dtype=np.int64)
        self._starts = np.array([a for a, _ in self.ranges], dtype=np.int64)
        self._cum = np.cumsum(np.maximum(lengths - seq_len, 0))
        self._lengths = lengths
        self._ahead: tuple[int, Future[Batch]] | None = None
        self._pool: ThreadPoolExecutor | None = None

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
            k = max(1, min(self.blocks, total // (n * need * MIN_BLOCK_WINDOWS)))
            cuts = n * k
            return [(i * total // cuts, (i + 1) * total // cuts) for i in range(w, cuts, n)]
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
        """``(x, y)``, LongTensors of shape [batch_size, seq_len], y = x shifted by one.

        The following batch is read ahead in a background thread (batches are pure
        functions of their index), so the step does not wait for storage."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == self.batch_index:
            out = ahead[1].result()
        else:
            out = self.batch(self.batch_index)
        self.batch_index += 1
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="read-ahead")
        self._ahead = (self.batch_index, self._pool.submit(self.batch, self.batch_index))
        return out

    def seek(self, batch_index: int) -> None:
        """Move forward to batch ``batch_index`` (never back): a worker that joins or
        heals at inner step S reads from batch S (times its accumulation) on, so
        no batch of its slot is read twice, whoever held the slot before."""
        self.batch_index = max(self.batch_index, int(batch_index))

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


def check_val(dataset: TokenDataset, seq_len: int) -> None:
    """ValueError unless the val split holds one sequence (nothing is read)."""
    total = len(dataset.val_tokens)
    if total < seq_len + 1:
        raise ValueError(
            f"the val split of {dataset.url} has {total} tokens, fewer than one sequence of "
            f"seq_len + 1 = {seq_len + 1}; prepare with a larger val_fraction or use a "
            "shorter seq_len"
        )


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
    check_val(dataset, seq_len)
    total = len(dataset.val_tokens)
    count = batch_size * num_batches
    starts = np.linspace(0, total - seq_len - 1, count).round().astype(np.int64)
    return [
        _windows(dataset.val_tokens, starts[i * batch_size : (i + 1) * batch_size], seq_len)
        for i in range(num_batches)
    ]
