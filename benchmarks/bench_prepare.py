"""Preparation throughput: a 1 GB text corpus into a local-directory dataset.

    .venv/bin/python -m benchmarks.bench_prepare [--size-mb 1024] [--cases text-byte,text-bpe,
        parquet-byte,parquet-bpe,bin-index] [--workdir DIR] [--out prepare] [--results-dir DIR]

The corpus is generated here, into a temporary directory: the lines of
``builtin:shakespeare`` (38 plays, 5.3 MB), shuffled with a fixed seed and written
as ``--file-mb`` files until ``--size-mb`` MB (1 MB = 1e6 bytes) of text. Two
tokenizers: ``byte`` and a byte-level BPE of vocabulary ``--vocab`` (4096) trained
here with ``tokenizers`` on the first ``--train-mb`` MB (its training time is
reported, not counted). Cases:

- ``text-*``: `workers.data.prepare.prepare_data` of the text files into
  ``file://.../out-<case>``, the command users run.
- ``parquet-*``: the same lines as rows of a Parquet ``text`` column (one file per
  text file, a row group per 64k rows), through ``prepare_data`` too.
- ``bin-index``: the byte tokens of each text file as a nanoGPT ``.bin`` shard
  (uint16, so twice the text's size), indexed in place by ``prepare_data``: one
  streamed read of every shard (ids checked, a crc32c per block), nothing copied.
  Its MB/s is of shard bytes.

Each case runs in its own process (spawned), so its peak RSS (``ru_maxrss``) is its
own; the RSS of the same process just before it starts preparing is reported beside
it. MB/s is of text (the corpus's bytes), tokens/s of tokens produced.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import (
    cli_logging,
    environment,
    md_table,
    output_args,
    publish,
    rerendered,
    stop_on_sigterm,
)

CASES = ("text-byte", "text-bpe", "parquet-byte", "parquet-bpe", "bin-index")
MB = 1_000_000


def rss_mb() -> float:
    """Peak RSS of this process so far, MB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


# -- the corpus -----------------------------------------------------------------------


def make_corpus(root: Path, size_mb: float, file_mb: float, seed: int = 0) -> list[Path]:
    """Shakespeare's lines, shuffled, in files of ``file_mb`` MB up to ``size_mb`` MB."""
    from workers.data.sources import resolve_sources  # noqa: PLC0415

    lines: list[bytes] = []
    for src in resolve_sources(["builtin:shakespeare"]):
        lines += [ln for ln in src.read(None).splitlines(keepends=True) if ln.strip()]
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    target, per_file = int(size_mb * MB), int(file_mb * MB)
    files, written = [], 0
    while written < target:
        path = root / f"part-{len(files):04d}.txt"
        want = min(per_file, target - written)
        chunk: list[bytes] = []
        n = 0
        while n < want:
            rng.shuffle(lines)
            for ln in lines:
                if n + len(ln) > want:
                    break
                chunk.append(ln)
                n += len(ln)
            else:
                continue
            break
        if not chunk:
            break
        path.write_bytes(b"".join(chunk))
        files.append(path)
        written += n
    return files


def to_parquet(texts: list[Path], root: Path) -> list[Path]:
    """Each text file as a Parquet file with one ``text`` row per line."""
    import numpy as np  # noqa: PLC0415
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    root.mkdir(parents=True, exist_ok=True)
    out = []
    for path in texts:
        data = np.frombuffer(path.read_bytes(), np.uint8)
        ends = np.flatnonzero(data == 10) + 1
        offsets = np.concatenate([[0], ends]).astype(np.int64)
        arr = pa.LargeStringArray.from_buffers(
            len(offsets) - 1, pa.py_buffer(offsets), pa.py_buffer(data))
        dest = root / (path.stem + ".parquet")
        pq.write_table(pa.table({"text": arr}), dest, row_group_size=1 << 16)
        out.append(dest)
    return out


def train_bpe(texts: list[Path], path: Path, vocab: int, train_mb: float) -> float:
    """A byte-level BPE trained on the first ``train_mb`` MB; returns seconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    t0 = time.perf_counter()
    sample = texts[0].read_bytes()[: int(train_mb * MB)].decode("utf-8", "ignore")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sample.splitlines(keepends=True), trainer)
    tok.save(str(path))
    return time.perf_counter() - t0


# -- one case, in its own process --------------------------------------------------------


class Progress:
    """prepare_data's callback, (name, done, total) in files or bytes: counted, and
    shown on stderr at most every 10 s."""

    def __init__(self, label: str) -> None:
        self.label, self.calls, self.shown = label, 0, time.monotonic()

    def __call__(self, name: str, done: int, total: int) -> None:
        self.calls += 1
        if time.monotonic() - self.shown >= 10:
            self.shown = time.monotonic()
            print(f"  {self.label}: {done}/{total} {os.path.basename(name)}",
                  file=sys.stderr, flush=True)


def run_case(case: str, inputs: list[str], tokenizer: str, out_url: str) -> dict[str, Any]:
    """Prepare ``inputs`` into ``out_url`` with `prepare_data`, the command users run
    (for ``bin-index``: index the token shards in place)."""
    from workers.data.prepare import prepare_data  # noqa: PLC0415

    file_bytes = sum(Path(p).stat().st_size for p in inputs)
    text_bytes = int(_text_bytes_of(inputs)) if case.startswith("parquet") else file_bytes
    baseline = current_rss_mb()
    progress = Progress(case)
    t0 = time.perf_counter()
    info = prepare_data(inputs, out_url, tokenizer=tokenizer, progress=progress)
    seconds = time.perf_counter() - t0
    tokens = info.train_tokens + info.val_tokens
    return {"case": case, "how": "prepare_data", "seconds": seconds, "text_bytes": text_bytes,
            "file_bytes": file_bytes, "tokens": tokens,
            "mb_per_s": text_bytes / MB / seconds, "tokens_per_s": tokens / seconds,
            "rss_before_mb": baseline, "peak_rss_mb": rss_mb(),
            "bytes_written": info.bytes_written, "progress_calls": progress.calls}


def to_bins(texts: list[Path], out: Path) -> list[Path]:
    """The byte tokens of each text file as a nanoGPT ``.bin`` shard (uint16)."""
    import numpy as np  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    bins = []
    for path in texts:
        target = out / f"{path.stem}.bin"
        np.fromfile(path, dtype=np.uint8).astype(np.uint16).tofile(target)
        bins.append(target)
    return bins


def _text_bytes_of(tables: list[str]) -> float:
    """UTF-8 bytes of the ``text`` columns (the text the Parquet files hold)."""
    import pyarrow.compute as pc  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    total = 0
    for path in tables:
        for batch in pq.ParquetFile(path).iter_batches(columns=["text"], batch_size=1 << 16):
            total += pc.sum(pc.binary_length(batch.column(0))).as_py() or 0
    return total


def _child(queue: Any, *args: Any) -> None:
    try:
        queue.put(run_case(*args))
    except BaseException as exc:  # the parent reports it
        queue.put({"case": args[0], "error": f"{type(exc).__name__}: {exc}"})


def in_process(*args: Any) -> dict[str, Any]:
    """``run_case(*args)`` in a spawned process: its own peak RSS."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, *args))
    proc.start()
    try:
        result = queue.get()
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.terminate()
    return result


# -- the report ---------------------------------------------------------------------------


def same_tokens(cases: list[dict[str, Any]]) -> str:
    """Whether each tokenizer gave the Parquet rows the text files' token count."""
    got = {r["case"]: r.get("tokens") for r in cases}
    pairs = [(t, got[f"text-{t}"], got[f"parquet-{t}"]) for t in ("byte", "bpe")
             if got.get(f"text-{t}") is not None and got.get(f"parquet-{t}") is not None]
    if not pairs:
        return "(no text/Parquet pair measured)."
    return "; ".join(f"{t}: {'the same tokens as' if a == b else 'other token counts than'} "
                     "the text files" for t, a, b in pairs) + "."


def markdown(report: dict[str, Any]) -> str:
    c = report["corpus"]
    lines = [
        f"# Preparing a {c['text_mb']:.0f} MB text corpus",
        "",
        f"{c['files']} files of Shakespeare's shuffled lines (generated in {c['seconds']:.0f} s); "
        f"BPE: byte-level, vocabulary {report['vocab']}, trained in "
        f"{report['bpe_train_seconds'] or 0:.1f} s on {report['train_mb']} MB. Output: a "
        "local-directory store (file://). MB = 1e6 bytes of text. A Parquet row (here a "
        f"line) is a document, encoded alone: {same_tokens(report['cases'])}",
        "",
    ]
    rows = []
    for r in report["cases"]:
        if "error" in r:
            rows.append([r["case"], "failed", None, None, None, None, None, r["error"]])
            continue
        rows.append([r["case"], f"{r['seconds']:.1f}", f"{r['mb_per_s']:.1f}",
                     f"{r['tokens'] / 1e6:.1f}", f"{r['tokens_per_s'] / 1e6:.2f}",
                     f"{r['rss_before_mb']:.0f}", f"{r['peak_rss_mb']:.0f}", r["how"]])
    lines.append(md_table(["case", "seconds", "MB/s", "Mtokens", "Mtokens/s",
                           "RSS before MB", "peak RSS MB", "measured"], rows))
    lines += ["", f"Command: `{report['environment']['command']}`; "
              f"{report['environment']['machine']['cpu_count']} CPUs, load average at start "
              f"{report['environment']['machine']['load_average_at_start']}."]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks.bench_prepare",
                                description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=1024, help="corpus size (default 1024)")
    p.add_argument("--file-mb", type=float, default=32, help="size of each text file")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary")
    p.add_argument("--train-mb", type=float, default=8, help="BPE training sample")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where the corpus and datasets go (default: a temp dir, removed)")
    output_args(p, "prepare", mlflow_help="accepted for run_all; nothing is logged")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    if (saved := rerendered(args, markdown)) is not None:
        return saved
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases or set(cases) - set(CASES):
        parser().error(f"--cases: allowed {', '.join(CASES)}")
    env = environment(argv, "benchmarks.bench_prepare")
    t_all = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-prepare-", dir=args.workdir))
    try:
        t0 = time.perf_counter()
        texts = make_corpus(work / "text", args.size_mb, args.file_mb)
        corpus = {"files": len(texts), "text_mb": sum(p.stat().st_size for p in texts) / MB,
                  "seconds": time.perf_counter() - t0}
        print(f"corpus: {corpus}", flush=True)
        bpe = work / "bpe.json"
        bpe_seconds = train_bpe(texts, bpe, args.vocab, args.train_mb) if any(
            c.endswith("bpe") for c in cases) else None
        tables = to_parquet(texts, work / "parquet") if any(
            c.startswith("parquet") for c in cases) else []
        bins = to_bins(texts, work / "bin") if "bin-index" in cases else []
        results = []
        for case in cases:
            kind, tok = case.split("-")
            inputs = [str(p) for p in {"text": texts, "parquet": tables, "bin": bins}[kind]]
            out = (work / f"out-{case}").as_uri()
            r = in_process(case, inputs, str(bpe) if tok == "bpe" else "byte", out)
            print(f"{case}: {r}", flush=True)
            results.append(r)
            shutil.rmtree(work / f"out-{case}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"size_mb": args.size_mb, "file_mb": args.file_mb, "vocab": args.vocab,
              "train_mb": args.train_mb, "bpe_train_seconds": bpe_seconds, "corpus": corpus,
              "cases": results, "environment": env,
              "wall_seconds": time.perf_counter() - t_all}
    return publish(args.out, report, markdown, args.results_dir)


if __name__ == "__main__":
    stop_on_sigterm()
    cli_logging()
    try:
        report = main()
    except KeyboardInterrupt:
        print("benchmarks.bench_prepare: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(1 if any("error" in r for r in report.get("cases", [])) else 0)
