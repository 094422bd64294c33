"""The files of a worker checkpoint: torch.distributed.checkpoint (DCP) on the store.

DCP writes and reads through the store's own fsspec filesystem (its credentials and
endpoint), not through `ObjectStore`, so this module gives it an adapter that pins
every file: each file written is hashed (sha256) and measured as its bytes go out,
which costs no second read, and each file read is checked against what the commit
record says before DCP reads a byte of it. A missing, truncated or altered file is
refused in one line (`ObjectMissing`, `CorruptObject`) instead of being loaded.

The check before reading is a full pass over the file (a second read of it); DCP
reads a file item by item, in no fixed order, so it cannot hash on the fly.

DCP is imported at the first writer or reader made here, not with this module: its
import (which pulls in FSDP and DTensor) would cost every worker process start-up
time and memory before, or without, its first checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import fsspec

from storage.errors import CorruptObject, ObjectMissing, StoreError
from storage.objectstore import ObjectStore

if TYPE_CHECKING:
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

#: a file's entry in a commit record: {"size": bytes, "sha256": hex digest}
FileRecord = dict[str, Any]
_CHUNK = 8 << 20


class _Hashing:
    """A write stream that hashes and counts what passes through it (every other
    attribute, ``tell`` and ``fileno`` included, is the stream's own)."""

    def __init__(self, stream: Any):
        self._stream, self.sha, self.size = stream, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self.size += len(view)
        return self._stream.write(data)

    def seek(self, *args: Any) -> int:  # a hash of bytes written out of order is wrong
        raise OSError("a checkpoint file is written front to back")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class Pinning:
    """What `pinned_files` adds to torch's fsspec adapter (its ``FileSystem``, the
    next class in the MRO) on ``store``'s filesystem: it records each file it writes
    (`written`: name -> size and sha256) and, given ``expected`` (a commit record's
    files), verifies each file before it is read."""

    def __init__(self, store: ObjectStore, key: str, expected: dict[str, FileRecord] | None = None):
        super().__init__()
        self.fs: fsspec.AbstractFileSystem = store.fs
        self.store, self.key, self.expected = store, key, expected
        self.written: dict[str, FileRecord] = {}
        self._verified: set[str] = set()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        name = os.path.basename(os.fspath(path))
        if "r" in mode and self.expected is not None and name not in self._verified:
            self.verify(name)
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = _Hashing(stream)
            yield hashing
        self.written[name] = {"size": hashing.size, "sha256": hashing.sha.hexdigest()}

    def mkdir(self, path: str | os.PathLike) -> None:
        """A directory on a local disk (or in memory); nothing on an object store, which
        has none: s3fs's ``makedirs`` asks ``HeadBucket`` and, refused it as a worker's
        role is, tries ``CreateBucket``, which the role may not do either."""
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        if {"file", "local", "memory"} & set(protocols):
            super().mkdir(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        """DCP writes ``.metadata`` under a temporary name first; its record follows."""
        super().rename(path, new_path)
        old = os.path.basename(os.fspath(path))
        if old in self.written:
            self.written[os.path.basename(os.fspath(new_path))] = self.written.pop(old)

    def verify(self, name: str) -> None:
        """Read the file ``name`` whole and compare its size and sha256 with the
        commit record's (once per reader)."""
        key = f"{self.key}/{name}"
        want = self.expected.get(name) if self.expected is not None else None
        if want is None:
            raise CorruptObject(f"checkpoint file {self.store.full_url(key)} is not in "
                                "its commit record")
        sha, size = hashlib.sha256(), 0
        try:
            with self.fs.open(self.store.fs_path(key), "rb") as f:
                while chunk := f.read(_CHUNK):
                    sha.update(chunk)
                    size += len(chunk)
        except FileNotFoundError as exc:
            raise ObjectMissing(f"checkpoint file {self.store.full_url(key)} is missing") from exc
        self.store.traffic.record("get", key, down=size, fetched=True)
        if size != want["size"] or sha.hexdigest() != want["sha256"]:
            raise CorruptObject(
                f"checkpoint file {self.store.full_url(key)} fails its check: {size} bytes "
                f"with sha256 {sha.hexdigest()[:12]}..., its commit record says "
                f"{want['size']} bytes with sha256 {want['sha256'][:12]}...")
        self._verified.add(name)


@functools.cache
def pinned_files() -> type:
    """The class `Pinning` on torch's fsspec ``FileSystem``: made, and DCP imported,
    at the first call."""
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem  # noqa: PLC0415

    return type("PinnedFiles", (Pinning, FileSystem), {"__module__": __name__})


def new_writer(store: ObjectStore, key: str) -> FsspecWriter:
    """A DCP writer into the new directory ``key`` of ``store``: one file per rank plus
    the coordinator's ``.metadata``; what it wrote is in ``writer.fs.written``. Files
    on a local disk are fsynced; an object store's upload is durable once it returns
    (and DCP, finding no file descriptor there, would ``os.sync()`` the whole host)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # noqa: PLC0415

    protocols = store.fs.protocol if isinstance(store.fs.protocol, tuple) else (store.fs.protocol,)
    writer = FsspecWriter(store.fs_path(key), single_file_per_rank=True, overwrite=False,
                          sync_files="file" in protocols)
    writer.fs, writer.path = pinned_files()(store, key), store.fs_path(key)
    return writer


def new_reader(store: ObjectStore, key: str, files: dict[str, FileRecord] | None) -> FsspecReader:
    """A DCP reader of the directory ``key`` of ``store`` that verifies each file it
    opens against ``files`` (a commit record's); None reads unverified (a legacy
    checkpoint's directory: its files were not pinned). Before DCP starts, every
    file is checked for its size (one stat each) and ``.metadata`` for its sha256, so
    a missing or truncated shard, or a wrong index of them, is refused up front in
    one line (DCP would bury it in a report of every rank's tracebacks)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # noqa: PLC0415

    reader = FsspecReader(store.fs_path(key))
    reader.fs, reader.path = pinned_files()(store, key, files), store.fs_path(key)
    if files is not None:
        for name, want in sorted(files.items()):
            size = store.size(f"{key}/{name}")  # ObjectMissing names the file
            if size != want["size"]:
                raise CorruptObject(f"checkpoint file {store.full_url(f'{key}/{name}')} "
                                    f"has {size} bytes; its commit record says {want['size']}")
        reader.fs.verify(".metadata")
    return reader


def count(store: ObjectStore, key: str, files: dict[str, FileRecord]) -> None:
    """Record the files written at ``key`` in ``store``'s traffic (DCP writes past
    `ObjectStore`, and the bill counts checkpoint bytes)."""
    for name, rec in files.items():
        store.traffic.record("put", f"{key}/{name}", up=rec["size"], stored=True)


def store_error(exc: CheckpointException) -> BaseException:
    """The store's own error behind a failed DCP load (DCP wraps every rank's error,
    traceback and all): what a user reads, in one line; else ``exc`` itself."""
    for failure, _ in exc.failures.values():
        if isinstance(failure, StoreError):
            return failure
    return exc
