"""Tokenizers: text to token ids and back.

Two kinds, chosen by a short spec string that `load_tokenizer` understands and that
`workers.data` records in every dataset:

- ``"byte"``: `ByteTokenizer`, the UTF-8 bytes of the text; vocabulary 256, no
  special tokens, nothing to download. The embedded default.
- ``"ids:N"``: `IdsTokenizer`, for pre-tokenized shards without a tokenizer file:
  a vocabulary of N ids and no text (it cannot encode or decode).
- ``"path/to/tokenizer.json"``: `HFTokenizer`, a Hugging Face ``tokenizers`` file
  on local disk. The ``tokenizers`` package (a dependency of the project) is
  imported only when such a tokenizer is loaded: the byte tokenizer needs none.

End of document: no separator token is added, by either tokenizer. A dataset keeps
every file's token range in its offsets, so document boundaries are never lost, and
``decode(encode(text)) == text`` holds exactly, file by file. (The other choice was
two 0x0A bytes after each document, a paragraph break; it would make the stored
tokens differ from the source text, and the byte vocabulary has no room for a true
end-of-text symbol anyway.) A training window may therefore run from the end of one
file straight into the next, as it would across a chapter break.

Example::

    tok = load_tokenizer("byte")
    ids = tok.encode("To be, or not to be")   # np.ndarray of uint8 values
    assert tok.decode(ids) == "To be, or not to be"
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

#: The spec of the byte tokenizer.
BYTE_SPEC = "byte"


@runtime_checkable
class Tokenizer(Protocol):
    """What `workers.data` needs of a tokenizer."""

    vocab_size: int
    name: str

    def encode(self, text: str) -> list[int] | np.ndarray:
        """Token ids of ``text`` (no special tokens added)."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of ``ids``."""
        ...


class ByteTokenizer:
    """The UTF-8 bytes of the text as token ids 0..255; no special tokens, and no
    end-of-document separator (see the module docstring).

    `decode` replaces invalid UTF-8 with U+FFFD instead of failing: a window cut
    from a token stream can begin or end inside a multi-byte character.
    """

    vocab_size = 256
    name = BYTE_SPEC

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(
                f"byte tokenizer: ids must lie in 0..255, got {arr.min()}..{arr.max()}"
            )
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file (e.g. a trained BPE) on local disk.

    ``encode`` adds no special tokens (no BOS/EOS), like `ByteTokenizer`.
    Needs the ``tokenizers`` package (a project dependency; a minimal install
    without it gets the one-line error below).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"tokenizer file {self.path!r} does not exist")
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as exc:
            raise ImportError(
                f"the tokenizer {self.path!r} is a Hugging Face tokenizers file, which needs "
                "the 'tokenizers' package, missing from this environment: install it with "
                "`python -m pip install tokenizers`, or use the 'byte' tokenizer"
            ) from exc
        try:
            self._tok: Any = _HFTokenizer.from_file(self.path)
        except Exception as exc:
            raise ValueError(
                f"tokenizer file {self.path!r} is not a readable Hugging Face tokenizer: {exc}"
            ) from exc
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.name = f"hf:{os.path.basename(self.path)}"

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_lines(self, text: str, piece: int = 1 << 16, group: int = 16) -> np.ndarray:
        """The ids of ``text``, encoded as pieces of about ``piece`` characters cut
        after a newline, ``group`` pieces per parallel batch, each batch turned into
        an array at once: fast, and memory stays one batch of the library's
        per-token objects. A BPE merge never spans a cut, which may differ from
        `encode` on the whole text (not with a whitespace pre-tokenizer)."""
        pieces, i = [], 0
        while i < len(text):
            j = text.find("\n", i + piece)
            j = len(text) if j < 0 else j + 1
            pieces.append(text[i:j])
            i = j
        out = [np.zeros(0, np.int64)]
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # < 0.20: slow
        for k in range(0, len(pieces), group):
            batch = encode(pieces[k: k + group], add_special_tokens=False)
            out.extend(np.asarray(e.ids, dtype=np.int64) for e in batch)
        return np.concatenate(out)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode(
            [int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False
        )

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r})"


class IdsTokenizer:
    """Token ids only: a vocabulary size for shards that came without a tokenizer
    file, so ids can be checked against it; there is no text to encode or decode."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"tokenizer ids:N needs N >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.name = f"{IDS_PREFIX}{vocab_size}"

    def encode(self, text: str) -> list[int]:
        raise ValueError(f"tokenizer {self.name} holds no text mapping: it cannot encode "
                         "text; prepare text with 'byte' or a tokenizer .json file")

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        raise ValueError(f"tokenizer {self.name} holds no text mapping: it cannot decode ids")

    def __repr__(self) -> str:
        return f"IdsTokenizer({self.vocab_size})"


#: The prefix of the ids-only spec, ``ids:50257``.
IDS_PREFIX = "ids:"


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by ``spec``: ``"byte"``, ``"ids:N"`` or the path of a
    ``.json`` file."""
    if spec == BYTE_SPEC:
        return ByteTokenizer()
    if isinstance(spec, str) and spec.startswith(IDS_PREFIX):
        try:
            return IdsTokenizer(int(spec[len(IDS_PREFIX):]))
        except ValueError:
            raise ValueError(f"tokenizer spec {spec!r}: ids:N takes a vocabulary size N "
                             ">= 1, e.g. ids:50257") from None
    if isinstance(spec, str) and spec.lower().endswith(".json"):
        return HFTokenizer(spec)
    raise ValueError(
        f"unknown tokenizer spec {spec!r}: use 'byte', 'ids:N' or the path of a Hugging Face "
        "tokenizers .json file"
    )
