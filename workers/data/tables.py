"""Parquet and Arrow IPC sources: a text column or a token column, streamed.

Users arrive with tables rather than text files: Hugging Face ``datasets`` exports
and FineWeb shards (Parquet, a ``text`` column), or pre-tokenized sets (a list
column such as ``input_ids``), or Arrow IPC files (``.arrow``/``.feather``/``.ipc``,
file or stream format). `table_tokens` turns one such file into token ids record
batch by record batch from a binary file object (``src.open()``, fsspec), so memory
stays one record batch whatever the size of the file, and a file in the bucket is
read with ranged requests instead of being downloaded first.

Which column: ``column`` if given; else ``text`` if present, else the first of
``input_ids``, ``tokens``, ``ids``. A text column's rows are tokenized one by one
(a row is a document: no token merges across two rows) and concatenated with no
separator, the project's convention (see `workers.tokenizer`); so a table whose
rows are the lines of a text file gives that file's tokens whenever line ends are
token boundaries, and always for the byte tokenizer. A token column's lists are
flattened and checked against the vocabulary. Null rows are skipped and counted.

`check_table` reads only the schema and metadata, so a wrong column is reported
before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from workers.data.errors import DataError
from workers.tokenizer import ByteTokenizer, Tokenizer

TABLE_SUFFIXES = (".parquet", ".arrow", ".feather", ".ipc")
#: Token columns looked for, in order, when there is no ``text`` column.
TOKEN_COLUMNS = ("input_ids", "tokens", "ids")
TEXT_COLUMN = "text"
#: Rows per record batch read from a Parquet file.
BATCH_ROWS = 8192

_IPC_FILE_MAGIC = b"ARROW1"


class MissingColumn(DataError):
    """The table has no column of the name asked for (or none of the defaults)."""


class ColumnType(DataError):
    """The chosen column is neither text nor a list of integer token ids."""


class TokenOutOfRange(DataError):
    """A token column holds an id outside the tokenizer's vocabulary (or a null id)."""


class TableUnreadable(DataError):
    """The file is not a Parquet or Arrow IPC table pyarrow can read."""


class TableSource(Protocol):
    """What `table_tokens` needs of a source file (`workers.data.sources.SourceFile`)."""

    name: str
    size: int

    def open(self) -> IO[bytes]:
        """A seekable binary file object of the whole file."""
        ...


@dataclass(frozen=True)
class TableInfo:
    """A table's schema facts, read without reading its data."""

    name: str
    format: str  # "parquet", "arrow-file" or "arrow-stream"
    column: str
    kind: str  # "text" or "tokens"
    arrow_type: str
    columns: tuple[str, ...]
    rows: int | None  # None: an Arrow stream does not say before it is read
    batches: int | None  # row groups (Parquet) or record batches (Arrow file)
    null_rows: int | None  # from Parquet statistics when written; None: unknown


@dataclass
class TableCounts:
    """What `table_tokens` read, filled in as it goes (pass one to see it)."""

    rows: int = 0
    null_rows: int = 0
    tokens: int = 0
    batches: int = 0


def is_table(name: str) -> bool:
    """Whether ``name`` is read as a table (by its suffix) rather than as text."""
    return name.lower().endswith(TABLE_SUFFIXES)


def check_table(src: TableSource, column: str | None) -> TableInfo:
    """The column `table_tokens` would read and its kind; raises `MissingColumn`,
    `ColumnType` or `TableUnreadable` with one line naming the file. Cheap: only the
    schema and the metadata are read."""
    with src.open() as f:
        fmt = _format(f, src.name)
        if fmt == "parquet":
            pf = _parquet(f, src.name)
            schema = pf.schema_arrow
            rows, batches = pf.metadata.num_rows, pf.metadata.num_row_groups
        elif fmt == "arrow-file":
            reader = _ipc_open(ipc.open_file, f, src.name)
            schema, rows, batches = reader.schema, None, reader.num_record_batches
        else:
            schema = _ipc_open(ipc.open_stream, f, src.name).schema
            rows = batches = None
        name = _choose_column(schema, column, src.name)
        kind = _kind(schema.field(name), src.name)
        nulls = _parquet_nulls(pf, name) if fmt == "parquet" else None
    return TableInfo(
        name=src.name,
        format=fmt,
        column=name,
        kind=kind,
        arrow_type=_type_name(schema.field(name).type),
        columns=tuple(schema.names),
        rows=rows,
        batches=batches,
        null_rows=nulls,
    )


def table_tokens(
    src: TableSource,
    *,
    column: str | None,
    tokenizer: Tokenizer,
    dtype: np.dtype,
    counts: TableCounts | None = None,
    batch_rows: int = BATCH_ROWS,
) -> Iterator[tuple[np.ndarray, int]]:
    """(token ids as ``dtype``, bytes of the file consumed so far) per record batch.

    The byte count is an estimate for a progress bar: the file's size times the
    fraction of rows (Parquet) or record batches (Arrow file) read, or the reader's
    position in the file (Arrow stream). ``counts`` (optional) is updated as the
    batches are read. Raises the errors of `check_table`, and `TokenOutOfRange`
    naming the file, the row, the id and the vocabulary.
    """
    counts = counts if counts is not None else TableCounts()
    dtype = np.dtype(dtype)
    with src.open() as f:
        fmt = _format(f, src.name)
        schema, batches = _reader(f, fmt, src, batch_rows)
        name = _choose_column(schema, column, src.name)
        kind = _kind(schema.field(name), src.name)
        to_ids = _text_ids if kind == "text" else _list_ids
        for batch, done in batches(name):
            arr = batch.column(name)
            ids = to_ids(arr, tokenizer, dtype, src.name, counts.rows)
            counts.rows += len(arr)
            counts.null_rows += arr.null_count
            counts.tokens += len(ids)
            counts.batches += 1
            yield ids, min(int(done), src.size)


# -- reading ------------------------------------------------------------------------


def _format(f: IO[bytes], name: str) -> str:
    head = f.read(8)
    f.seek(0)
    if head[:4] == b"PAR1":
        return "parquet"
    if head[:6] == _IPC_FILE_MAGIC:
        return "arrow-file"
    if head[:4] == b"\xff\xff\xff\xff":
        return "arrow-stream"
    if head[:4] == b"FEA1":
        raise TableUnreadable(
            f"{name} is a Feather version 1 file, which is not read; save it again as "
            "Feather v2 / Arrow IPC (pyarrow.feather.write_feather) or Parquet"
        )
    raise TableUnreadable(
        f"{name} is neither Parquet nor Arrow IPC (file or stream format): it starts "
        f"with {head[:8]!r}; tables must be .parquet, .arrow, .feather or .ipc"
    )


def _parquet(f: IO[bytes], name: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as exc:
        raise TableUnreadable(f"{name} is not a readable Parquet file: {exc}") from exc


def _ipc_open(opener: Callable[[Any], Any], f: IO[bytes], name: str) -> Any:
    try:
        return opener(f)
    except (pa.ArrowException, OSError) as exc:
        raise TableUnreadable(f"{name} is not a readable Arrow IPC file: {exc}") from exc


Batches = Iterator[tuple[pa.RecordBatch, float]]


def _reader(
    f: IO[bytes], fmt: str, src: TableSource, batch_rows: int
) -> tuple[pa.Schema, Callable[[str], Batches]]:
    """The schema, and a function of the chosen column giving the (record batch,
    bytes done) pairs; Parquet reads only that column, Arrow IPC reads whole batches."""
    if fmt == "parquet":
        pf = _parquet(f, src.name)
        total = max(1, pf.metadata.num_rows)

        def parquet(column: str) -> Batches:
            rows = 0
            for batch in pf.iter_batches(batch_size=batch_rows, columns=[column]):
                rows += batch.num_rows
                yield batch, src.size * rows / total

        return pf.schema_arrow, parquet
    if fmt == "arrow-file":
        reader = _ipc_open(ipc.open_file, f, src.name)
        n = reader.num_record_batches
        return reader.schema, lambda _column: (
            (reader.get_batch(i), src.size * (i + 1) / n) for i in range(n)
        )
    reader = _ipc_open(ipc.open_stream, f, src.name)

    def stream(_column: str) -> Batches:
        # one batch ahead, so that the last says the whole file (its end marker too)
        batch = None
        for after in reader:
            if batch is not None:
                yield batch, f.tell()
            batch = after
        if batch is not None:
            yield batch, src.size

    return reader.schema, stream


# -- the column -----------------------------------------------------------------------


def _choose_column(schema: pa.Schema, column: str | None, name: str) -> str:
    names = list(schema.names)
    listed = ", ".join(names) or "(none)"
    if column is not None:
        if column in names:
            return column
        raise MissingColumn(
            f"{name} has no column {column!r}; its columns: {listed}; choose one with "
            "--column / data.column"
        )
    for candidate in (TEXT_COLUMN, *TOKEN_COLUMNS):
        if candidate in names:
            return candidate
    looked = ", ".join((TEXT_COLUMN, *TOKEN_COLUMNS))
    raise MissingColumn(
        f"{name} has no text or token column (looked for {looked}); its columns: "
        f"{listed}; choose one with --column / data.column"
    )


def _kind(field: pa.Field, name: str) -> str:
    t = field.type
    if pa.types.is_dictionary(t):  # e.g. a pandas categorical: its values' type counts
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "text"
    lists = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    if lists and pa.types.is_integer(t.value_type):
        return "tokens"
    raise ColumnType(
        f"{name}: column {field.name!r} has type {_type_name(t)}; allowed: text (string, large_string) "
        "or token ids (a list of int8..int64 / uint8..uint64)"
    )


def _type_name(t: pa.DataType) -> str:
    """``list<double>`` rather than pyarrow's ``list<element: double>``."""
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return f"{str(t).split('<', 1)[0]}<{_type_name(t.value_type)}>"
    return str(t)


def _parquet_nulls(pf: pq.ParquetFile, column: str) -> int | None:
    """Null rows of a plain (not nested) column from the row groups' statistics, if
    written; a list column's leaf statistics count null ids too, so those say None."""
    leaves = [pf.metadata.schema.column(i).path for i in range(pf.metadata.num_columns)]
    if column not in leaves:
        return None
    leaf = leaves.index(column)
    total = 0
    for rg in range(pf.metadata.num_row_groups):
        stats = pf.metadata.row_group(rg).column(leaf).statistics
        if stats is None or not stats.has_null_count:
            return None
        total += stats.null_count
    return total


# -- rows to ids ----------------------------------------------------------------------


def _text_ids(
    arr: pa.Array, tokenizer: Tokenizer, dtype: np.dtype, name: str, first_row: int
) -> np.ndarray:
    """A text column's rows, tokenized row by row and concatenated."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    arr = arr.drop_null()
    if len(arr) == 0:
        return np.zeros(0, dtype)
    if isinstance(tokenizer, ByteTokenizer):
        # the rows' UTF-8 bytes, back to back: the string array's data buffer
        if pa.types.is_string_view(arr.type):
            arr = arr.cast(pa.large_string())
        wide = pa.types.is_large_string(arr.type)
        offsets = np.frombuffer(arr.buffers()[1], np.int64 if wide else np.int32)
        lo, hi = offsets[arr.offset], offsets[arr.offset + len(arr)]
        if hi == lo:  # only empty strings: there may be no data buffer at all
            return np.zeros(0, dtype)
        data = np.frombuffer(arr.buffers()[2], np.uint8)[lo:hi]
        return data.astype(dtype)
    rows = arr.to_pylist()
    encode_batch = getattr(tokenizer, "encode_batch", None)
    encoded = encode_batch(rows) if encode_batch is not None else map(tokenizer.encode, rows)
    parts = [np.asarray(ids, dtype=np.int64) for ids in encoded]
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
        raise DataError(
            f"{name}: tokenizer {tokenizer.name} produced ids outside "
            f"0..{tokenizer.vocab_size - 1} in rows {first_row}..{first_row + len(arr) - 1}"
        )
    return ids.astype(dtype)


def _list_ids(
    arr: pa.Array, tokenizer: Tokenizer, dtype: np.dtype, name: str, first_row: int
) -> np.ndarray:
    """A token column's lists, flattened (null rows skipped) and checked."""
    values = arr.flatten()  # leaves out null rows, honours slicing
    if values.null_count:
        row = first_row + _row_of(arr, int(np.flatnonzero(values.is_null().to_numpy(
            zero_copy_only=False))[0]))
        raise TokenOutOfRange(f"{name}: row {row} holds a null token id")
    ids = values.to_numpy(zero_copy_only=False)
    if ids.size == 0:
        return np.zeros(0, dtype)
    vocab = tokenizer.vocab_size
    bad = (ids < 0) | (ids >= vocab) if ids.dtype.kind == "i" else ids >= vocab
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        row = first_row + _row_of(arr, at)
        raise TokenOutOfRange(
            f"{name}: row {row} holds the token id {int(ids[at])}, outside the vocabulary "
            f"of {tokenizer.name} (0..{vocab - 1}); were these ids made with another tokenizer?"
        )
    return ids.astype(dtype)


def _row_of(arr: pa.Array, value_index: int) -> int:
    """The row of ``arr`` (a list array) holding its ``value_index``-th flattened id."""
    lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
    return int(np.searchsorted(np.cumsum(lengths), value_index, side="right"))
