"""Configuration of the synchronisation between replicas.

One pydantic model holds every knob of docs/algorithms.md (H, P, tau, alpha, the outer
optimizer, the codecs, the aggregator's quorum), validates on construction and says
which field is wrong and what is allowed. The names follow the papers' symbols in
their docstrings so a reader can map them: ``sync_every`` is H, ``fragments`` is P,
``overlap`` is tau.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from diloco.strict import names_unknown_fields
from storage.codecs import CODEC_NAMES, SPARSE_CODECS, CodecSpec

Mode = Literal["diloco", "streaming", "eager"]
EagerRule = Literal["adaptive", "pure"]
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
#: the default norm_guard_params: honest outer gradients of the benchmark runs stayed
#: below half their fragment's initial norm (docs/algorithms.md, the norm guard)
NORM_GUARD_PARAMS = 20.0


class SyncConfig(BaseModel):
    """How replicas synchronise: schedule, outer optimizer, codecs, quorum.

    - ``mode``: ``diloco`` (blocking: send and wait every H steps), ``streaming``
      (P staggered fragments, sent ``overlap`` steps before their merge), ``eager``
      (never wait for this round's mean; ``eager_rule`` picks adaptive or pure).
    - ``sync_every`` (H): inner steps between two syncs of the same fragment.
    - ``fragments`` (P): how many fragments the model is split into.
    - ``overlap`` (tau): steps between a fragment's send and its merge, or ``auto``
      (sized per merge point to the measured latency: `diloco.overlap`).
    - ``alpha``: merge weight of the local side, ``lerp(theta_new, theta_m, alpha)``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = "streaming"
    eager_rule: EagerRule = "adaptive"
    sync_every: int = Field(default=50, description="H: inner steps per round of a fragment")
    fragments: int = Field(default=1, description="P: number of fragments")
    overlap: int | Literal["auto"] = Field(
        default=0, description="tau: steps a fragment is in flight; auto: each worker sizes "
        "it to its measured exchange latency (diloco/overlap.py)"
    )
    overlap_start: int | None = Field(
        default=None, description="overlap auto: tau before any latency is measured, and "
        "of the rounds merging after the run's end (default H/P - 1: the first merges "
        "do not wait either)"
    )
    overlap_margin: float = Field(
        default=0.25, description="overlap auto: tau covers most recent latencies (their "
        "75th percentile) plus this fraction of it"
    )
    alpha: float = Field(default=0.5, description="merge weight of the local side")
    pattern: Pattern = "strided"
    separate_rest: bool = Field(
        default=False,
        description="parameters outside the repeated blocks form a fragment of their own",
    )
    outer_lr: float | None = Field(default=None, description="eta_out; default per mode")
    outer_momentum: float | None = Field(default=None, description="mu; default per mode")
    codec_up: str = "none"
    codec_down: str = "none"
    block_size: int = 128
    error_feedback: bool | None = Field(
        default=None, description="default: on for 4-bit codecs and below"
    )
    error_decay: float | None = Field(
        default=None, description="beta: the error-feedback accumulator is multiplied by it "
        "before the next outer gradient is added; default 0.95 for the sparse codecs "
        "(SparseLoCo), 1 otherwise"
    )
    sparse_chunk: int = Field(
        default=4096, description="C: values per chunk of the sparse codecs (top-k per chunk)"
    )
    sparse_k: int | None = Field(
        default=None, description="k: values a chunk sends (default 64 per 4096, or from "
        "sparse_density)"
    )
    sparse_density: float | None = Field(
        default=None, description="k / C as a fraction, instead of sparse_k"
    )
    outer_step: OuterStep = Field(
        default="nesterov", description="nesterov: SGD with Nesterov momentum; average: "
        "theta -= outer_lr * mean, no momentum (SparseLoCo; outer_lr default 1)"
    )
    mean_from: MeanFrom | None = Field(
        default=None, description="aggregator: workers read the mean it publishes "
        "(codec_down); peers: the aggregator commits only the weights and each worker "
        "averages the contributions it names itself (no second rounding, M - 1 reads); "
        "default: peers for a sparse codec_up, else aggregator"
    )
    outer_device: OuterDevice = Field(
        default="cpu", description="where a worker keeps its float32 outer state (outer "
        "parameters and momentum): cpu (beside the aggregator's, bit for bit), or device: "
        "on the device of the model it syncs (a GPU: no host copy of the live fragment; "
        "deltas and means cross through pinned memory without blocking)"
    )
    split_tensors: bool = Field(
        default=True, description="fragments may cut a tensor, so each holds 1/P of the "
        "parameters to within one block"
    )
    quorum: float = Field(
        default=0.5,
        description="share of the expected members a round needs before it may go on without "
        "the rest (at least min_quorum)",
    )
    deadline_s: float = Field(
        default=600.0,
        description="longest wait for the rest, from a round's first contribution, once a "
        "quorum is in (the grace window is usually shorter)",
    )
    absent_deadline_s: float = Field(
        default=30.0,
        description="seconds the aggregator waits for a worker that missed an earlier deadline",
    )
    min_quorum: int = Field(
        default=1, description="members a round needs at least before it may go on without "
        "the rest"
    )
    grace_s: float | None = Field(
        default=None,
        description="seconds the aggregator waits for the rest once a quorum is in; "
        "None: adaptive (from the arrival spread of recent rounds, within "
        "grace_min_s..grace_max_s)",
    )
    grace_min_s: float = Field(default=0.5, description="shortest adaptive grace window")
    grace_max_s: float = Field(default=60.0, description="longest adaptive grace window")
    max_staleness: int = Field(
        default=2,
        description="rounds a late contribution may be behind and still be applied (in the "
        "next mean of its fragment); a worker further behind heals to the canonical state",
    )
    late: Late = Field(
        default="drop", description="what becomes of a contribution that missed its round "
        "and arrives within max_staleness: drop (measured best: benchmarks.bench_late), "
        "fold (into the next mean at its token weight) or decay (the same, its weight "
        "halved for every round it is late)"
    )
    lease_s: float = Field(
        default=120.0,
        description="seconds a member's lease lasts without a renewal (its status); after "
        "that the aggregator stops expecting it until it returns",
    )
    stall_after_s: float = Field(
        default=60.0, description="seconds without an applied round before a stall is reported"
    )
    outage_s: float = Field(
        default=900.0,
        description="seconds a party rides out a store that keeps failing before it gives up",
    )
    norm_guard: float = Field(
        default=10.0,
        description="reject a contribution whose norm exceeds this multiple of the median "
        "of recent accepted ones, or (three or more in one mean) of the mean's others "
        "(0: every norm rule off)",
    )
    norm_guard_warmup: int = Field(
        default=2, description="rounds of a fragment before the norm guard's median rule "
        "applies (the rules against the fragment's parameters and against the round's "
        "other contributions apply from round 0)"
    )
    norm_guard_params: float = Field(
        default=NORM_GUARD_PARAMS, description="from round 0, reject a contribution whose "
        "norm exceeds this multiple of the norm of the fragment's parameters (initial or "
        "current canonical, the larger; 0: off); honest ones measured far below it "
        "(docs/algorithms.md, the norm guard)"
    )
    norm_guard_window: int = Field(
        default=8, description="recent rounds whose accepted norms the guard compares with"
    )
    poll_interval_s: float = Field(default=0.05, description="first poll delay for a mean")
    poll_max_s: float = Field(
        default=0.5, description="longest delay between two polls (each poll is one request)"
    )

    _known_fields = names_unknown_fields()

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

    def _check_overlap(self) -> None:
        """``overlap: auto`` needs a send before the merge and a start within H/P."""
        if not self.auto_overlap:
            return
        if self.mode != "streaming":  # blocking and pure eager send at the merge; the
            # other eager rules merge before the mean arrives, which the workers'
            # agreement on tau needs (diloco/overlap.py)
            raise ValueError(f"overlap 'auto' needs mode streaming, got mode {self.mode!r}")
        if self.overlap_start is not None and self.overlap_start < 1:
            raise ValueError(f"overlap_start must be >= 1, got {self.overlap_start}")
        if not self.overlap_margin >= 0:  # also rejects NaN
            raise ValueError(f"overlap_margin must be >= 0, got {self.overlap_margin}")

    @model_validator(mode="after")
    def _check(self) -> SyncConfig:
        h, p = self.sync_every, self.fragments
        self._check_overlap()
        if h < 1:
            raise ValueError(f"sync_every (H) must be >= 1, got {h}")
        if p < 1:
            raise ValueError(f"fragments (P) must be >= 1, got {p}")
        if p > h:
            raise ValueError(f"fragments (P) must be <= sync_every (H) = {h}, got {p}")
        if h % p:
            raise ValueError(
                f"sync_every (H) must be divisible by fragments (P): H = {h}, P = {p}"
            )
        tau = self.send_offset if self.auto_overlap else self.overlap
        if not 0 <= tau < h // p:
            field = "overlap_start" if self.auto_overlap else "overlap (tau)"
            low = 1 if self.auto_overlap else 0
            raise ValueError(f"{field} must satisfy {low} <= tau < H/P = {h // p}, got {tau}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.mode == "diloco" and tau != 0:
            raise ValueError(f"overlap (tau) must be 0 in mode 'diloco' (blocking), got {tau}")
        for field in ("codec_up", "codec_down"):
            value = getattr(self, field)
            if value not in CODEC_NAMES:
                raise ValueError(
                    f"{field} must be one of {', '.join(CODEC_NAMES)}; got {value!r}"
                )
        if self.outer_lr is not None and not self.outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if self.outer_momentum is not None and not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if not 0.0 < self.quorum <= 1.0:
            raise ValueError(f"quorum must be in (0, 1], got {self.quorum}")
        for name in ("deadline_s", "absent_deadline_s", "norm_guard", "norm_guard_params"):
            if not getattr(self, name) >= 0:  # also rejects NaN
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.min_quorum < 1:
            raise ValueError(f"min_quorum must be >= 1, got {self.min_quorum}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.grace_s is not None and not self.grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0 or null (adaptive), got {self.grace_s}")
        if not 0 <= self.grace_min_s <= self.grace_max_s:
            raise ValueError(
                f"grace_min_s must be in [0, grace_max_s = {self.grace_max_s}], "
                f"got {self.grace_min_s}"
            )
        for name in ("stall_after_s", "outage_s", "lease_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if 0 < self.norm_guard < 1.0:  # below 1 it would reject the median itself
            raise ValueError(f"norm_guard must be 0 (off) or >= 1, got {self.norm_guard}")
        if self.norm_guard_warmup < 0:
            raise ValueError(f"norm_guard_warmup must be >= 0, got {self.norm_guard_warmup}")
        if self.norm_guard_window < 1:
            raise ValueError(f"norm_guard_window must be >= 1, got {self.norm_guard_window}")
        if not 0 < self.poll_interval_s <= self.poll_max_s:
            raise ValueError(
                f"poll_interval_s must be in (0, poll_max_s = {self.poll_max_s}], "
                f"got {self.poll_interval_s}"
            )
        CodecSpec(self.codec_up, self.block_size)  # validates block_size
        if self.error_decay is not None and not 0.0 < self.error_decay <= 1.0:
            raise ValueError(f"error_decay must be in (0, 1], got {self.error_decay}")
        if self.sparse_k is not None and self.sparse_density is not None:
            raise ValueError("sparse_k and sparse_density: give one of them, not both")
        if self.sparse_density is not None and not 0.0 < self.sparse_density <= 1.0:
            raise ValueError(f"sparse_density must be in (0, 1], got {self.sparse_density}")
        self.up  # validates sparse_chunk and sparse_k  # noqa: B018
        if self.outer_step == "average" and self.outer_momentum not in (None, 0.0):
            raise ValueError(
                f"outer_momentum must be 0 or unset with outer_step 'average' (no momentum), "
                f"got {self.outer_momentum}"
            )
        return self

    @property
    def eta(self) -> float:
        """The outer learning rate in force (explicit, or the mode's default; 1 for
        the averaged step, which then sets theta to the mean of the replicas)."""
        if self.outer_lr is not None:
            return self.outer_lr
        return 1.0 if self.outer_step == "average" else OUTER_DEFAULTS[self.mode][0]

    @property
    def mu(self) -> float:
        """The outer momentum in force (explicit, or the mode's default; 0 for the
        averaged step)."""
        if self.outer_step == "average":
            return 0.0
        if self.outer_momentum is not None:
            return self.outer_momentum
        return OUTER_DEFAULTS[self.mode][1]

    @property
    def k(self) -> int:
        """Values each chunk of a sparse codec sends (sparse_k, or from sparse_density)."""
        if self.sparse_k is not None:
            return self.sparse_k
        if self.sparse_density is not None:
            return max(1, min(self.sparse_chunk, round(self.sparse_density * self.sparse_chunk)))
        return max(1, round(DEFAULT_SPARSE_K * self.sparse_chunk / 4096))

    def _spec(self, name: str) -> CodecSpec:
        return CodecSpec(name, self.block_size, self.sparse_chunk, self.k)

    @property
    def up(self) -> CodecSpec:
        return self._spec(self.codec_up)

    @property
    def down(self) -> CodecSpec:
        return self._spec(self.codec_down)

    @property
    def way_down(self) -> MeanFrom:
        """``mean_from`` in force: as set, else peers for the sparse codecs (M - 1
        sparse payloads are smaller than one dense mean up to about M = 35, and
        carry no second rounding), the aggregator's mean otherwise."""
        if self.mean_from is not None:
            return self.mean_from
        return "peers" if self.codec_up in SPARSE_CODECS else "aggregator"

    @property
    def beta(self) -> float:
        """The error-feedback decay in force (explicit; 0.95 for sparse up, else 1)."""
        if self.error_decay is not None:
            return self.error_decay
        return SPARSE_ERROR_DECAY if self.codec_up in SPARSE_CODECS else 1.0

    def feedback(self, codec: str) -> bool:
        """Whether error feedback is on for a payload sent with ``codec``."""
        if self.error_feedback is not None:
            return self.error_feedback and codec != "none"
        return codec in _LOW_BIT_CODECS

    @property
    def auto_overlap(self) -> bool:
        """``overlap: auto``: each worker decides tau per merge point (`diloco.overlap`)."""
        return self.overlap == "auto"

    @property
    def send_offset(self) -> int:
        """Steps between a fragment's send and its merge (pure eager sends at the merge).
        With ``overlap: auto`` the reference tau: ``overlap_start`` (by default
        H/P - 1), which fixes the round counts (the workers' decisions keep it past
        the run's end)."""
        if self.mode == "eager" and self.eager_rule == "pure":
            return 0
        if self.auto_overlap:
            if self.overlap_start is None:
                return max(1, self.sync_every // self.fragments - 1)
            return self.overlap_start
        return int(self.overlap)

    @property
    def merge_alpha(self) -> float:
        """The alpha the merge really uses: blocking DiLoCo and pure eager set the live
        fragment to the new outer value (alpha 0)."""
        if self.mode == "diloco" or (self.mode == "eager" and self.eager_rule == "pure"):
            return 0.0
        return self.alpha
