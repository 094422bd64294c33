"""Errors of the exchange protocol.

Every failure a reader or writer can meet has its own class, so callers (the
synchronizer, the aggregator, tests) can tell a missing object from a corrupt one
from a transient network fault, and every message names the object concerned.
Nothing here is ever turned into zeros: a caller either gets verified data or one of
these exceptions.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error raised by the storage layer."""


class TransientStoreError(StoreError):
    """A store operation kept failing with retryable errors (5xx, throttling,
    connection resets) until the retry budget ran out."""


class ObjectMissing(StoreError):
    """A key that must exist does not."""


class PartialObject(StoreError):
    """A committed object whose payload is incomplete: a part listed in its commit
    record is absent or has the wrong size (an interrupted upload)."""


class CorruptObject(StoreError):
    """The bytes of an object do not match their recorded checksum, or cannot be
    decoded."""


class ShapeMismatch(StoreError):
    """A payload's shape or dtype differs from what the run manifest declares."""


class NonFiniteValues(StoreError):
    """A payload decodes to NaN or Inf; it is never applied."""


class RunExists(StoreError):
    """Refusing to create a run whose manifest already exists."""


class ManifestInvalid(StoreError):
    """The run manifest is absent, unreadable, or does not validate."""


class AlreadyCommitted(StoreError):
    """A create-only commit lost the race: another writer committed first."""
