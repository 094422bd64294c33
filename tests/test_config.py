"""SyncConfig: validation messages that name the field and what is allowed, the
per-mode defaults of docs/algorithms.md sections 2 and 6, and the derived knobs."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from diloco.config import SyncConfig

# -- invalid combinations --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        # P > H
        (dict(sync_every=4, fragments=5), ["fragments (P)", "<= sync_every (H) = 4", "got 5"]),
        # H not divisible by P: 6 % 4 = 2
        (dict(sync_every=6, fragments=4), ["fragments (P)", "divisible", "H = 6, P = 4"]),
        # tau = 2 >= H / P = 6 / 3 = 2
        (
            dict(sync_every=6, fragments=3, overlap=2),
            ["overlap (tau)", "0 <= tau < H/P = 2", "got 2"],
        ),
        (
            dict(sync_every=6, fragments=3, overlap=-1),
            ["overlap (tau)", "0 <= tau < H/P = 2", "got -1"],
        ),
        (dict(sync_every=0), ["sync_every (H)", ">= 1", "got 0"]),
        (dict(fragments=0), ["fragments (P)", ">= 1", "got 0"]),
        # alpha outside [0, 1]
        (dict(alpha=1.5), ["alpha", "[0, 1]", "got 1.5"]),
        (dict(alpha=-0.1), ["alpha", "[0, 1]", "got -0.1"]),
        (dict(alpha=float("nan")), ["alpha", "[0, 1]"]),
        # codecs
        (dict(codec_up="int3"), ["codec_up", "none, fp16, int8, int4, fp4-e3m0", "'int3'"]),
        (dict(codec_down="fp8"), ["codec_down", "none, fp16, int8, int4, fp4-e3m0", "'fp8'"]),
        (dict(codec_up="int8", block_size=3), ["block_size", "even integer"]),
        # outer optimizer
        (dict(outer_momentum=1.0), ["outer_momentum", "[0, 1)", "got 1.0"]),
        (dict(outer_momentum=-0.5), ["outer_momentum", "[0, 1)", "got -0.5"]),
        (dict(outer_lr=0.0), ["outer_lr", "> 0", "got 0.0"]),
        # quorum
        (dict(quorum=0.0), ["quorum", "(0, 1]", "got 0.0"]),
        (dict(quorum=1.5), ["quorum", "(0, 1]", "got 1.5"]),
        (dict(deadline_s=-1.0), ["deadline_s", ">= 0"]),
        # blocking DiLoCo has no overlap (H = 4, P = 1: tau = 1 < 4 is otherwise fine)
        (
            dict(mode="diloco", sync_every=4, fragments=1, overlap=1),
            ["overlap (tau)", "must be 0 in mode 'diloco'", "got 1"],
        ),
    ],
)
def test_invalid_values_name_the_field(kwargs, needles):
    with pytest.raises(ValidationError) as info:
        SyncConfig(**kwargs)
    message = str(info.value)
    for needle in needles:
        assert needle in message, (needle, message)


def test_unknown_field_is_named():
    with pytest.raises(ValidationError) as info:
        SyncConfig(sync_evry=4)
    message = str(info.value)
    assert "unknown field(s) sync_evry" in message
    # the allowed fields are listed, so a typo is easy to fix
    assert "allowed: mode, eager_rule, sync_every" in message


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("mode", "blocking", "'diloco', 'streaming' or 'eager'"),
        ("eager_rule", "naive", "'adaptive' or 'pure'"),
        ("pattern", "random", "'strided' or 'sequential'"),
    ],
)
def test_unknown_literal_lists_the_allowed_values(field, value, allowed):
    with pytest.raises(ValidationError) as info:
        SyncConfig(**{field: value})
    message = str(info.value)
    assert field in message
    assert allowed in message


def test_config_is_frozen():
    cfg = SyncConfig()
    with pytest.raises(ValidationError):
        cfg.sync_every = 10


def test_valid_edges_are_accepted():
    SyncConfig(sync_every=6, fragments=3, overlap=1)  # tau = 1 < 6 / 3 = 2
    SyncConfig(sync_every=5, fragments=5)  # P = H, s = 1, tau = 0
    SyncConfig(alpha=0.0)
    SyncConfig(alpha=1.0)
    SyncConfig(outer_momentum=0.0)
    SyncConfig(quorum=1.0)
    SyncConfig(mode="diloco", sync_every=4, overlap=0)


# -- outer optimizer defaults per mode ---------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "eta", "mu"),
    [
        ("diloco", 0.7, 0.9),  # DiLoCo's defaults (section 1)
        ("streaming", 0.7, 0.9),
        ("eager", 0.7, 0.5),  # stale updates and momentum 0.9 do not mix (section 4)
    ],
)
def test_outer_defaults_per_mode(mode, eta, mu):
    cfg = SyncConfig(mode=mode)
    assert cfg.outer_lr is None and cfg.outer_momentum is None
    assert (cfg.eta, cfg.mu) == (eta, mu)


@pytest.mark.parametrize("mode", ["diloco", "streaming", "eager"])
def test_outer_overrides(mode):
    cfg = SyncConfig(mode=mode, outer_lr=0.4, outer_momentum=0.0)
    assert (cfg.eta, cfg.mu) == (0.4, 0.0)
    cfg = SyncConfig(mode=mode, outer_momentum=0.8)
    assert (cfg.eta, cfg.mu) == (0.7, 0.8)  # lr still the default


def test_default_mode_is_streaming():
    cfg = SyncConfig()
    assert cfg.mode == "streaming"
    assert cfg.eager_rule == "adaptive"
    assert cfg.pattern == "strided"


# -- error feedback ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("codec", "expected"),
    [
        ("int4", True),  # 4-bit and below: on (section 5)
        ("fp4-e3m0", True),
        ("int8", False),
        ("fp16", False),
        ("none", False),
    ],
)
def test_error_feedback_default(codec, expected):
    cfg = SyncConfig(codec_up=codec)
    assert cfg.error_feedback is None
    assert cfg.feedback(codec) is expected


def test_error_feedback_override():
    off = SyncConfig(codec_up="int4", error_feedback=False)
    assert off.feedback("int4") is False
    assert off.feedback("fp4-e3m0") is False
    on = SyncConfig(codec_up="int8", error_feedback=True)
    assert on.feedback("int8") is True
    assert on.feedback("fp16") is True
    # codec none is lossless float32: its residual would always be zero
    assert on.feedback("none") is False


def test_codec_specs():
    cfg = SyncConfig(codec_up="int4", codec_down="int8", block_size=64)
    assert (cfg.up.name, cfg.up.block_size) == ("int4", 64)
    assert (cfg.down.name, cfg.down.block_size) == ("int8", 64)


# -- send offset and merge alpha ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "send_offset", "merge_alpha"),
    [
        # blocking DiLoCo: tau must be 0; the merge sets live = outer (alpha 0)
        (dict(mode="diloco", sync_every=4, alpha=0.5), 0, 0.0),
        # streaming: tau and alpha as given
        (dict(mode="streaming", sync_every=6, fragments=3, overlap=1, alpha=0.5), 1, 0.5),
        (dict(mode="streaming", sync_every=6, fragments=3, overlap=0, alpha=0.0), 0, 0.0),
        # adaptive eager: sends tau before the merge, lerp with alpha (section 4)
        (
            dict(
                mode="eager",
                eager_rule="adaptive",
                sync_every=6,
                fragments=3,
                overlap=1,
                alpha=0.25,
            ),
            1,
            0.25,
        ),
        # pure eager: sends at the merge point and sets live = outer
        (
            dict(mode="eager", eager_rule="pure", sync_every=6, fragments=3, overlap=1, alpha=0.25),
            0,
            0.0,
        ),
    ],
)
def test_send_offset_and_merge_alpha(kwargs, send_offset, merge_alpha):
    cfg = SyncConfig(**kwargs)
    assert cfg.send_offset == send_offset
    assert cfg.merge_alpha == merge_alpha
