"""Token shards used in place (.bin, llm.c .bin, .npy), read lazily and verified.

The same tokens as a text file give the same batches, from local paths and from
memory:// and S3 URLs (ranged reads); bad shards are refused with one-line errors
before anything is written; a block changed after indexing is caught on read.
Run: ``.venv/bin/pytest tests/test_shards.py -q``.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

from storage.objectstore import ObjectStore
from workers.data.errors import ShardCorrupt, ShardInvalid, ShardUnreadable
from workers.data.lazy import LazyTokens
from workers.data.prepare import prepare_data
from workers.data.streams import TokenDataset, WorkerStream, open_dataset, val_batches

TEXTS = ["".join(chr(32 + (i * 7 + k) % 90) for i in range(3000 + 500 * k)) for k in range(2)]


def memory_url() -> str:
    return f"memory://shards-test-{uuid.uuid4().hex[:12]}"


def write_shard(path: Path, ids: np.ndarray, kind: str) -> None:
    """``ids`` as a shard of ``kind``: bin16, bin32, llmc (GPT-2: uint16), llmc32
    (Llama 3: uint32), npy16, npy32."""
    if kind.startswith("llmc"):
        header = np.zeros(256, dtype="<i4")
        wide = kind == "llmc32"
        header[:3] = (20240801 if wide else 20240520, 7 if wide else 1, len(ids))
        path.write_bytes(header.tobytes() + ids.astype("<u4" if wide else "<u2").tobytes())
    elif kind.startswith("npy"):
        np.save(path, ids.astype("<u2" if kind == "npy16" else "<u4"))
    else:
        path.write_bytes(ids.astype("<u2" if kind == "bin16" else "<u4").tobytes())


SUFFIX = {"bin16": ".bin", "bin32": ".bin", "llmc": ".bin", "llmc32": ".bin", "npy16": ".npy",
          "npy32": ".npy"}


@pytest.fixture(scope="module")
def text_dataset(tmp_path_factory: pytest.TempPathFactory) -> TokenDataset:
    tmp = tmp_path_factory.mktemp("text")
    paths = []
    for i, text in enumerate(TEXTS):
        (tmp / f"t{i}.txt").write_text(text)
        paths.append(str(tmp / f"t{i}.txt"))
    url = memory_url()
    prepare_data(paths, url, val_fraction=0.1)
    return open_dataset(url)


def assert_same_batches(a: TokenDataset, b: TokenDataset) -> None:
    for split in ("even", "by_file"):
        for slot in (0, 1):
            sa = WorkerStream(a, slot, 2, split=split, seq_len=32, batch_size=4, seed=3)
            sb = WorkerStream(b, slot, 2, split=split, seq_len=32, batch_size=4, seed=3)
            for _ in range(4):
                (xa, ya), (xb, yb) = sa.next_batch(), sb.next_batch()
                assert torch.equal(xa, xb) and torch.equal(ya, yb)
    va = val_batches(a, seq_len=32, batch_size=3, num_batches=2)
    vb = val_batches(b, seq_len=32, batch_size=3, num_batches=2)
    for (xa, ya), (xb, yb) in zip(va, vb, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("kind", list(SUFFIX))
def test_each_format_gives_the_text_paths_batches(
    kind: str, tmp_path: Path, text_dataset: TokenDataset
) -> None:
    paths = []
    for i, text in enumerate(TEXTS):
        p = tmp_path / f"s{i}{SUFFIX[kind]}"
        write_shard(p, np.frombuffer(text.encode(), dtype=np.uint8), kind)
        paths.append(str(p))
    url = memory_url()
    info = prepare_data(paths, url, val_fraction=0.1,
                        dtype="uint32" if kind == "bin32" else None)
    assert "2 shards referenced in place" in info.notes[0]
    ds = open_dataset(url)
    assert isinstance(ds.train_tokens, LazyTokens)
    assert ds.train_offsets.tolist() == text_dataset.train_offsets.tolist()
    assert json.loads(ObjectStore(url).get("dataset.json"))["format"] == "diloco-flows/dataset/2"
    assert_same_batches(text_dataset, ds)
    # a directory and a glob name the same shards
    same = open_dataset(_prepared([str(tmp_path / f"*{SUFFIX[kind]}")], kind))
    assert same.fingerprint == ds.fingerprint


def _prepared(sources: list[str], kind: str, **kwargs: Any) -> str:
    url = memory_url()
    prepare_data(sources, url, val_fraction=0.1, dtype="uint32" if kind == "bin32" else None,
                 **kwargs)
    return url


def test_shards_from_a_memory_url_are_read_by_ranges(text_dataset: TokenDataset) -> None:
    root = memory_url()
    fs = fsspec.filesystem("memory")
    for i, text in enumerate(TEXTS):
        ids = np.frombuffer(text.encode(), dtype=np.uint8).astype("<u2")
        with fs.open(f"{root}/shards/s{i}.bin", "wb") as f:
            f.write(ids.tobytes())
    ds = open_dataset(_prepared([f"{root}/shards"], "bin16"))
    assert_same_batches(text_dataset, ds)


@pytest.mark.s3
@pytest.mark.s3_backends("moto")  # ranged reads through s3fs: one server is enough
def test_shards_on_s3_and_local_shards_copied(
    s3_endpoint: tuple[str, dict[str, Any]], s3_bucket: str, tmp_path: Path,
    text_dataset: TokenDataset,
) -> None:
    url, opts = f"s3://{s3_bucket}/{uuid.uuid4().hex[:12]}", s3_endpoint[1]
    store = ObjectStore(url, storage_options=opts)
    for i, text in enumerate(TEXTS):
        store.put(f"in/s{i}.bin", np.frombuffer(text.encode(), np.uint8).astype("<u2").tobytes())
    prepare_data([f"{url}/in"], f"{url}/ds", val_fraction=0.1, storage_options=opts)
    assert_same_batches(text_dataset, open_dataset(f"{url}/ds", storage_options=opts))

    local = []
    for i, text in enumerate(TEXTS):
        local.append(tmp_path / f"l{i}.bin")
        write_shard(local[-1], np.frombuffer(text.encode(), np.uint8), "bin16")
    info = prepare_data([str(p) for p in local], f"{url}/ds2", val_fraction=0.1,
                        storage_options=opts)
    assert any("2 local shards copied" in n for n in info.notes)
    for p in local:
        p.unlink()  # the dataset no longer needs them
    assert_same_batches(text_dataset, open_dataset(f"{url}/ds2", storage_options=opts))


def test_resume_gives_the_same_next_batches(tmp_path: Path) -> None:
    p = tmp_path / "a.bin"
    write_shard(p, np.arange(200_000) % 50_000, "bin16")
    url = _prepared([str(p)], "bin16", tokenizer="ids:50000")
    ds = open_dataset(url)
    s = WorkerStream(ds, 1, 2, seq_len=64, batch_size=8, seed=1)
    for _ in range(3):
        s.next_batch()
    state = json.loads(json.dumps(s.state_dict()))
    rest = [s.next_batch() for _ in range(3)]
    again = WorkerStream(open_dataset(url), 1, 2, seq_len=64, batch_size=8, seed=1)
    again.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(rest, [again.next_batch()
                                                             for _ in range(3)], strict=True))


@pytest.mark.parametrize(
    ("kind", "ids", "dtype", "message"),
    [
        ("npyf", np.arange(100), None, r"a\.npy.*dtype is float32 \(<f4\)"),
        ("bin16", np.arange(101) % 200, "uint32", r"a\.bin: 202 bytes is not a whole number of "
         r"uint32 ids; data\.dtype"),
        ("bin16", np.arange(200) % 200 + 1, "uint32", r"a\.bin: id \d+ .* outside the vocabulary "
         r"of 256 as uint32; is data\.dtype right"),
        ("bin32", np.arange(100) % 200 + 1, None, r"a\.bin: every second id is 0.*data\.dtype "
         r"to uint32"),
        ("npy16", np.arange(100) % 200, "uint32", r"a\.npy: data\.dtype is uint32, but its "
         r"\.npy header says uint16"),
        ("bin16", np.arange(10), None, r"shard .*a\.bin holds 10 tokens, fewer than one "
         r"sequence of seq_len \+ 1 = 65"),
    ],
    ids=["npy-float32", "bin-odd-size", "uint16-as-uint32", "uint32-as-uint16",
         "npy-vs-data.dtype", "too-short"],
)
def test_bad_shards_are_refused_and_nothing_is_written(
    kind: str, ids: np.ndarray, dtype: str | None, message: str, tmp_path: Path
) -> None:
    p = tmp_path / ("a.npy" if kind.startswith("npy") else "a.bin")
    if kind == "npyf":
        np.save(p, ids.astype(np.float32))
    else:
        write_shard(p, ids, kind)
    out = tmp_path / "out"
    with pytest.raises(ShardInvalid, match=message) as info:
        prepare_data([str(p)], str(out), dtype=dtype, min_tokens=65)
    assert "\n" not in str(info.value)
    assert not out.exists() or not any(out.iterdir())


def test_a_block_changed_after_indexing_is_caught(tmp_path: Path) -> None:
    p = tmp_path / "a.bin"
    write_shard(p, np.arange(300_000) % 256, "bin16")
    url = _prepared([str(p)], "bin16")
    ds = open_dataset(url)
    data = bytearray(p.read_bytes())
    data[200_000] ^= 1  # in block 3 (64 KiB blocks)
    p.write_bytes(bytes(data))
    with pytest.raises(ShardCorrupt, match=r"a\.bin, bytes 196608\.\.262144 \(block 3\) fails "
                       r"its crc32c"):
        ds.train_tokens[100_000:100_010]
    assert len(ds.train_tokens[0:10]) == 10  # other blocks still read


# -- prepared text and tables: streamed into shards ---------------------------------


def _peak_preparing(path: Path, out: Path) -> tuple[int, list[tuple[str, int, int]]]:
    import tracemalloc

    seen: list[tuple[str, int, int]] = []
    tracemalloc.start()
    try:
        prepare_data([str(path)], str(out), val_fraction=0.01,
                     progress=lambda *a: seen.append(a))
        return tracemalloc.get_traced_memory()[1], seen
    finally:
        tracemalloc.stop()


def test_text_is_prepared_in_blocks_with_bounded_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers.data import writer

    monkeypatch.setattr(writer, "TEXT_BLOCK", 1 << 20)
    monkeypatch.setattr(writer, "SHARD_BYTES", 2 << 20)
    line = b"".join(bytes([97 + i % 26]) * (i % 50) + b"\n" for i in range(200))
    peaks = []
    for mb in (4, 16):
        src = tmp_path / f"big{mb}.txt"
        src.write_bytes(line * (mb * (1 << 20) // len(line)))
        peak, seen = _peak_preparing(src, tmp_path / f"out{mb}")
        peaks.append(peak)
        size = src.stat().st_size
        assert len(seen) >= mb and seen[-1] == (str(src), size, size)  # ~one call per block
        assert [d for _, d, _ in seen] == sorted(d for _, d, _ in seen)
        ds = open_dataset((tmp_path / f"out{mb}").as_uri())
        assert len(ds.manifest.shards) == -(-2 * size // (2 << 20))  # uint16: 2 bytes a token
        assert bytes(ds.train_tokens[:5000].astype(np.uint8)) == src.read_bytes()[:5000]
        tail = np.asarray(ds.val_tokens[len(ds.val_tokens) - 300:]).astype(np.uint8)
        assert bytes(tail) == src.read_bytes()[-300:]  # the blocks' cuts lose nothing
    # four times the text, about the same peak: a block of text and a shard of tokens
    assert peaks[1] < peaks[0] * 1.5 and peaks[1] < 24 << 20, peaks


def test_tables_give_the_text_paths_batches(tmp_path: Path, text_dataset: TokenDataset) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = []
    for i, text in enumerate(TEXTS):
        rows = [text[j: j + 100] for j in range(0, len(text), 100)]
        pq.write_table(pa.table({"id": list(range(len(rows))), "body": rows}),
                       tmp_path / f"t{i}.parquet", row_group_size=7)
        paths.append(str(tmp_path / f"t{i}.parquet"))
    url = memory_url()
    prepare_data(paths, url, val_fraction=0.1, column="body")
    assert_same_batches(text_dataset, open_dataset(url))

    out = tmp_path / "out"
    with pytest.raises(Exception, match=r"t0\.parquet.*text") as info:
        prepare_data(paths, str(out), column="text")
    assert "\n" not in str(info.value) and (not out.exists() or not any(out.iterdir()))


def test_the_tokenizer_travels_with_the_dataset(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = "the quick brown fox jumps over the lazy dog\n" * 200
    hf = Tokenizer(models.BPE(unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"],
                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok_path, src = tmp_path / "tok.json", tmp_path / "a.txt"
    hf.save(str(tok_path))
    src.write_text(text)
    url = memory_url()
    prepare_data([str(src)], url, tokenizer=str(tok_path), val_fraction=0.0)
    tok_path.unlink()  # another machine: only the dataset
    ds = open_dataset(url)
    assert ds.manifest.tokenizer.file == "tokenizer.json"
    assert ds.tokenizer().decode(np.asarray(ds.train_tokens)) == text
    assert len(ds.train_tokens) < len(text) / 3  # BPE merged the words


def test_reading_is_bounded_by_the_cache_and_reads_ahead(tmp_path: Path) -> None:
    p = tmp_path / "a.bin"
    write_shard(p, np.arange(2_000_000) % 50_000, "bin16")  # 4 MB, 62 blocks of 64 KiB
    ds = open_dataset(_prepared([str(p)], "bin16", tokenizer="ids:50000"))
    reader = ds.train_tokens.reader
    reader.cache_bytes = 4 << 16  # four blocks
    s = WorkerStream(ds, 0, 1, seq_len=128, batch_size=8, seed=0)
    first = s.next_batch()
    ahead = s._ahead
    assert ahead is not None and ahead[0] == 1  # batch 1 is being read already
    expected = ahead[1].result()

    def not_again(index: int) -> None:
        raise AssertionError(f"batch {index} read in the step, not ahead")

    s.batch = not_again  # type: ignore[method-assign]
    assert s.next_batch() is expected  # the step took the batch read ahead
    del s.batch
    s._ahead = None  # batch 2 was read ahead with the stub: read it again
    for _ in range(20):
        s.next_batch()
    assert reader._cached <= reader.cache_bytes and reader.fetched > 20
    assert first[0].shape == (8, 128)


def test_a_shard_gone_after_indexing_is_named(tmp_path: Path) -> None:
    from workers.data.errors import ShardUnreadable

    root = memory_url()
    with fsspec.open(f"{root}/a.bin", "wb") as f:
        f.write((np.arange(5000) % 256).astype("<u2").tobytes())
    ds = open_dataset(_prepared([f"{root}/a.bin"], "bin16", max_files=1))
    fsspec.filesystem("memory").rm(f"{root}/a.bin")
    with pytest.raises(ShardUnreadable, match=r"a\.bin, bytes 0\.\.\d+ \(block 0\) cannot be read"):
        ds.train_tokens[0:10]


def test_a_store_outage_is_ridden_out_and_a_denied_read_is_not(tmp_path, monkeypatch, caplog):
    """Remote block reads retry transient errors (a dropped connection, a 503) as
    the exchange rides out an outage, pausing 0.2 s, then twice as long each time,
    and logging from the third retry on; an error no retry can fix fails at once."""
    from fsspec.implementations.memory import MemoryFileSystem

    from workers.data.streams import WorkerStream, open_dataset

    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(32, 127)) * 40)
    url = f"memory://outage-{uuid.uuid4().hex[:8]}"
    prepare_data([str(text)], url)
    expected = WorkerStream(open_dataset(url), 0, 1, seq_len=16, batch_size=4).batch(0)
    flaky_ds, denied_ds = open_dataset(url), open_dataset(url)  # fresh caches
    pauses: list[float] = []
    monkeypatch.setattr(time, "sleep", pauses.append)  # tenacity's default sleep calls it
    calls = {"n": 0}
    real = MemoryFileSystem.cat_file

    def flaky(self, path, start=None, end=None, **kw):
        calls["n"] += 1
        if calls["n"] <= 3:
            raise ConnectionResetError("connection reset by peer")
        return real(self, path, start=start, end=end, **kw)

    monkeypatch.setattr(MemoryFileSystem, "cat_ranges", lambda self, paths, starts, ends,
                        on_error="return", **kw: [ConnectionResetError("reset")] * len(paths))
    monkeypatch.setattr(MemoryFileSystem, "cat_file", flaky)
    with caplog.at_level("WARNING", logger="workers.data.lazy"):
        got = WorkerStream(flaky_ds, 0, 1, seq_len=16, batch_size=4).batch(0)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert calls["n"] > 3
    # the first block: the batch's read and 3 more failed, the 5th read got through
    assert pauses[:4] == pytest.approx([0.2, 0.4, 0.8, 1.6])
    warned = [r.getMessage() for r in caplog.records if "read failed" in r.getMessage()]
    assert len(warned) == 2 and "(0 s of at most 900 s): connection reset" in warned[0]

    def denied(self, path, start=None, end=None, **kw):
        calls["n"] += 1
        raise PermissionError("Access Denied")

    monkeypatch.setattr(MemoryFileSystem, "cat_file", denied)
    calls["n"] = 0
    with pytest.raises(ShardUnreadable, match="PermissionError"):
        WorkerStream(denied_ds, 0, 1, seq_len=16, batch_size=4).batch(0)
    assert calls["n"] == 1  # one retry after the reset, none after the denial


def test_a_block_read_gives_up_after_its_patience_with_the_last_error(monkeypatch):
    """A transient error that outlasts `PATIENCE_S` (counted from the failed batch
    read) ends the retries, and the reader names that error."""
    from fsspec.implementations.memory import MemoryFileSystem

    from workers.data import lazy

    url = f"memory://patience-{uuid.uuid4().hex[:8]}"
    with fsspec.open(f"{url}/a.bin", "wb") as f:
        f.write((np.arange(5000) % 256).astype("<u2").tobytes())
    ds = open_dataset(_prepared([f"{url}/a.bin"], "bin16", max_files=1))
    monkeypatch.setattr(lazy, "BLOCK_OUTAGE",
                        lazy.OutagePolicy(patience_s=0.05, pause_s=0.01, max_pause_s=0.01))
    calls = {"n": 0}

    def down(self, path, start=None, end=None, **kw):
        calls["n"] += 1
        raise TimeoutError(f"read timed out ({calls['n']})")

    monkeypatch.setattr(MemoryFileSystem, "cat_ranges", lambda self, paths, starts, ends,
                        on_error="return", **kw: [ConnectionResetError("reset")] * len(paths))
    monkeypatch.setattr(MemoryFileSystem, "cat_file", down)
    with pytest.raises(ShardUnreadable, match=r"TimeoutError: read timed out \((\d+)\)") as err:
        ds.train_tokens[0:10]
    assert calls["n"] >= 2 and f"({calls['n']})" in str(err.value)
