"""Reading token shards lazily: blocks on demand, verified, through a small cache.

A dataset (`workers.data.manifest.ShardedManifest`) is a stream of
tokens: its shards, concatenated. `ShardReader` reads ranges of that stream:
it fetches the checksum blocks the ranges touch (local files with ``os.pread``,
remote ones with fsspec's ``cat_ranges``, all of a batch's missing blocks in one
concurrent call), checks each against the crc32c its index recorded, and keeps
the most recent ones in an LRU cache of ``cache_bytes``: a worker's memory is
bounded by the cache, whatever the size of the data. `LazyTokens` is one split
(train or val) of it: ranges of the stream, concatenated, read like an array.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import fsspec
import google_crc32c
import numpy as np

from storage.retry import OutagePolicy, is_transient
from workers.data.errors import ShardCorrupt, ShardUnreadable
from workers.data.manifest import ShardEntry

log = logging.getLogger(__name__)

#: Default bytes of verified blocks a reader keeps.
CACHE_BYTES = 64 << 20
#: A block read that fails with a transient error (5xx, throttling, a dropped
#: connection) is retried for this long, as the exchange rides out a store outage
#: (``sync.liveness.outage_s``'s default); a missing shard or a denied read fails at once.
PATIENCE_S = 900.0
#: The longest pause between two attempts.
MAX_PAUSE_S = 5.0
#: How a failed block read is retried: pauses of 0.2 s doubling up to `MAX_PAUSE_S`
#: (these reads have no retry of their own below, unlike the store's operations, so
#: the first retries come quickly), logged from the third retry on.
BLOCK_OUTAGE = OutagePolicy(patience_s=PATIENCE_S, pause_s=0.2, max_pause_s=MAX_PAUSE_S,
                            quiet_retries=2)

Key = tuple[int, int]  # (shard, block)


class ShardReader:
    """Ranges of the token stream of ``shards`` (see the module docstring).
    Thread-safe, so a batch can be read ahead in a background thread."""

    def __init__(
        self, shards: Sequence[ShardEntry], urls: Sequence[str], dtype: str,
        storage_options: dict | None = None, cache_bytes: int = CACHE_BYTES,
    ) -> None:
        self.shards = list(shards)
        self.dtype = np.dtype(dtype)
        self._crcs = [np.frombuffer(base64.b64decode(s.crc32c), dtype="<u4") for s in shards]
        self._starts = np.concatenate([[0], np.cumsum([s.tokens for s in shards])]).astype(
            np.int64)
        self._targets = [self._target(u, storage_options) for u in urls]
        self._urls = list(urls)
        self._cache: OrderedDict[Key, np.ndarray] = OrderedDict()
        self._cached = 0
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self.fetched = 0  # blocks read from storage (for tests and figures)

    @staticmethod
    def _target(url: str, storage_options: dict | None) -> tuple[Any, str]:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        return fs, path

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _block_span(self, key: Key) -> tuple[int, int]:
        s = self.shards[key[0]]
        start = s.header_bytes + key[1] * s.block_bytes
        data_end = s.header_bytes + s.tokens * np.dtype(s.dtype).itemsize
        return start, min(start + s.block_bytes, data_end)

    def _keys(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """(shard, first token, end token) pieces of the stream range [a, b)."""
        out = []
        i = int(np.searchsorted(self._starts, a, side="right")) - 1
        while a < b:
            lo = int(self._starts[i])
            end = min(b, int(self._starts[i + 1]))
            if end > a:
                out.append((i, a - lo, end - lo))
            a = max(a, end)
            i += 1
        return out

    def _blocks_of(self, shard: int, t0: int, t1: int) -> range:
        s = self.shards[shard]
        per = s.block_bytes // np.dtype(s.dtype).itemsize
        return range(t0 // per, (t1 - 1) // per + 1)

    def _fetch(self, keys: set[Key]) -> dict[Key, np.ndarray]:
        with self._lock:
            got = {k: self._cache[k] for k in keys if k in self._cache}
            for k in got:
                self._cache.move_to_end(k)
        missing = sorted(keys - set(got))
        remote: dict[int, list[Key]] = {}
        for k in missing:
            fs, path = self._targets[k[0]]
            if _is_local(fs):
                got[k] = self._verify(k, _pread(path, *self._block_span(k)))
            else:
                remote.setdefault(id(fs), []).append(k)
        for group in remote.values():
            fs = self._targets[group[0][0]][0]
            spans = [self._block_span(k) for k in group]
            datas = fs.cat_ranges([self._targets[k[0]][1] for k in group],
                                  [a for a, _ in spans], [b for _, b in spans],
                                  on_error="return")
            for k, data in zip(group, datas, strict=True):
                got[k] = self._verify(k, self._retry(k, data))
        with self._lock:
            self.fetched += len(missing)
            for k in missing:
                self._cache[k] = got[k]
                self._cached += got[k].nbytes
            while self._cached > self.cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached -= old.nbytes
        return got

    def _retry(self, key: Key, data: bytes | Exception) -> bytes | Exception:
        """A remote block whose ranged read failed, read again while the error is
        transient (`is_transient`), under `BLOCK_OUTAGE`: for up to `PATIENCE_S`
        seconds. Returns the bytes, or the error that ended the retries (for
        `_verify` to name)."""
        if not (isinstance(data, Exception) and is_transient(data)):
            return data
        fs, path = self._targets[key[0]]
        a, b = self._block_span(key)
        failed: list[Exception] = [data]  # attempt 1 was the batch's read

        def read() -> bytes:
            if failed:
                raise failed.pop()
            return fs.cat_file(path, start=a, end=b)

        retrying = BLOCK_OUTAGE.retrying(retry_on=is_transient, log=log,
                                         what=f"token shard {self._urls[key[0]]}: read failed")
        try:
            return retrying(read)
        except Exception as exc:  # noqa: BLE001 - named by _verify
            return exc

    def _verify(self, key: Key, data: bytes | Exception) -> np.ndarray:
        shard, block = key
        a, b = self._block_span(key)
        where = f"token shard {self._urls[shard]}, bytes {a}..{b} (block {block})"
        if isinstance(data, Exception):
            raise ShardUnreadable(f"{where} cannot be read: {type(data).__name__}: {data}")
        if len(data) != b - a:
            raise ShardCorrupt(f"{where}: read {len(data)} bytes; the shard is shorter than "
                               "its index says")
        if google_crc32c.value(bytes(data)) != int(self._crcs[shard][block]):
            raise ShardCorrupt(f"{where} fails its crc32c check: the shard changed after it "
                               "was indexed; prepare the dataset again")
        return np.frombuffer(data, dtype="<" + np.dtype(self.shards[shard].dtype).str[1:])

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """The tokens of each stream range ``[a, b)``, fetching their blocks at once."""
        pieces = [self._keys(a, b) for a, b in ranges]
        need = {(p[0], blk) for ps in pieces for p in ps for blk in self._blocks_of(*p)}
        blocks = self._fetch(need)
        out = []
        for ps in pieces:
            parts = []
            for shard, t0, t1 in ps:
                per = self.shards[shard].block_bytes // np.dtype(self.shards[shard].dtype).itemsize
                for blk in self._blocks_of(shard, t0, t1):
                    lo = blk * per
                    parts.append(blocks[(shard, blk)][max(t0 - lo, 0): t1 - lo])
            out.append(np.concatenate(parts).astype(self.dtype, copy=False) if parts
                       else np.zeros(0, self.dtype))
        return out


def _is_local(fs: Any) -> bool:
    protocol = fs.protocol
    return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))


def _pread(path: str, a: int, b: int) -> bytes | Exception:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        return exc
    try:
        return os.pread(fd, b - a, a)
    finally:
        os.close(fd)


class LazyTokens:
    """One split of a sharded dataset: stream ``segments`` ``[a, b)``,
    concatenated, read like a 1-D array (``len``, slices, ``np.asarray``) without
    being loaded: `read_ranges` reads only what it is asked for."""

    def __init__(self, reader: ShardReader, segments: Sequence[tuple[int, int]]) -> None:
        self.reader = reader
        self.segments = [(int(a), int(b)) for a, b in segments]
        self._cum = np.concatenate([[0], np.cumsum([b - a for a, b in self.segments])]).astype(
            np.int64)
        self.dtype = reader.dtype

    def __len__(self) -> int:
        return int(self._cum[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def _stream_ranges(self, a: int, b: int) -> list[tuple[int, int]]:
        out = []
        i = max(int(np.searchsorted(self._cum, a, side="right")) - 1, 0)
        while a < b and i < len(self.segments):
            lo, hi = int(self._cum[i]), int(self._cum[i + 1])
            if hi > a:
                s0 = self.segments[i][0]
                out.append((s0 + a - lo, s0 + min(b, hi) - lo))
                a = min(b, hi)
            i += 1
        return out

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """The tokens of each range ``[a, b)`` of this split, read together."""
        for a, b in ranges:
            if not 0 <= a <= b <= len(self):
                raise IndexError(f"range [{a}, {b}) outside 0..{len(self)}")
        parts = [self._stream_ranges(a, b) for a, b in ranges]
        flat = self.reader.read_many([r for p in parts for r in p])
        out, i = [], 0
        for p in parts:
            chunk = flat[i: i + len(p)]
            i += len(p)
            out.append(np.concatenate(chunk) if chunk else np.zeros(0, self.dtype))
        return out

    def __getitem__(self, key: slice | int) -> np.ndarray:
        if isinstance(key, slice):
            a, b, step = key.indices(len(self))
            return self.read_ranges([(a, max(a, b))])[0][::step]
        i = int(key) + (len(self) if int(key) < 0 else 0)
        return self.read_ranges([(i, i + 1)])[0][0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The whole split in memory (small data and tests only)."""
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    def astype(self, dtype: Any) -> np.ndarray:
        return np.asarray(self).astype(dtype)
