"""The model's shape (`ModelConfig`) and its named sizes (`PRESETS`), without torch.

Reading a config, checking it and counting its parameters needs no torch, and
every command that only reads a run (``diloco status``, ``cancel``, ``gc``) imports
this module: kept apart from workers/model.py, which builds the model, those
commands start in a third of the CPU time.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from diloco.strict import names_unknown_fields

#: RoPE scaling types (Hugging Face ``rope_type``) and the keys each requires.
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}


def rope_type(scaling: dict[str, Any]) -> str:
    """The scaling's type (``rope_type``, or the legacy ``type``), checked: its keys,
    and that each of its parameters is a number."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling.rope_type = {kind!r} is not supported; allowed: {', '.join(ROPE_TYPES)}"
        )
    allowed = {"rope_type", "type", *ROPE_TYPES[kind]}
    unknown = sorted(set(scaling) - allowed)
    missing = [k for k in ROPE_TYPES[kind] if k not in scaling]
    if unknown or missing:
        takes = ", ".join(ROPE_TYPES[kind]) or "no parameters"
        wrong = f"unknown: {', '.join(unknown)}" if unknown else f"missing: {', '.join(missing)}"
        raise ValueError(f"rope_scaling of rope_type {kind!r} takes {takes}; {wrong}")
    for key in ROPE_TYPES[kind]:
        float(scaling[key])  # as workers.model.rope_inv_freq reads them
    return kind


class ModelConfig(BaseModel):
    """Shape of the model. The defaults are the ``tiny`` preset.

    - ``n_kv_heads``: key/value heads; fewer than ``n_heads`` is grouped-query
      attention (each kv head serves ``n_heads / n_kv_heads`` query heads).
    - ``mlp_hidden``: SwiGLU hidden size; default 8/3 * d_model rounded up to a
      multiple of ``mlp_multiple_of``.
    - ``z_loss``: weight of ``mean(logsumexp(logits)^2)`` added to the loss.
    - ``init_std``: std of every linear and embedding weight at init; the attention
      and MLP output projections get ``init_std / sqrt(2 * n_layers)``.
    - ``qkv_bias`` / ``out_bias`` / ``mlp_bias``: biases (zero at init) on the q, k, v
      projections (Qwen2), the attention output (Llama ``attention_bias`` sets both)
      and the three MLP projections (Llama ``mlp_bias``): Hugging Face models have them.
    - ``head_size``: an explicit head dim, for models whose ``head_dim`` is not
      ``d_model / n_heads``; unset, it is that quotient.
    - ``rope_scaling``: Hugging Face RoPE scaling, ``rope_type`` one of
      ``ROPE_TYPES``, so a pretrained long-context model keeps its positions.
    - ``sliding_window``: kept so an exported Mistral config says it; training is
      full causal attention, which equals sliding attention up to that length.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    mlp_hidden: int | None = None
    mlp_multiple_of: int = 64
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    z_loss: float = 0.0
    init_std: float = 0.02
    dropout: float = 0.0
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    head_size: int | None = None
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None

    _known_fields = names_unknown_fields()

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        sizes = ("vocab_size", "d_model", "n_layers", "n_heads", "mlp_multiple_of", "max_seq_len")
        for field in sizes:
            value = getattr(self, field)
            if value < 1:
                raise ValueError(f"{field} must be >= 1, got {value}")
        for field in ("n_kv_heads", "mlp_hidden", "head_size", "sliding_window"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ValueError(f"{field} must be >= 1 or unset, got {value}")
        if self.head_size is None and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model must be divisible by n_heads: d_model = {self.d_model}, "
                f"n_heads = {self.n_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head dim (head_size, or d_model / n_heads) must be even for RoPE, got {self.head_dim}"
            )
        if self.rope_scaling is not None:
            rope_type(self.rope_scaling)
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_kv_heads must divide n_heads = {self.n_heads}, got {self.kv_heads}"
            )
        for field in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, field)
            if not value > 0:  # also rejects NaN
                raise ValueError(f"{field} must be > 0, got {value}")
        if not self.z_loss >= 0:
            raise ValueError(f"z_loss must be >= 0, got {self.z_loss}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        return self

    @property
    def head_dim(self) -> int:
        """``head_size`` when set, else ``d_model / n_heads``."""
        return self.head_size if self.head_size is not None else self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads in force (``n_kv_heads``, or ``n_heads`` when unset)."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def mlp_dim(self) -> int:
        """SwiGLU hidden size in force."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        m = self.mlp_multiple_of
        return -(-(8 * self.d_model) // (3 * m)) * m  # ceil(8/3 * d / m) * m

    def num_parameters(self) -> int:
        """Parameter count of ``Transformer(self)``, tied embeddings counted once."""
        d, kv, q = self.d_model, self.kv_heads * self.head_dim, self.n_heads * self.head_dim
        attention = d * q + 2 * d * kv + q * d  # wq, wk, wv, wo
        attention += (q + 2 * kv) * self.qkv_bias + d * self.out_bias
        mlp = 3 * d * self.mlp_dim + (2 * self.mlp_dim + d) * self.mlp_bias  # w1, w2, w3
        block = attention + mlp + 2 * d  # + two RMSNorm weights
        embed = self.vocab_size * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return embed + self.n_layers * block + d + head  # + final norm


# Exact counts (ModelConfig.num_parameters), pinned in tests/test_model.py.
PRESETS: dict[str, ModelConfig] = {
    # 3,279,104: 4 x 256, MLP 704; a few minutes of training on 2 CPU cores.
    "tiny": ModelConfig(),
    # 21,341,568: 12 x 384, 6 heads of 64, MLP 1024.
    "small": ModelConfig(d_model=384, n_layers=12, n_heads=6, max_seq_len=512),
    # 152,006,400: 18 x 768, 12 heads of 64, MLP 2048, 32k vocab.
    "gpu-150m": ModelConfig(
        vocab_size=32000, d_model=768, n_layers=18, n_heads=12, max_seq_len=1024
    ),
    # 1,040,279,552: 22 x 2048, 16 heads of 128 with 4 kv heads (GQA), MLP 5504.
    "gpu-1b": ModelConfig(
        vocab_size=32000, d_model=2048, n_layers=22, n_heads=16, n_kv_heads=4,
        max_seq_len=2048,
    ),
}
