"""The errors of preparing and opening token datasets.

Their own module so that `workers.data.sources`, `workers.data.prepare` and
`workers.data.streams` all raise the same classes without importing each other,
and a caller catches `DataError` for any of them.
"""

from __future__ import annotations


class DataError(Exception):
    """Base class of the errors of preparing and opening datasets."""


class SourceNotFound(DataError):
    """A source path, URL, pattern or builtin name matches no text file."""


class CorpusNotInstalled(DataError):
    """A builtin corpus whose package is not installed."""


class DatasetExists(DataError):
    """Refusing to prepare over an existing dataset."""


class DatasetMissing(DataError):
    """No ``dataset.json`` at the URL: nothing was prepared there."""


class DatasetInvalid(DataError):
    """``dataset.json`` (its format, its schema or its counts) or the shards it
    describes do not check out."""


class ShardInvalid(DataError):
    """A token shard cannot be used as it is: a dtype that does not fit, an id
    outside the vocabulary, too few tokens for one sequence, a malformed header."""


class ShardCorrupt(DatasetInvalid):
    """A block of a token shard no longer matches the checksum its index recorded."""


class ShardUnreadable(DataError):
    """A block of a token shard cannot be read (after retries): the file or object
    is gone, or the store keeps failing."""
