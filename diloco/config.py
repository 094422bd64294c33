"""Configuration of the synchronisation between replicas, one section per concern.

``SyncConfig`` holds every knob of docs/algorithms.md in six sections, as a recipe
writes them under ``sync:``:

- ``schedule``: when fragments are sent and merged (mode, H, P, tau, alpha);
- ``outer``: the outer optimizer (step, learning rate, momentum, device);
- ``codec``: how outer gradients and means travel (codecs, k, error feedback,
  where the mean comes from);
- ``membership``: who a round waits for and what becomes of the late;
- ``guard``: the norm guard against a contribution that would ruin the model;
- ``liveness``: leases, stalls, outages and polling.

Ranges are ``Field`` constraints, so an error names the field's whole path
(``sync.schedule.fragments``). Defaults that depend on other fields (the outer
learning rate and momentum per mode, error feedback per codec, the sparse codecs'
k, decay and way down, overlap auto's start) are resolved once, when the config is
built: the run manifest stores every value in force and nothing reads a ``None``
as "decided elsewhere". The flat keys of earlier versions (``sync_every``,
``codec_up``, ``sparse_density``, ...) are still read: in a recipe each gives one
line naming its new key (`DeprecatedKey`); in a stored manifest silently, so old
runs keep resuming.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from diloco.flat_keys import nest_flat_keys
from diloco.strict import names_unknown_fields, unknown_fields_message
from storage.codecs import CODEC_NAMES, SPARSE_CODECS, CodecSpec

Mode = Literal["diloco", "streaming", "eager"]
EagerRule = Literal["adaptive", "pure", "naive"]
Pattern = Literal["strided", "sequential"]
OuterStep = Literal["nesterov", "average"]
MeanFrom = Literal["aggregator", "peers"]
OuterDevice = Literal["cpu", "device"]
Late = Literal["fold", "decay", "drop"]

# Outer optimizer defaults per mode (docs/algorithms.md sections 2 and 6). Blocking and
# streaming use DiLoCo's 0.7 / 0.9. Stale updates and outer momentum do not mix
# (measured: docs/algorithms.md section 2), so eager mode defaults to momentum 0.5.
OUTER_DEFAULTS: dict[str, tuple[float, float]] = {
    "diloco": (0.7, 0.9),
    "streaming": (0.7, 0.9),
    "eager": (0.7, 0.5),
}

_LOW_BIT_CODECS = {"int4", "fp4-e3m0", *SPARSE_CODECS}
#: SparseLoCo's decay of the error-feedback accumulator (arXiv 2508.15706)
SPARSE_ERROR_DECAY = 0.95
#: k of 4096 by default: Covenant-72B's 64 (1.56%)
DEFAULT_SPARSE_K = 64
#: the default guard.params_ratio: honest outer gradients of the benchmark runs stayed
#: below half their fragment's initial norm (docs/algorithms.md, the norm guard)
NORM_GUARD_PARAMS = 20.0


class DeprecatedKey(FutureWarning):
    """A flat ``sync`` key of an earlier version; the message names the new key."""


@contextmanager
def quiet_deprecations() -> Iterator[None]:
    """Read flat keys without their `DeprecatedKey` lines: a stored manifest of an old
    run, or a second validation of what was already reported once."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecatedKey)
        yield


class _Section(BaseModel):
    """Frozen, unknown fields refused with the list of allowed ones."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    _known_fields = names_unknown_fields()


class ScheduleConfig(_Section):
    """When each fragment is sent and merged (docs/algorithms.md sections 1 to 3)."""

    mode: Mode = "streaming"
    """diloco: blocking (send and wait every H steps); streaming: P staggered
    fragments, each sent tau steps before its merge; eager: never wait for this
    round's mean (``eager_rule`` picks how the merge stands in for it)."""
    eager_rule: EagerRule = "adaptive"
    """mode eager: adaptive (merge the local delta with the last mean), pure
    (the paper's estimate: the others' previous part and the local delta) or naive
    (apply only the previous round's mean, the baseline the paper beats)."""
    sync_every: int = Field(default=50, ge=1)
    """H: inner steps between two syncs of the same fragment."""
    fragments: int = Field(default=1, ge=1)
    """P: how many fragments the model is split into (H must be a multiple)."""
    overlap: int | Literal["auto"] = 0
    """tau: steps a fragment is in flight between its send and its merge
    (0 <= tau < H/P); auto: each worker sizes it per merge point to its measured
    exchange latency (diloco/overlap.py; mode streaming only)."""
    overlap_start: int | None = Field(default=None, ge=1)
    """overlap auto: tau before any latency is measured, and of the rounds merging
    after the run's end; unset: H/P - 1 (the first merges do not wait either)."""
    overlap_margin: float = Field(default=0.25, ge=0.0)
    """overlap auto: tau covers the 75th percentile of recent latencies plus this
    fraction of it."""
    alpha: float = Field(default=0.5, ge=0.0, le=1.0)
    """Merge weight of the local side: ``lerp(theta_new, theta_m, alpha)``."""
    pattern: Pattern = "strided"
    """How blocks are dealt to fragments: strided (block i to fragment i mod P) or
    sequential (contiguous runs)."""
    separate_rest: bool = False
    """Parameters outside the repeated blocks form a fragment of their own."""
    split_tensors: bool = True
    """Fragments may cut a tensor, so each holds 1/P of the parameters to within
    one block."""

    @field_validator("overlap", mode="before")
    @classmethod
    def _overlap_value(cls, value: object) -> object:
        """One message for anything but an integer or ``auto`` (not one per union arm)."""
        if isinstance(value, str) and value.strip() != "auto":
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"must be an integer tau or 'auto', got {value!r}") from None
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"must be an integer tau or 'auto', got {value!r}")
        return value.strip() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> ScheduleConfig:
        h, p = self.sync_every, self.fragments
        if p > h:
            raise ValueError(f"fragments (P) must be <= sync_every (H) = {h}, got {p}")
        if h % p:
            raise ValueError(
                f"sync_every (H) must be divisible by fragments (P): H = {h}, P = {p}"
            )
        if self.auto and self.mode != "streaming":  # blocking and pure eager send at the
            # merge; the other eager rules merge before the mean arrives, which the
            # workers' agreement on tau needs (diloco/overlap.py)
            raise ValueError(f"overlap 'auto' needs mode streaming, got mode {self.mode!r}")
        tau = self.send_offset
        if not 0 <= tau < h // p:
            field = "overlap_start" if self.auto else "overlap (tau)"
            low = 1 if self.auto else 0
            raise ValueError(f"{field} must satisfy {low} <= tau < H/P = {h // p}, got {tau}")
        if self.mode == "diloco" and tau != 0:
            raise ValueError(f"overlap (tau) must be 0 in mode 'diloco' (blocking), got {tau}")
        return self

    @property
    def auto(self) -> bool:
        """``overlap: auto``: each worker decides tau per merge point (`diloco.overlap`)."""
        return self.overlap == "auto"

    @property
    def sends_at_merge(self) -> bool:
        """The eager rules that apply a whole previous mean (pure, naive): each send
        happens at its merge step and the live fragment restarts from the outer value."""
        return self.mode == "eager" and self.eager_rule in ("pure", "naive")

    @property
    def send_offset(self) -> int:
        """Steps between a fragment's send and its merge (pure and naive eager send
        at the merge). With ``overlap: auto`` the reference tau, ``overlap_start``, which fixes
        the round counts (the workers' decisions keep it past the run's end)."""
        if self.sends_at_merge:
            return 0
        if self.auto:
            return int(self.overlap_start or max(1, self.sync_every // self.fragments - 1))
        return int(self.overlap)

    @property
    def merge_alpha(self) -> float:
        """The alpha the merge really uses: blocking DiLoCo and pure and naive eager
        set the live fragment to the new outer value (alpha 0)."""
        if self.mode == "diloco" or self.sends_at_merge:
            return 0.0
        return self.alpha


class OuterConfig(_Section):
    """The outer optimizer each fragment's outer parameters take their step with."""

    step: OuterStep = "nesterov"
    """nesterov: SGD with Nesterov momentum; average: theta -= lr * mean, no momentum
    (SparseLoCo)."""
    lr: float | None = Field(default=None, gt=0.0)
    """eta_out; unset: 0.7 (1 with step average, which then sets theta to the mean
    of the replicas). Resolved when the config is built."""
    momentum: float | None = Field(default=None, ge=0.0, lt=1.0)
    """mu; unset: 0.9, 0.5 in mode eager, 0 with step average. Resolved when the
    config is built."""
    device: OuterDevice = "cpu"
    """Where a worker keeps its float32 outer state: cpu (beside the aggregator's,
    bit for bit), or device: on its model's device (a GPU: no host copy of the live
    fragment; deltas and means cross through pinned memory without blocking)."""


class CodecConfig(_Section):
    """How outer gradients travel up and means come down."""

    up: str = "none"
    """Codec of the workers' outer gradients: none, fp16, int8, int4, fp4-e3m0, or the
    sparse topk2 and topk4."""
    down: str = "none"
    """Codec of the mean the aggregator publishes (``mean_from: aggregator``)."""
    block_size: int = 128
    """Values per scale block of the quantized codecs."""
    feedback_up: bool | None = None
    """Error feedback on the outer gradients: what the codec lost is added to the
    next one. Unset: on for the 4-bit codecs and below; always off for none."""
    feedback_down: bool | None = None
    """Error feedback on the aggregator's mean (``mean_from: aggregator``). Unset: on
    for the 4-bit codecs and below; always off for none."""
    error_decay: float | None = Field(default=None, gt=0.0, le=1.0)
    """beta: the error-feedback accumulator is multiplied by it before the next
    outer gradient is added; unset: 0.95 for a sparse ``up`` (SparseLoCo), else 1."""
    chunk: int = 4096
    """C: values per chunk of the sparse codecs (top-k per chunk)."""
    k: int | None = Field(default=None, ge=1)
    """Values a chunk of a sparse codec sends; unset: 64 per 4096 (Covenant-72B's
    1.56%), scaled to ``chunk``."""
    mean_from: MeanFrom | None = None
    """aggregator: workers read the mean it publishes (codec ``down``); peers: the
    aggregator commits only the weights and each worker averages the contributions it
    names itself (no second rounding, M - 1 reads); unset: peers for a sparse ``up``
    (their M - 1 payloads are smaller than one dense mean up to about M = 35), else
    aggregator."""

    @field_validator("up", "down")
    @classmethod
    def _known_codec(cls, value: str) -> str:
        if value not in CODEC_NAMES:
            raise ValueError(f"must be one of {', '.join(CODEC_NAMES)}; got {value!r}")
        return value


class MembershipConfig(_Section):
    """Who a round waits for, how long, and what becomes of a late contribution."""

    quorum: float = Field(default=0.5, gt=0.0, le=1.0)
    """Share of the expected members a round needs before it may go on without the
    rest (at least ``min_quorum``)."""
    min_quorum: int = Field(default=1, ge=1)
    """Members a round needs at least before it may go on without the rest."""
    deadline_s: float = Field(default=600.0, ge=0.0)
    """Longest wait for the rest, from a round's first contribution, once a quorum
    is in (the grace window is usually shorter)."""
    absent_deadline_s: float = Field(default=30.0, ge=0.0)
    """Seconds the aggregator waits for a worker that missed an earlier deadline."""
    grace_s: float | Literal["adaptive"] = "adaptive"
    """Seconds the aggregator waits for the rest once a quorum is in; adaptive: from
    the arrival spread of recent rounds, within ``grace_min_s .. grace_max_s``."""
    grace_min_s: float = Field(default=0.5, ge=0.0)
    """Shortest adaptive grace window."""
    grace_max_s: float = Field(default=60.0, ge=0.0)
    """Longest adaptive grace window."""
    max_staleness: int = Field(default=2, ge=0)
    """Rounds a late contribution may be behind and still be applied (in the next
    mean of its fragment); a worker further behind heals to the canonical state."""
    late: Late = "drop"
    """What becomes of a contribution that missed its round and arrives within
    ``max_staleness``: drop (measured best: benchmarks.bench_late), fold (into the
    next mean at its token weight) or decay (the same, its weight halved for every
    round it is late)."""

    @field_validator("grace_s", mode="before")
    @classmethod
    def _grace(cls, value: object) -> object:
        if value is None:  # the earlier spelling of adaptive
            return "adaptive"
        if isinstance(value, str) and value != "adaptive":
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"must be seconds >= 0 or 'adaptive', got {value!r}") from None
        if isinstance(value, int | float) and not value >= 0:  # also rejects NaN
            raise ValueError(f"must be seconds >= 0 or 'adaptive', got {value!r}")
        return value

    @model_validator(mode="after")
    def _check(self) -> MembershipConfig:
        if self.grace_min_s > self.grace_max_s:
            raise ValueError(
                f"grace_min_s must be in [0, grace_max_s = {self.grace_max_s}], "
                f"got {self.grace_min_s}"
            )
        return self


class GuardConfig(_Section):
    """The norm guard: rules a contribution's norm must pass to enter a mean
    (docs/algorithms.md, the norm guard)."""

    ratio: float = Field(default=10.0, ge=0.0)
    """Reject a contribution whose norm exceeds this multiple of the median of recent
    accepted ones, or (three or more in one mean) of the mean's others; 0: every norm
    rule off, else at least 1."""
    warmup: int = Field(default=2, ge=0)
    """Rounds of a fragment before the median rule applies (the rules against the
    fragment's parameters and against the round's others apply from round 0)."""
    params_ratio: float = Field(default=NORM_GUARD_PARAMS, ge=0.0)
    """From round 0, reject a contribution whose norm exceeds this multiple of the
    norm of the fragment's parameters (initial or current canonical, the larger);
    0: off. Honest ones measured far below it."""
    window: int = Field(default=8, ge=1)
    """Recent rounds whose accepted norms the median rule compares with."""

    @model_validator(mode="after")
    def _check(self) -> GuardConfig:
        if 0 < self.ratio < 1.0:  # below 1 it would reject the median itself
            raise ValueError(f"ratio must be 0 (off) or >= 1, got {self.ratio}")
        return self


class LivenessConfig(_Section):
    """How long parties wait for each other and for the store."""

    lease_s: float = Field(default=120.0, gt=0.0)
    """Seconds a member's lease lasts without a renewal (its status); after that the
    aggregator stops expecting it until it returns."""
    stall_after_s: float = Field(default=60.0, gt=0.0)
    """Seconds without an applied round before a stall is reported."""
    outage_s: float = Field(default=900.0, gt=0.0)
    """Seconds a party rides out a store that keeps failing before it gives up."""
    poll_interval_s: float = Field(default=0.05, gt=0.0)
    """First delay between two polls for a mean."""
    poll_max_s: float = Field(default=0.5, gt=0.0)
    """Longest delay between two polls (each poll is one request)."""

    @model_validator(mode="after")
    def _check(self) -> LivenessConfig:
        if self.poll_interval_s > self.poll_max_s:
            raise ValueError(
                f"poll_interval_s must be in (0, poll_max_s = {self.poll_max_s}], "
                f"got {self.poll_interval_s}"
            )
        return self


class SyncConfig(BaseModel):
    """How replicas synchronise: six sections (see the module docstring), every
    dependent default resolved on construction."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    """When fragments are sent and merged."""
    outer: OuterConfig = Field(default_factory=OuterConfig)
    """The outer optimizer."""
    codec: CodecConfig = Field(default_factory=CodecConfig)
    """How outer gradients and means travel."""
    membership: MembershipConfig = Field(default_factory=MembershipConfig)
    """Who a round waits for and what becomes of the late."""
    guard: GuardConfig = Field(default_factory=GuardConfig)
    """The norm guard."""
    liveness: LivenessConfig = Field(default_factory=LivenessConfig)
    """Leases, stalls, outages and polling."""

    _known_fields = names_unknown_fields()

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, data: Any) -> Any:
        """Flat keys of earlier versions, each with a `DeprecatedKey` warning (a stored
        manifest is read through `stored`, which does not warn)."""
        if not isinstance(data, dict):
            return data
        data, notes = nest_flat_keys(data)
        for note in notes:
            warnings.warn(note, DeprecatedKey, stacklevel=2)
        return data

    @classmethod
    def stored(cls, data: dict[str, Any]) -> SyncConfig:
        """The config stored in a run manifest, whatever version wrote it (flat keys
        are an old run's, not a user's to fix: no warning)."""
        with quiet_deprecations():
            return cls(**data)

    @model_validator(mode="after")
    def _resolve(self) -> SyncConfig:
        """Check what spans sections; fill in every default that depends on another
        field, once (a dumped config then says everything in force)."""
        s, o, c = self.schedule, self.outer, self.codec
        CodecSpec(c.up, c.block_size)  # validates block_size
        sparse_up = c.up in SPARSE_CODECS
        if o.step == "average" and o.momentum not in (None, 0.0):
            raise ValueError(
                f"outer.momentum must be 0 or unset with outer.step 'average' (no momentum), "
                f"got {o.momentum}"
            )
        default_lr, default_mu = OUTER_DEFAULTS[s.mode]
        outer = {
            "lr": o.lr if o.lr is not None else 1.0 if o.step == "average" else default_lr,
            "momentum": 0.0 if o.step == "average"
            else o.momentum if o.momentum is not None else default_mu,
        }
        k = c.k if c.k is not None else max(1, round(DEFAULT_SPARSE_K * c.chunk / 4096))
        codec = {
            "k": k,
            "feedback_up": _feedback(c.feedback_up, c.up),
            "feedback_down": _feedback(c.feedback_down, c.down),
            "error_decay": c.error_decay if c.error_decay is not None
            else SPARSE_ERROR_DECAY if sparse_up else 1.0,
            "mean_from": c.mean_from or ("peers" if sparse_up else "aggregator"),
        }
        CodecSpec(c.up, c.block_size, c.chunk, k)  # validates chunk and k
        # new section objects replace the given ones (which may be shared): frozen
        # models are set through object.__setattr__, once, here
        if s.overlap_start is None:  # used by overlap auto only, stored all the same
            object.__setattr__(self, "schedule", s.model_copy(
                update={"overlap_start": max(1, s.sync_every // s.fragments - 1)}))
        if outer != {"lr": o.lr, "momentum": o.momentum}:
            object.__setattr__(self, "outer", o.model_copy(update=outer))
        if any(getattr(c, name) != value for name, value in codec.items()):
            object.__setattr__(self, "codec", c.model_copy(update=codec))
        return self

    def changed(self, **sections: dict[str, Any]) -> SyncConfig:
        """This config with some fields of some sections changed, validated again
        (``cfg.changed(membership={"grace_s": 0.0})``). Defaults resolved from a field
        that changes stay as they were: change the dependent field too."""
        unknown = sorted(set(sections) - set(type(self).model_fields))
        if unknown:
            raise ValueError(unknown_fields_message(unknown, type(self).model_fields))
        tree = self.model_dump()
        for name, fields in sections.items():
            tree[name] = {**tree[name], **fields}
        return type(self)(**tree)

    def model_copy(self, *, update: Any = None, deep: bool = False) -> SyncConfig:
        """A copy; ``update`` may only replace whole sections (pydantic does not
        validate an update, so a flat key would be silently ignored: use `changed`)."""
        unknown = sorted(set(update or {}) - set(type(self).model_fields))
        if unknown:
            raise ValueError(f"model_copy cannot set {', '.join(unknown)}: use "
                             "SyncConfig.changed(section={...})")
        return super().model_copy(update=update, deep=deep)

    def _spec(self, name: str) -> CodecSpec:
        c = self.codec
        return CodecSpec(name, c.block_size, c.chunk, c.k)

    @property
    def up(self) -> CodecSpec:
        """The codec of the outer gradients, with its block size, chunk and k."""
        return self._spec(self.codec.up)

    @property
    def down(self) -> CodecSpec:
        """The codec of the aggregator's mean, with its block size, chunk and k."""
        return self._spec(self.codec.down)


def _feedback(explicit: bool | None, codec: str) -> bool:
    """Error feedback in force for a payload sent with ``codec``."""
    if codec == "none":
        return False
    return explicit if explicit is not None else codec in _LOW_BIT_CODECS
