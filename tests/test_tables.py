"""Parquet and Arrow sources (workers.data.tables): a table gives the tokens its text
file would, whatever the format or where it lives, record batch by record batch, and
a wrong column or id is a one-line error naming the file."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from workers.data.errors import DataError
from workers.data.tables import (
    ColumnType,
    MissingColumn,
    TableCounts,
    TokenOutOfRange,
    check_table,
    is_table,
    table_tokens,
)
from workers.tokenizer import ByteTokenizer, load_tokenizer

LINES = [
    f"{who}: {what} the {thing}, and {n} times over.\n"
    for n, (who, what, thing) in enumerate(
        [("HAMLET", "speak", "speech"), ("OPHELIA", "remember", "rosemary"),
         ("KING", "pray", "heaven"), ("HORATIO", "watch", "platform")] * 40
    )
] + ["Ünïcode — “quotes” 日本語\n", "\n", "The end.\n"]
TEXT = "".join(LINES)


@dataclass(frozen=True)
class Src:
    """A SourceFile with the `open()` tables.py reads through."""

    name: str
    size: int
    open: Callable[[], IO[bytes]]


def local(path: Path) -> Src:
    return Src(str(path), path.stat().st_size, lambda: open(path, "rb"))


def url(u: str) -> Src:
    fs, p = fsspec.core.url_to_fs(u)
    return Src(u, fs.size(p), lambda: fs.open(p, "rb"))


def tokens(src: Src, tok=None, column=None, counts=None) -> np.ndarray:
    tok = tok or ByteTokenizer()
    parts = [ids for ids, _ in table_tokens(src, column=column, tokenizer=tok,
                                             dtype=np.uint16, counts=counts)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> str:
    """A tiny byte-level BPE trained here from TEXT (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(LINES, trainer)
    path = tmp_path_factory.mktemp("tok") / "bpe.json"
    tok.save(str(path))
    return str(path)


def test_text_column_gives_the_text_files_tokens_with_nulls_skipped(tmp_path, bpe):
    rows = [*LINES[:50], None, *LINES[50:], None]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": list(range(len(rows))), "text": rows}), path,
                   row_group_size=32)
    counts = TableCounts()
    assert tokens(local(path), counts=counts).tobytes() == np.frombuffer(
        TEXT.encode(), np.uint8).astype(np.uint16).tobytes()
    assert (counts.rows, counts.null_rows) == (len(rows), 2)
    info = check_table(local(path), None)
    assert (info.column, info.kind, info.rows, info.null_rows) == ("text", "text", len(rows), 2)
    tok = load_tokenizer(bpe)
    want = np.asarray(tok.encode(TEXT))
    assert len(want) < len(TEXT.encode()) / 2  # a real BPE, not bytes
    np.testing.assert_array_equal(tokens(local(path), tok), want)


def test_empty_rows_and_a_dictionary_encoded_text_column(tmp_path):
    path = tmp_path / "d.parquet"
    rows = ["", None, ""]
    pq.write_table(pa.table({"text": rows, "cat": pa.array(LINES[:3]).dictionary_encode()}),
                   path)
    assert tokens(local(path)).size == 0
    assert check_table(local(path), "cat").kind == "text"
    assert tokens(local(path), column="cat").astype(np.uint8).tobytes() == \
        "".join(LINES[:3]).encode()


def test_token_columns_give_the_same_ids_in_every_list_type(tmp_path, bpe):
    tok = load_tokenizer(bpe)
    docs = [tok.encode(line) for line in LINES]
    want = np.concatenate([np.asarray(d) for d in docs])
    for i, (typ, col) in enumerate([(pa.list_(pa.int32()), "input_ids"),
                                     (pa.list_(pa.uint16()), "tokens"),
                                     (pa.large_list(pa.int64()), "ids")]):
        path = tmp_path / f"ids{i}.parquet"
        pq.write_table(pa.table({"n": list(range(len(docs))), col: pa.array(docs, typ)}),
                       path, row_group_size=50)
        assert check_table(local(path), None).kind == "tokens"
        np.testing.assert_array_equal(tokens(local(path), tok), want)


def test_arrow_file_and_stream_formats_and_a_memory_url(tmp_path):
    table = pa.table({"text": LINES})
    want = TEXT.encode()
    for suffix, new in ((".arrow", ipc.new_file), (".ipc", ipc.new_stream),
                        (".feather", ipc.new_file)):
        path = tmp_path / f"t{suffix}"
        with new(path, table.schema) as w:
            for batch in table.to_batches(max_chunksize=40):
                w.write_batch(batch)
        src = local(path)
        info = check_table(src, None)
        assert info.format == ("arrow-stream" if suffix == ".ipc" else "arrow-file")
        steps = list(table_tokens(src, column=None, tokenizer=ByteTokenizer(), dtype=np.uint16))
        assert len(steps) == 5  # 163 rows in batches of 40
        assert b"".join(ids.astype(np.uint8).tobytes() for ids, _ in steps) == want
        assert steps[-1][1] == src.size
    with fsspec.open("memory://tables/t.parquet", "wb") as f:
        pq.write_table(table, f)
    assert tokens(url("memory://tables/t.parquet")).astype(np.uint8).tobytes() == want


def test_a_multi_row_group_file_is_read_batch_by_batch_with_progress(tmp_path):
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": LINES * 10}), path, row_group_size=100)
    src = local(path)
    assert check_table(src, None).batches == 17
    steps = list(table_tokens(src, column=None, tokenizer=ByteTokenizer(), dtype=np.uint16,
                              batch_rows=100))
    assert len(steps) == 17
    assert max(len(ids) for ids, _ in steps) < len(TEXT.encode()) * 10 / 10
    done = [b for _, b in steps]
    assert done == sorted(done) and 0 < done[0] < done[-1] == src.size


def test_wrong_columns_are_one_line_errors_naming_file_and_choices(tmp_path):
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"a": [1.0], "b": [[0.5]], "c": ["hi"]}), path)
    src = local(path)
    with pytest.raises(MissingColumn) as e:
        check_table(src, "foo")
    assert str(e.value) == (f"{path} has no column 'foo'; its columns: a, b, c; "
                            "choose one with --column / data.column")
    with pytest.raises(MissingColumn, match=r"looked for text, input_ids, tokens, ids"):
        list(table_tokens(src, column=None, tokenizer=ByteTokenizer(), dtype=np.uint16))
    for col, typ in (("a", "double"), ("b", "list<double>")):
        with pytest.raises(ColumnType) as e:
            check_table(src, col)
        assert f"column {col!r} has type {typ}; allowed: text" in str(e.value)
        assert "\n" not in str(e.value)
    assert tokens(src, column="c").tobytes() == np.array([104, 105], np.uint16).tobytes()
    junk = tmp_path / "junk.arrow"
    junk.write_text("not a table")
    with pytest.raises(DataError, match=r"junk.arrow is neither Parquet nor Arrow IPC"):
        check_table(local(junk), None)


def test_token_ids_outside_the_vocabulary_name_the_row_and_id(tmp_path):
    path = tmp_path / "ids.parquet"
    docs = [[1, 2, 3], [4], None, [5, 300, 7]]
    pq.write_table(pa.table({"input_ids": pa.array(docs, pa.list_(pa.int32()))}), path,
                   row_group_size=2)
    with pytest.raises(TokenOutOfRange) as e:
        tokens(local(path))
    assert str(e.value) == (f"{path}: row 3 holds the token id 300, outside the vocabulary "
                            "of byte (0..255); were these ids made with another tokenizer?")
    neg = tmp_path / "neg.parquet"
    pq.write_table(pa.table({"ids": pa.array([[1], [2, -1]], pa.list_(pa.int64()))}), neg)
    with pytest.raises(TokenOutOfRange, match=r"row 1 holds the token id -1"):
        tokens(local(neg))
    holes = tmp_path / "holes.parquet"
    pq.write_table(pa.table({"ids": pa.array([[1], [2], [3, None]], pa.list_(pa.int64()))}),
                   holes)
    with pytest.raises(TokenOutOfRange, match=r"holes.parquet: row 2 holds a null token id"):
        tokens(local(holes))


def test_table_suffixes():
    assert is_table("s3://b/fineweb/000.PARQUET") and is_table("x.feather")
    assert not is_table("notes.txt") and not is_table("train.bin")


def test_the_preparation_benchmark_reads_the_same_tokens_from_text_and_parquet(tmp_path):
    """benchmarks/bench_prepare at 1 MB: both paths see every byte of the corpus once."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks import bench_prepare

    report = bench_prepare.main(["--size-mb", "1", "--file-mb", "0.4", "--cases",
                                 "text-byte,parquet-byte", "--workdir", str(tmp_path),
                                 "--results-dir", str(tmp_path / "results")])
    text, table = report["cases"]
    assert report["corpus"]["files"] == 3 and 0.99 < report["corpus"]["text_mb"] <= 1
    assert text["tokens"] == table["tokens"] == table["text_bytes"] == text["text_bytes"]
    assert text["bytes_written"] > text["tokens"] and table["progress_calls"] >= 3
    assert "| parquet-byte |" in (tmp_path / "results" / "prepare.md").read_text()
    assert list(tmp_path.iterdir()) == [tmp_path / "results"]  # the corpus is removed
