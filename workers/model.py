"""A Llama-style decoder-only language model in plain torch.

Read top to bottom: one small class per component (``RMSNorm``,
``Rotary``, ``Attention``, ``MLP``, ``Block``), then ``Transformer``, which is
token embedding -> ``layers`` (the repeated blocks) -> final norm -> output head.

``Transformer.layers`` is the first ``nn.ModuleList`` in module order on purpose:
``diloco.fragments.find_blocks`` takes it as the repeated blocks that the
synchroniser splits into fragments.

Its config and sizes live in workers/model_config.py (``ModelConfig``, ``PRESETS``);
``build_model(config, seed)`` gives bit-identical parameters for the same seed
without touching the caller's random state.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.model_config import ModelConfig, rope_type


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back to x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Float64 inverse frequencies of the half-split pairs, after ``scaling``.

    "linear" divides them by ``factor`` (positions / factor); "llama3" is Llama 3.1's
    rescaling: long wavelengths / factor, short ones kept, a smooth blend between,
    the same formula as transformers' ``_compute_llama3_parameters``.
    """
    # on the CPU explicitly: a model built under `with torch.device("meta")` (to count
    # its parameters) still gets real tables
    steps = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu")
    inv_freq = theta ** (-steps / head_dim)
    kind = "default" if scaling is None else rope_type(scaling)
    if kind == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """Rotary position embedding (RoPE), real-valued, half-split pairs.

    Channel i of the first half and channel i of the second half form one pair,
    rotated by angle ``pos * inv_freq[i]``, ``inv_freq[i] = theta^(-2i / head_dim)``
    unless ``scaling`` changes it. After rotation q.k depends on the positions only
    through their difference. The cos/sin tables are buffers (not saved in state
    dicts) built for at most ``EAGER_LEN`` positions and extended when a longer
    sequence comes (Llama 3 allows 131072 positions; a table that long is 64 MB per
    head dim of 128 that a 2k-token run never reads). The rotation runs in float32,
    so it works under bf16 autocast and on every device.
    """

    EAGER_LEN = 4096

    def __init__(self, head_dim: int, max_seq_len: int, theta: float,
                 scaling: dict[str, Any] | None = None):
        super().__init__()
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self._build(min(max_seq_len, self.EAGER_LEN), torch.device("cpu"))

    def _build(self, length: int, device: torch.device) -> None:
        angles = torch.outer(torch.arange(length, dtype=torch.float64, device="cpu"),
                             self.inv_freq)
        self.cos = angles.cos().float().to(device)
        self.sin = angles.sin().float().to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [B, H, T, head_dim], position t at index t."""
        T = x.size(-2)
        if self.cos.size(0) < T:
            self._build(T, self.cos.device)
        cos, sin = self.cos[:T].float(), self.sin[:T].float()
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return rotated.to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE and grouped-query heads."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, hd = config.d_model, config.head_dim
        self.n_heads, self.kv_heads, self.head_dim = config.n_heads, config.kv_heads, hd
        qkv = config.qkv_bias
        self.wq = nn.Linear(d, config.n_heads * hd, bias=qkv)
        self.wk = nn.Linear(d, config.kv_heads * hd, bias=qkv)
        self.wv = nn.Linear(d, config.kv_heads * hd, bias=qkv)
        self.wo = nn.Linear(config.n_heads * hd, d, bias=config.out_bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q), rope(k)
        if self.kv_heads != self.n_heads:  # GQA: each kv head serves a group of q heads
            k = k.repeat_interleave(self.n_heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.n_heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.resid_dropout(self.wo(y))


class MLP(nn.Module):
    """SwiGLU feed-forward: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, h, bias = config.d_model, config.mlp_dim, config.mlp_bias
        self.w1 = nn.Linear(d, h, bias=bias)
        self.w2 = nn.Linear(h, d, bias=bias)
        self.w3 = nn.Linear(d, h, bias=bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        x = x + self.mlp(self.mlp_norm(x))
        return x


class Transformer(nn.Module):
    """Token embedding -> ``layers`` (Blocks) -> final RMSNorm -> output head.

    With ``tie_embeddings`` there is no ``head`` (it is ``None``) and the logits are
    ``norm(x) @ embed.weight.T``. Initialisation draws from torch's global RNG, so it
    is deterministic given ``torch.manual_seed``; ``build_model`` does that for you.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.head = (
            None
            if config.tie_embeddings
            else nn.Linear(config.d_model, config.vocab_size, bias=False)
        )
        self.rope = Rotary(config.head_dim, config.max_seq_len, config.rope_theta,
                           config.rope_scaling)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, init_std) weights, zero biases; output projections scaled by
        1/sqrt(2 n_layers)."""
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        for layer in self.layers:
            for proj in (layer.attn.wo, layer.mlp.w2):
                nn.init.normal_(proj.weight, mean=0.0, std=std / math.sqrt(2 * len(self.layers)))

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits float32 [B, T, vocab] and, with ``targets``, the mean token
        cross-entropy (+ ``z_loss * mean(logsumexp(logits)^2)``), else ``None``."""
        seq_len = tokens.size(1)
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"sequence length T = {seq_len} exceeds the model's max_seq_len = "
                f"{self.config.max_seq_len}"
            )
        window = self.config.sliding_window
        if window is not None and seq_len > window:
            raise ValueError(
                f"sequence length T = {seq_len} exceeds the model's sliding_window = {window}: "
                "only full causal attention is implemented, which equals sliding-window "
                "attention up to that length; use data.seq_len <= sliding_window"
            )
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.rope)
        x = self.norm(x)
        head = self.embed.weight if self.head is None else self.head.weight
        logits = F.linear(x, head).float()
        if targets is None:
            return logits, None
        flat = logits.view(-1, logits.size(-1))
        loss = F.cross_entropy(flat, targets.reshape(-1))
        if self.config.z_loss > 0:
            loss = loss + self.config.z_loss * torch.logsumexp(flat, dim=-1).pow(2).mean()
        return logits, loss


def build_model(config: ModelConfig, seed: int = 0) -> Transformer:
    """A ``Transformer`` on the CPU, initialised from ``seed``.

    The same seed gives bit-identical parameters; the caller's CPU RNG state is
    saved and restored, so building a model never shifts other random streams.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Transformer(config)


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def describe(model: Transformer) -> str:
    """One line: e.g. ``3.28M params, 4 layers, d_model 256, 4 heads, vocab 256, tied``."""
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    heads = f"{c.n_heads} heads" + (f" ({c.kv_heads} kv)" if c.kv_heads != c.n_heads else "")
    tied = "tied embeddings" if c.tie_embeddings else "untied embeddings"
    return (
        f"{_human(n)} params, {c.n_layers} layers, d_model {c.d_model}, {heads}, "
        f"vocab {c.vocab_size}, {tied}"
    )


