"""Hugging Face ``config.json`` of a Llama-family causal LM <-> our ``ModelConfig``.

We keep our own model class (``workers.model.Transformer``) and translate: a user
brings the config.json of a Llama, Mistral or Qwen2 model and trains our class with
the same shapes; the export writes a config.json that ``transformers`` loads into
the matching class. Building the transformers classes at run time would add
transformers' import time and memory to every worker process for the same speed per
step (measured by benchmarks/bench_model.py: docs/own-model.md, "The model"), so
transformers is only a test dependency and nothing here imports it.

Every key of the file is classified: mapped to a ModelConfig field, checked to be
a value we honour (``hidden_act`` silu, ``pretraining_tp`` 1, ...), or harmless
metadata; any other key is refused with one line naming it, since a field we
silently dropped would train a different model than the user's.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import ValidationError

from workers.model_config import ROPE_TYPES, ModelConfig

#: model_type -> the architecture class name transformers registers for it.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

#: Keys that do not change the network: naming, tokens, generation defaults,
#: output flags and the like (what LlamaConfig/MistralConfig/Qwen2Config.to_dict()
#: emit, plus the generation keys older versions wrote; the transformers version
#: they were read from: docs/design.md, "Facts about the libraries").
IGNORED = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "_name_or_path", "_attn_implementation_autoset",
    "output_attentions", "output_hidden_states", "return_dict",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "id2label",
    "label2id", "num_labels", "problem_type", "tokenizer_class", "prefix",
    "finetuning_task", "task_specific_params", "torchscript", "use_bfloat16",
    "tf_legacy_loss", "add_cross_attention", "cross_attention_hidden_size",
    "tie_encoder_decoder", "max_length", "min_length", "do_sample", "early_stopping",
    "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k",
    "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate",
    "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "max_window_layers",
})

#: HF key -> ModelConfig field, copied as they are.
DIRECT = {
    "vocab_size": "vocab_size",
    "hidden_size": "d_model",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "intermediate_size": "mlp_hidden",
    "max_position_embeddings": "max_seq_len",
    "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_embeddings",
    "attention_dropout": "dropout",
    "initializer_range": "init_std",
}

#: Keys read by the special cases of ``from_hf_config``.
SPECIAL = frozenset({
    "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias",
    "head_dim", "sliding_window", "use_sliding_window", "layer_types", "hidden_act",
    "pretraining_tp",
})

#: Defaults of the transformers config classes for keys a file may leave out.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "intermediate_size": 11008,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_dropout": 0.0, "initializer_range": 0.02,
}


class _Refused(ValueError):
    """One field we cannot honour (caught and prefixed with the source)."""

    def __init__(self, field: str, value: Any, allowed: str):
        super().__init__(f"field {field!r} = {value!r} is not supported ({allowed})")


def _model_type(d: dict[str, Any]) -> str:
    kind = d.get("model_type")
    if kind is None:
        by_arch = {arch: t for t, arch in ARCHITECTURES.items()}
        known = [by_arch[a] for a in d.get("architectures") or [] if a in by_arch]
        kind = known[0] if known else None
    if kind not in ARCHITECTURES:
        allowed = f"allowed: {', '.join(ARCHITECTURES)}"
        raise _Refused("model_type", kind, allowed)
    return kind


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the legacy keys or transformers 5's
    ``rope_parameters`` dict (which holds rope_theta and the scaling together)."""
    params = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling")
    key = "rope_scaling" if legacy is not None else "rope_parameters"  # as transformers 5
    scaling = dict(legacy if legacy is not None else params)
    theta = float(scaling.pop("rope_theta", params.get("rope_theta", d.get("rope_theta", 1e4))))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise _Refused(f"{key}.rope_type", kind, f"allowed: {', '.join(ROPE_TYPES)}")
    if kind == "default" and set(scaling) <= {"rope_type", "type"}:
        return theta, None
    return theta, scaling


def _sliding_window(d: dict[str, Any], kind: str) -> int | None:
    """Mistral's window; Qwen2's only when ``use_sliding_window`` is true."""
    types = d.get("layer_types")
    if types is not None and not set(types) <= {"full_attention", "sliding_attention"}:
        bad = sorted(set(types) - {"full_attention", "sliding_attention"})
        raise _Refused("layer_types", bad[0], "allowed: full_attention, sliding_attention")
    if kind == "qwen2" and not d.get("use_sliding_window", False):
        return None
    return d.get("sliding_window")


def _fields(d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields from the HF dict; raises _Refused on the first bad key."""
    kind = _model_type(d)
    for key in d:
        if key not in IGNORED and key not in DIRECT and key not in SPECIAL:
            raise _Refused(key, d[key], "not a Llama/Mistral/Qwen2 field this trainer knows")
    if d.get("hidden_act", "silu") != "silu":
        raise _Refused("hidden_act", d["hidden_act"], "allowed: silu")
    if d.get("pretraining_tp", 1) != 1:
        raise _Refused("pretraining_tp", d["pretraining_tp"], "allowed: 1")
    if kind != "llama" and (d.get("attention_bias") or d.get("mlp_bias")):
        key = "attention_bias" if d.get("attention_bias") else "mlp_bias"
        raise _Refused(key, True, f"not part of model_type {kind}")
    merged = {**HF_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    out = {field: merged[key] for key, field in DIRECT.items() if key in merged}
    out["rope_theta"], out["rope_scaling"] = _rope(d)
    attention_bias = bool(d.get("attention_bias", False))
    out["qkv_bias"] = attention_bias or kind == "qwen2"
    out["out_bias"] = attention_bias
    out["mlp_bias"] = bool(d.get("mlp_bias", False))
    head_dim = d.get("head_dim")
    if head_dim is not None and head_dim * out["n_heads"] != out["d_model"]:
        out["head_size"] = head_dim
    out["sliding_window"] = _sliding_window(d, kind)
    return out


def from_hf_config(d: dict[str, Any], *, source: str) -> ModelConfig:
    """Our ModelConfig for the Hugging Face config dict ``d`` read from ``source``.

    Raises ValueError with one line ``model.hf_config <source>: field 'X' = V is not
    supported (...)`` for a field or value this trainer cannot reproduce.
    """
    if not isinstance(d, dict):
        raise ValueError(f"model.hf_config {source}: expected a JSON object, got {type(d).__name__}")
    try:
        return ModelConfig(**_fields(d))
    except _Refused as exc:
        raise ValueError(f"model.hf_config {source}: {exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        raise ValueError(f"model.hf_config {source}: {where + ': ' if where else ''}{msg}") from None


def _base_kind(cfg: ModelConfig, base: dict[str, Any] | None) -> str:
    """The model_type to export: the base's, or the simplest that has cfg's biases."""
    if base is not None:
        return _model_type(base)
    if cfg.qkv_bias and not cfg.out_bias and not cfg.mlp_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window is not None else "llama"


def _check_expressible(cfg: ModelConfig, kind: str) -> None:
    """Refuse a config the chosen transformers class cannot hold (biases differ)."""
    if kind == "llama":
        ok = cfg.qkv_bias == cfg.out_bias
    elif kind == "qwen2":
        ok = cfg.qkv_bias and not cfg.out_bias and not cfg.mlp_bias
    else:
        ok = not (cfg.qkv_bias or cfg.out_bias or cfg.mlp_bias)
    if not ok:
        raise ValueError(
            f"cannot export to model_type {kind}: biases qkv={cfg.qkv_bias}, "
            f"out={cfg.out_bias}, mlp={cfg.mlp_bias} are not a combination it has"
        )


def _rope_out(cfg: ModelConfig, base: dict[str, Any] | None) -> dict[str, Any]:
    """RoPE keys in the base's form (legacy rope_theta/rope_scaling or
    rope_parameters); without a base, transformers 5's rope_parameters."""
    if base is not None and "rope_parameters" not in base:
        return {"rope_theta": cfg.rope_theta, "rope_scaling": copy.deepcopy(cfg.rope_scaling)}
    params = {"rope_type": "default"} if cfg.rope_scaling is None else copy.deepcopy(
        cfg.rope_scaling)
    params.setdefault("rope_type", params.pop("type", "default"))
    return {"rope_parameters": {"rope_theta": cfg.rope_theta, **params}}


def to_hf_config(cfg: ModelConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of ``cfg`` for transformers' AutoModelForCausalLM.

    With ``base`` (the user's original HF config) its model_type, architectures and
    metadata (token ids, ...) are kept and the shape fields come from ``cfg``
    (overrides may have changed them); without it, a LlamaConfig (Qwen2 when the
    biases are Qwen2's, Mistral with a sliding window).
    """
    kind = _base_kind(cfg, base)
    _check_expressible(cfg, kind)
    out: dict[str, Any] = {k: v for k, v in (base or {}).items()
                           if k in IGNORED or k in ("use_sliding_window",)}
    if kind != "qwen2":
        out.pop("max_window_layers", None)
    out.update({
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "initializer_range": cfg.init_std,
        "attention_dropout": cfg.dropout, **_rope_out(cfg, base),
    })
    if kind == "llama":
        out.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias, pretraining_tp=1)
    if kind == "mistral":
        out["sliding_window"] = cfg.sliding_window
    if kind == "qwen2":
        out["use_sliding_window"] = cfg.sliding_window is not None
        out["sliding_window"] = cfg.sliding_window
    for key in ("torch_dtype", "dtype"):
        if key in out or (base is None and key == "torch_dtype"):
            out[key] = "float32"  # what the export writes
    if base is None:
        out.update(bos_token_id=None, eos_token_id=None)
    return out
