"""One message for an unknown configuration field, whichever model it is in.

pydantic's ``extra="forbid"`` finds every unknown field, but its message ("Extra
inputs are not permitted", one error per field) does not say what *is* allowed,
which is what someone with a typo in a recipe or a ``--set`` needs. A model with
``_known_fields = names_unknown_fields()`` in its body keeps pydantic's check and
reports it as the one line users know::

    unknown field(s) sync_evry; allowed: mode, eager_rule, sync_every, ...

It lives in diloco because that is the lowest layer with configuration a user
types (`SyncConfig`); workers' `ModelConfig` and run-config sections use it from
here. storage's manifest models forbid extra fields too, but a manifest is
written by code, not typed by a user, and is reported whole as ManifestInvalid,
so storage has no use for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError, model_validator


def unknown_fields_message(unknown: Iterable[str], allowed: Iterable[str]) -> str:
    """``unknown field(s) a, b; allowed: x, y, z`` (unknown sorted, allowed in
    declaration order, as a reader scans the model)."""
    return f"unknown field(s) {', '.join(sorted(unknown))}; allowed: {', '.join(allowed)}"


def _name_unknown_fields(cls: Any, data: Any, handler: Any) -> Any:
    """Validate; if pydantic found fields this model does not have (its own, not
    those of a nested model, which names its own), replace all its errors with
    the one unknown-field line, as a typo is the thing to fix first."""
    try:
        return handler(data)
    except ValidationError as exc:
        unknown = [
            str(error["loc"][0])
            for error in exc.errors()
            if error["type"] == "extra_forbidden" and len(error["loc"]) == 1
        ]
        if not unknown:
            raise
        raise ValueError(unknown_fields_message(unknown, cls.model_fields)) from None


def names_unknown_fields() -> Any:
    """A wrap model validator for a model with ``extra="forbid"``; assign it in the
    class body (``_known_fields = names_unknown_fields()``), one per model."""
    return model_validator(mode="wrap")(_name_unknown_fields)
