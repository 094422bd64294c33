"""The i.i.d. dataset of claim C2: the reference corpus's train text, lines shuffled.

The reference dataset (benchmarks/recipe.py, ``ensure_dataset``) keeps the corpus's
order: 38 plays one after the other, and ``split: even`` gives each worker's slot a
run of consecutive plays, so the workers of every benchmark already see different
parts of the corpus (the non-i.i.d. case of C2). The i.i.d. case needs every slot
to be the same mix: the same train tokens, their lines shuffled with a fixed seed,
written as one file and prepared the same way. Its own validation split (1% of the
shuffled text) is not used: C2 scores both cases on the reference's validation
batches (``bench_claims`` evaluates the canonical model with the reference dataset),
so neither case sees a validation line in training.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np

log = logging.getLogger("benchmarks.claims")
SHUFFLE_SEED = 20250101


def shuffled_lines(text: bytes, seed: int = SHUFFLE_SEED) -> bytes:
    """``text``'s lines (newline kept on each) in a random order fixed by ``seed``."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith(b"\n"):
        lines[-1] += b"\n"
    order = np.random.default_rng(seed).permutation(len(lines))
    return b"".join(lines[i] for i in order)


def _boundary(data: bytes, i: int) -> bool:
    """Whether a cut before ``data[i]`` keeps every UTF-8 character whole."""
    return i >= len(data) or data[i] & 0xC0 != 0x80


def _cut(data: bytes, start: int, length: int, n_val: int, val_fraction: float) -> int:
    """The end of a file's train part: the character boundary nearest to ``start +
    length`` (at most ``len(data)``) at which prepare's rounding
    (``int(n * val_fraction + 0.5)``) still gives the file ``n_val`` val tokens."""
    for off in sorted(range(-8, 9), key=abs):
        end = min(start + length + off, len(data))
        if end > start and _boundary(data, end) and \
                int((end - start + n_val) * val_fraction + 0.5) == n_val:
            return end
    raise ValueError(f"no cut near byte {start + length} keeps {n_val} val tokens")


def ensure_shuffled(reference_url: str, where: Path | None = None,
                    val_fraction: float = 0.01) -> str:
    """The shuffled dataset beside the reference one, prepared once; its URL.

    File for file, it has the reference's validation text (each play's last 1%)
    and a train part of about the same length cut from the shuffled lines of every
    play's train text (at a character boundary where prepare's rounding keeps the
    play's val length), so both datasets give the same validation batches; this is
    checked after preparing."""
    from workers.data.errors import DatasetMissing  # noqa: PLC0415
    from workers.data.prepare import prepare_data  # noqa: PLC0415
    from workers.data.streams import open_dataset  # noqa: PLC0415

    ref = open_dataset(reference_url)
    where = where or Path(ref.url.removeprefix("file://")).parent / "shakespeare-byte-shuffled"
    url = where.as_uri()
    try:
        open_dataset(url)
        return url
    except DatasetMissing:
        pass
    files = ref.files
    pieces = ref.train_tokens.read_ranges([f.train for f in files])
    vals = ref.val_tokens.read_ranges([f.val for f in files])
    text = shuffled_lines(b"".join(np.asarray(p, dtype=np.uint8).tobytes() for p in pieces))
    log.info("preparing the shuffled-lines dataset of C2 at %s (%d bytes)", where, len(text))
    with tempfile.TemporaryDirectory() as tmp:
        start = 0
        for i, (f, val) in enumerate(zip(files, vals, strict=True)):
            n_val = len(val)
            length = f.train[1] - f.train[0] if i < len(files) - 1 else len(text) - start
            end = _cut(text, start, length, n_val, val_fraction)
            body = text[start:end] + np.asarray(val, dtype=np.uint8).tobytes()
            (Path(tmp) / f"{i:02d}.txt").write_bytes(body)
            start = end
        where.parent.mkdir(parents=True, exist_ok=True)
        prepare_data([str(p) for p in sorted(Path(tmp).glob("*.txt"))], url,
                     tokenizer="byte", val_fraction=val_fraction)
    got = open_dataset(url)
    if not np.array_equal(np.asarray(got.val_tokens.read_ranges([(0, len(got.val_tokens))])[0]),
                          np.asarray(ref.val_tokens.read_ranges([(0, len(ref.val_tokens))])[0])):
        raise RuntimeError(f"{url}: its validation tokens differ from {reference_url}'s")
    return url
