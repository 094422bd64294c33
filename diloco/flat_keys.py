"""The flat ``sync`` keys of earlier versions, read into today's sections.

Before `diloco.config.SyncConfig` had sections, a recipe said ``sync: {sync_every:
30, codec_up: int4}``. Such recipes, ``--set sync.sync_every=...`` and the manifests
of runs created then must keep working: `nest_flat_keys` moves each flat key to its
section and says, for each, which key replaces it. Recipes and ``--set`` show that
as one ``DeprecatedKey`` line (`diloco.config`); a stored manifest is read silently.
"""

from __future__ import annotations

from typing import Any

#: Flat keys of earlier versions and where each lives now (section, field).
FLAT_KEYS: dict[str, tuple[str, str]] = {
    **{k: ("schedule", k) for k in (
        "mode", "eager_rule", "sync_every", "fragments", "overlap", "overlap_start",
        "overlap_margin", "alpha", "pattern", "separate_rest", "split_tensors")},
    "outer_step": ("outer", "step"), "outer_lr": ("outer", "lr"),
    "outer_momentum": ("outer", "momentum"), "outer_device": ("outer", "device"),
    "codec_up": ("codec", "up"), "codec_down": ("codec", "down"),
    "block_size": ("codec", "block_size"), "error_decay": ("codec", "error_decay"),
    "sparse_chunk": ("codec", "chunk"), "sparse_k": ("codec", "k"),
    "mean_from": ("codec", "mean_from"),
    **{k: ("membership", k) for k in (
        "quorum", "min_quorum", "deadline_s", "absent_deadline_s", "grace_s",
        "grace_min_s", "grace_max_s", "max_staleness", "late")},
    "norm_guard": ("guard", "ratio"), "norm_guard_warmup": ("guard", "warmup"),
    "norm_guard_params": ("guard", "params_ratio"), "norm_guard_window": ("guard", "window"),
    **{k: ("liveness", k) for k in (
        "lease_s", "stall_after_s", "outage_s", "poll_interval_s", "poll_max_s")},
}
#: Flat keys that became something else: the new key(s) their message names.
_RESHAPED = {"error_feedback": "sync.codec.feedback_up and sync.codec.feedback_down",
             "sparse_density": "sync.codec.k (k = density x chunk)"}


def nest_flat_keys(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``data`` with the flat keys of earlier versions moved into their sections,
    and one message per key moved (``sync.schedule.sync_every is deprecated; use
    sync.schedule.sync_every``). A key given both ways is an error."""
    flat = [k for k in data if k in FLAT_KEYS or k in _RESHAPED]
    if not flat:
        return data, []
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()
           if k not in flat}
    notes = []

    def put(old: str, section: str, field: str, value: Any) -> None:
        node = out.setdefault(section, {})
        if not isinstance(node, dict):
            return  # the section's own validation reports it
        if field in node:
            raise ValueError(f"{old} and {section}.{field} are both set; keep "
                             f"{section}.{field}")
        node[field] = value

    for old in flat:
        value = data[old]
        if old == "error_feedback":
            if value is not None:
                put(old, "codec", "feedback_up", value)
                put(old, "codec", "feedback_down", value)
        elif old == "sparse_density":
            if value is not None:
                if data.get("sparse_k") is not None:
                    raise ValueError("sparse_k and sparse_density: give one of them, not both")
                put(old, "codec", "k", _k_of_density(value, data.get("sparse_chunk", 4096)))
        else:
            put(old, *FLAT_KEYS[old], value)
        new = _RESHAPED.get(old) or "sync." + ".".join(FLAT_KEYS[old])
        notes.append(f"sync.{old} is deprecated; use {new}")
    return out, notes


def _k_of_density(density: Any, chunk: Any) -> int:
    try:
        d, c = float(density), int(chunk)
    except (TypeError, ValueError):
        raise ValueError(f"sparse_density must be a number in (0, 1], got {density!r}") from None
    if not 0.0 < d <= 1.0:
        raise ValueError(f"sparse_density must be in (0, 1], got {density!r}")
    return max(1, min(c, round(d * c)))
