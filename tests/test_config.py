"""SyncConfig: one section per concern, validation messages that name the field's
path and what is allowed, the per-mode defaults of docs/algorithms.md sections 2 and
6 resolved once into the config, and the flat keys of earlier versions still read."""

from __future__ import annotations

import math
import warnings

import pytest
from pydantic import ValidationError

from diloco.config import DeprecatedKey, SyncConfig
from diloco.flat_keys import FLAT_KEYS
from workers.config import ConfigError, load_config

# -- invalid combinations --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sections", "needles"),
    [
        # P > H
        (dict(schedule=dict(sync_every=4, fragments=5)),
         ["schedule", "fragments (P)", "<= sync_every (H) = 4", "got 5"]),
        # H not divisible by P: 6 % 4 = 2
        (dict(schedule=dict(sync_every=6, fragments=4)),
         ["fragments (P)", "divisible", "H = 6, P = 4"]),
        # tau = 2 >= H / P = 6 / 3 = 2
        (dict(schedule=dict(sync_every=6, fragments=3, overlap=2)),
         ["overlap (tau)", "0 <= tau < H/P = 2", "got 2"]),
        (dict(schedule=dict(sync_every=6, fragments=3, overlap=-1)),
         ["overlap (tau)", "0 <= tau < H/P = 2", "got -1"]),
        (dict(schedule=dict(sync_every=0)),
         ["schedule.sync_every", "greater than or equal to 1"]),
        (dict(schedule=dict(fragments=0)), ["schedule.fragments", "greater than or equal to 1"]),
        # alpha outside [0, 1]
        (dict(schedule=dict(alpha=1.5)), ["schedule.alpha", "less than or equal to 1"]),
        (dict(schedule=dict(alpha=-0.1)), ["schedule.alpha", "greater than or equal to 0"]),
        (dict(schedule=dict(alpha=float("nan"))), ["schedule.alpha"]),
        # codecs
        (dict(codec=dict(up="int3")), ["codec.up", "none, fp16, int8, int4, fp4-e3m0", "'int3'"]),
        (dict(codec=dict(down="fp8")), ["codec.down", "none, fp16, int8, int4", "'fp8'"]),
        (dict(codec=dict(up="int8", block_size=3)), ["block_size", "even integer"]),
        (dict(codec=dict(k=0)), ["codec.k", "greater than or equal to 1"]),
        (dict(codec=dict(error_decay=0.0)), ["codec.error_decay", "greater than 0"]),
        # outer optimizer
        (dict(outer=dict(momentum=1.0)), ["outer.momentum", "less than 1"]),
        (dict(outer=dict(momentum=-0.5)), ["outer.momentum", "greater than or equal to 0"]),
        (dict(outer=dict(lr=0.0)), ["outer.lr", "greater than 0"]),
        (dict(outer=dict(step="average", momentum=0.9)),
         ["outer.momentum must be 0 or unset with outer.step 'average'"]),
        # membership
        (dict(membership=dict(quorum=0.0)), ["membership.quorum", "greater than 0"]),
        (dict(membership=dict(quorum=1.5)), ["membership.quorum", "less than or equal to 1"]),
        (dict(membership=dict(deadline_s=-1.0)), ["membership.deadline_s", "greater than or"]),
        (dict(membership=dict(grace_s=-1)), ["membership.grace_s", "'adaptive'"]),
        (dict(membership=dict(grace_min_s=5, grace_max_s=1)),
         ["grace_min_s must be in [0, grace_max_s = 1"]),
        # guard and liveness
        (dict(guard=dict(ratio=0.5)), ["guard", "ratio must be 0 (off) or >= 1"]),
        (dict(guard=dict(window=0)), ["guard.window", "greater than or equal to 1"]),
        (dict(liveness=dict(lease_s=0)), ["liveness.lease_s", "greater than 0"]),
        (dict(liveness=dict(poll_interval_s=1, poll_max_s=0.5)),
         ["poll_interval_s must be in (0, poll_max_s = 0.5]"]),
        # blocking DiLoCo has no overlap (H = 4, P = 1: tau = 1 < 4 is otherwise fine)
        (dict(schedule=dict(mode="diloco", sync_every=4, fragments=1, overlap=1)),
         ["overlap (tau)", "must be 0 in mode 'diloco'", "got 1"]),
    ],
)
def test_invalid_values_name_the_field(sections, needles):
    with pytest.raises(ValidationError) as info:
        SyncConfig(**sections)
    message = str(info.value)
    for needle in needles:
        assert needle in message, (needle, message)


def test_a_recipe_error_names_the_whole_path_in_one_line():
    with pytest.raises(ConfigError) as info:
        load_config("tiny", ["sync.schedule.fragments=0"])
    message = str(info.value)
    assert "\n" not in message
    assert "--set sync.schedule.fragments=0" in message
    assert "sync.schedule.fragments: Input should be greater than or equal to 1" in message


def test_unknown_field_is_named_with_the_allowed_ones():
    with pytest.raises(ValidationError) as info:
        SyncConfig(sync_evry=4)
    message = str(info.value)
    assert "unknown field(s) sync_evry" in message
    assert "allowed: schedule, outer, codec, membership, guard, liveness" in message
    with pytest.raises(ValidationError) as info:
        SyncConfig(schedule={"sync_evry": 4})
    message = str(info.value)
    assert "unknown field(s) sync_evry" in message
    assert "allowed: mode, eager_rule, sync_every, fragments" in message


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("mode", "blocking", "'diloco', 'streaming' or 'eager'"),
        ("eager_rule", "delayed", "'adaptive', 'pure' or 'naive'"),
        ("pattern", "random", "'strided' or 'sequential'"),
    ],
)
def test_unknown_literal_lists_the_allowed_values(field, value, allowed):
    with pytest.raises(ValidationError) as info:
        SyncConfig(schedule={field: value})
    message = str(info.value)
    assert f"schedule.{field}" in message
    assert allowed in message


def test_config_and_its_sections_are_frozen():
    cfg = SyncConfig()
    with pytest.raises(ValidationError):
        cfg.schedule.sync_every = 10
    with pytest.raises(ValidationError):
        cfg.schedule = cfg.schedule


def test_valid_edges_are_accepted():
    SyncConfig(schedule={"sync_every": 6, "fragments": 3, "overlap": 1})  # 1 < 6 / 3
    SyncConfig(schedule={"sync_every": 5, "fragments": 5})  # P = H, s = 1, tau = 0
    SyncConfig(schedule={"alpha": 0.0})
    SyncConfig(schedule={"alpha": 1.0})
    SyncConfig(outer={"momentum": 0.0})
    SyncConfig(membership={"quorum": 1.0, "grace_s": 0})
    SyncConfig(guard={"ratio": 0})
    SyncConfig(schedule={"mode": "diloco", "sync_every": 4, "overlap": 0})


def test_every_field_has_a_docstring():
    """`--help`-like listings and docs/configuration.md come from them."""
    for section, model in type(SyncConfig()).model_fields.items():
        assert model.description, section
        for name, field in model.annotation.model_fields.items():
            assert field.description and len(field.description) > 10, (section, name)


# -- defaults resolved once --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "eta", "mu"),
    [
        ("diloco", 0.7, 0.9),  # DiLoCo's defaults (section 1)
        ("streaming", 0.7, 0.9),
        ("eager", 0.7, 0.5),  # stale updates and momentum 0.9 do not mix (section 4)
    ],
)
def test_outer_defaults_per_mode_are_resolved_into_the_config(mode, eta, mu):
    cfg = SyncConfig(schedule={"mode": mode})
    assert (cfg.outer.lr, cfg.outer.momentum) == (eta, mu)
    assert cfg.model_dump()["outer"] == {"step": "nesterov", "lr": eta, "momentum": mu,
                                         "device": "cpu"}


@pytest.mark.parametrize("mode", ["diloco", "streaming", "eager"])
def test_outer_overrides(mode):
    cfg = SyncConfig(schedule={"mode": mode}, outer={"lr": 0.4, "momentum": 0.0})
    assert (cfg.outer.lr, cfg.outer.momentum) == (0.4, 0.0)
    cfg = SyncConfig(schedule={"mode": mode}, outer={"momentum": 0.8})
    assert (cfg.outer.lr, cfg.outer.momentum) == (0.7, 0.8)  # lr still the default


def test_no_field_of_a_built_config_is_left_unset():
    """The manifest stores every value in force: nothing says "decided elsewhere"."""
    for cfg in (SyncConfig(), SyncConfig(codec={"up": "topk2"}),
                SyncConfig(schedule={"overlap": "auto", "sync_every": 12, "fragments": 2})):
        for section, fields in cfg.model_dump().items():
            assert None not in fields.values(), (section, fields)


def test_a_dumped_config_reads_back_equal():
    for cfg in (SyncConfig(), SyncConfig(schedule={"mode": "eager"}, codec={"up": "topk4"}),
                SyncConfig(outer={"step": "average"})):
        assert SyncConfig(**cfg.model_dump()) == cfg
        assert SyncConfig(**cfg.model_dump(mode="json")) == cfg


def test_default_mode_is_streaming():
    s = SyncConfig().schedule
    assert (s.mode, s.eager_rule, s.pattern) == ("streaming", "adaptive", "strided")


@pytest.mark.parametrize(
    ("codec", "expected"),
    [
        ("int4", True),  # 4-bit and below: on (section 5)
        ("fp4-e3m0", True),
        ("topk2", True),
        ("int8", False),
        ("fp16", False),
        ("none", False),
    ],
)
def test_error_feedback_default_per_direction(codec, expected):
    cfg = SyncConfig(codec={"up": codec, "down": codec})
    assert cfg.codec.feedback_up is expected
    assert cfg.codec.feedback_down is expected


def test_error_feedback_override():
    off = SyncConfig(codec={"up": "int4", "feedback_up": False})
    assert off.codec.feedback_up is False
    on = SyncConfig(codec={"up": "int8", "down": "fp16", "feedback_up": True,
                           "feedback_down": True})
    assert on.codec.feedback_up is on.codec.feedback_down is True
    # codec none is lossless float32: its residual would always be zero
    assert SyncConfig(codec={"feedback_up": True}).codec.feedback_up is False


def test_codec_specs():
    cfg = SyncConfig(codec={"up": "int4", "down": "int8", "block_size": 64})
    assert (cfg.up.name, cfg.up.block_size) == ("int4", 64)
    assert (cfg.down.name, cfg.down.block_size) == ("int8", 64)


def test_k_is_set_one_way_and_scales_with_the_chunk_by_default():
    assert SyncConfig(codec={"up": "topk2"}).codec.k == 64
    assert SyncConfig(codec={"up": "topk2", "chunk": 1024}).codec.k == 16
    assert SyncConfig(codec={"up": "topk2", "k": 33}).up.k == 33


# -- send offset and merge alpha ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "send_offset", "merge_alpha"),
    [
        # blocking DiLoCo: tau must be 0; the merge sets live = outer (alpha 0)
        (dict(mode="diloco", sync_every=4, alpha=0.5), 0, 0.0),
        # streaming: tau and alpha as given
        (dict(mode="streaming", sync_every=6, fragments=3, overlap=1, alpha=0.5), 1, 0.5),
        (dict(mode="streaming", sync_every=6, fragments=3, overlap=0, alpha=0.0), 0, 0.0),
        # adaptive eager: sends tau before the merge, lerp with alpha (section 4)
        (dict(mode="eager", eager_rule="adaptive", sync_every=6, fragments=3, overlap=1,
              alpha=0.25), 1, 0.25),
        # pure eager: sends at the merge point and sets live = outer
        (dict(mode="eager", eager_rule="pure", sync_every=6, fragments=3, overlap=1,
              alpha=0.25), 0, 0.0),
        # naive delayed: the same schedule as pure eager
        (dict(mode="eager", eager_rule="naive", sync_every=6, fragments=3, overlap=1,
              alpha=0.25), 0, 0.0),
    ],
)
def test_send_offset_and_merge_alpha(schedule, send_offset, merge_alpha):
    s = SyncConfig(schedule=schedule).schedule
    assert s.send_offset == send_offset
    assert s.merge_alpha == merge_alpha


# -- the flat keys of earlier versions -------------------------------------------------------------


def test_flat_keys_still_work_with_one_warning_each_naming_the_new_key():
    with pytest.warns(DeprecatedKey) as caught:
        cfg = SyncConfig(sync_every=20, fragments=2, codec_up="topk2", norm_guard=5.0,
                         lease_s=30.0)
    assert cfg == SyncConfig(schedule={"sync_every": 20, "fragments": 2},
                             codec={"up": "topk2"}, guard={"ratio": 5.0},
                             liveness={"lease_s": 30.0})
    notes = sorted(str(w.message) for w in caught)
    assert notes == sorted([
        "sync.sync_every is deprecated; use sync.schedule.sync_every",
        "sync.fragments is deprecated; use sync.schedule.fragments",
        "sync.codec_up is deprecated; use sync.codec.up",
        "sync.norm_guard is deprecated; use sync.guard.ratio",
        "sync.lease_s is deprecated; use sync.liveness.lease_s",
    ])


def test_every_flat_key_lands_in_its_section():
    values = {"mode": "eager", "eager_rule": "pure", "sync_every": 12, "fragments": 3,
              "overlap": 1, "overlap_start": None, "overlap_margin": 0.5, "alpha": 0.25,
              "pattern": "sequential", "separate_rest": True, "split_tensors": False,
              "outer_step": "nesterov", "outer_lr": 0.5, "outer_momentum": 0.3,
              "outer_device": "device", "codec_up": "topk2", "codec_down": "int8",
              "block_size": 64, "error_decay": 0.9, "sparse_chunk": 1024, "sparse_k": 7,
              "mean_from": "aggregator", "quorum": 0.75, "min_quorum": 2,
              "deadline_s": 60.0, "absent_deadline_s": 3.0, "grace_s": 2.0,
              "grace_min_s": 0.1, "grace_max_s": 9.0, "max_staleness": 3, "late": "fold",
              "norm_guard": 4.0, "norm_guard_warmup": 5, "norm_guard_params": 9.0,
              "norm_guard_window": 3, "lease_s": 40.0, "stall_after_s": 20.0,
              "outage_s": 100.0, "poll_interval_s": 0.01, "poll_max_s": 0.2}
    assert set(values) == set(FLAT_KEYS)
    cfg = SyncConfig.stored(values)
    dumped = cfg.model_dump()
    for key, (section, field) in FLAT_KEYS.items():
        if values[key] is not None:
            assert dumped[section][field] == values[key], key


def test_reshaped_flat_keys():
    with pytest.warns(DeprecatedKey) as caught:
        cfg = SyncConfig(codec_up="topk2", sparse_chunk=4096, sparse_density=0.008)
    assert cfg.codec.k == 33
    assert "sync.sparse_density is deprecated; use sync.codec.k (k = density x chunk)" in [
        str(w.message) for w in caught]
    with pytest.warns(DeprecatedKey) as caught:
        cfg = SyncConfig(codec_up="int8", codec_down="int8", error_feedback=True)
    assert cfg.codec.feedback_up and cfg.codec.feedback_down
    assert ("sync.error_feedback is deprecated; use sync.codec.feedback_up and "
            "sync.codec.feedback_down") in [str(w.message) for w in caught]
    with pytest.raises(ValidationError, match="give one of them, not both"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecatedKey)
        SyncConfig(sparse_k=8, sparse_density=0.1)


def test_a_key_given_both_ways_is_refused():
    with pytest.raises(ValidationError, match="sync_every and schedule.sync_every are both"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecatedKey)
        SyncConfig(sync_every=10, schedule={"sync_every": 20})


def test_a_stored_old_config_is_read_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = SyncConfig.stored({"sync_every": 10, "fragments": 2, "grace_s": None,
                                 "outer_lr": None})
    assert cfg.membership.grace_s == "adaptive" and cfg.outer.lr == 0.7


def test_an_old_recipe_loads_with_one_line_per_flat_key(tmp_path):
    recipe = tmp_path / "old.yaml"
    recipe.write_text("sync:\n  sync_every: 20\n  fragments: 2\n  codec_up: int4\n")
    with pytest.warns(DeprecatedKey) as caught:
        cfg = load_config(recipe)
    assert (cfg.sync.schedule.sync_every, cfg.sync.codec.up) == (20, "int4")
    notes = [str(w.message) for w in caught]
    assert notes == [f"{recipe}: sync.sync_every is deprecated; use sync.schedule.sync_every",
                     f"{recipe}: sync.fragments is deprecated; use sync.schedule.fragments",
                     f"{recipe}: sync.codec_up is deprecated; use sync.codec.up"]
    # an old-style override wins over the recipe's nested value, as overrides do
    with pytest.warns(DeprecatedKey, match="--set sync.overlap is deprecated; use sync.sche"):
        assert load_config("tiny", ["sync.overlap=0"]).sync.schedule.overlap == 0


def test_shipped_recipes_use_no_flat_key():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecatedKey)
        for name in ("tiny", "small", "gpu-150m", "gpu-1b"):
            load_config(name)


def test_changed_validates_and_refuses_flat_copies():
    cfg = SyncConfig()
    assert cfg.changed(membership={"grace_s": 0.0}).membership.grace_s == 0.0
    with pytest.raises(ValidationError):
        cfg.changed(schedule={"fragments": 0})
    with pytest.raises(ValueError, match="use SyncConfig.changed"):
        cfg.model_copy(update={"grace_s": 1.0})
    assert math.isclose(cfg.changed(outer={"lr": 0.3}).outer.lr, 0.3)
