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


class MisboundRecord(CorruptObject):
    """A commit record that describes another object than the one at its key: its
    run, kind, fragment, round or party differ from the key's, or its payload lies
    outside that round's slot (a record copied from elsewhere: a replay)."""


class OutsizedContribution(StoreError):
    """A contribution whose norm is far above the recent accepted ones (the norm
    guard): one worker must not be able to ruin the model with a huge value."""


class ImplausibleClaim(StoreError):
    """A contribution whose commit claims more tokens than its member could have
    trained since its previous one (its batch x sequence x accumulation x steps):
    token weights must not be taken on trust."""


#: What makes one worker's contribution unusable. The aggregator rejects it (and
#: records why); its sender goes on as if it had not been counted.
BAD_CONTRIBUTION: tuple[type[StoreError], ...] = (
    CorruptObject, PartialObject, ShapeMismatch, NonFiniteValues, ObjectMissing,
    OutsizedContribution, ImplausibleClaim,
)


class RunExists(StoreError):
    """Refusing to create a run whose manifest already exists."""


class ManifestInvalid(StoreError):
    """The run manifest is absent, unreadable, or does not validate."""


class RunNotFound(ManifestInvalid):
    """No run at the URL (its manifest ``run.json`` cannot be read) or under the name
    given."""


class AlreadyCommitted(StoreError):
    """A create-only commit lost the race: another writer committed first."""
