"""Hugging Face configs and weights: a user's Llama/Mistral/Qwen2 model trains in our
class and comes back out loadable by transformers, with the same logits.

No hub: every config is built here, tiny; transformers is a test dependency only.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from workers.hf import (  # noqa: E402
    from_hf_config,
    load_hf_state_dict,
    read_safetensors,
    to_hf_config,
    to_hf_state_dict,
    write_hf_model,
)
from workers.model import build_model  # noqa: E402
from workers.model_config import ModelConfig  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
            rms_norm_eps=1e-6)

CASES = {
    "llama-tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "llama-untied": (transformers.LlamaConfig, dict(tie_word_embeddings=False)),
    "mistral-gqa": (transformers.MistralConfig,
                    dict(num_key_value_heads=2, sliding_window=64, rope_theta=5000.0)),
    "qwen2-bias": (transformers.Qwen2Config, dict(num_key_value_heads=2)),
    "llama-bias-headdim": (transformers.LlamaConfig,
                           dict(attention_bias=True, mlp_bias=True, head_dim=12)),
    "llama3-rope": (transformers.LlamaConfig, dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        rope_theta=500000.0)),
    "llama-linear-rope": (transformers.LlamaConfig,
                          dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
}


def hf_model(case: str, seed: int = 0):
    cls, extra = CASES[case]
    config = cls(**{**TINY, **extra}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # transformers zeroes biases at init: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def batch(vocab: int, T: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", list(CASES))
def test_hf_checkpoint_trains_in_our_class_with_the_same_logits(case, tmp_path):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    ours = build_model(from_hf_config(d, source="config.json"))
    load_hf_state_dict(ours, read_safetensors(str(tmp_path)), source=str(tmp_path))
    tokens = batch(ours.config.vocab_size)
    with torch.no_grad():
        expected = hf(tokens).logits
        got, _ = ours.eval()(tokens)
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("case", ["llama-tied", "qwen2-bias", "llama-bias-headdim",
                                  "llama3-rope", "mistral-gqa"])
@pytest.mark.parametrize("with_base", [True, False])
def test_our_model_exports_to_transformers_with_the_same_logits(case, with_base, tmp_path):
    hf = hf_model(case, seed=4)
    base = hf.config.to_dict()
    ours = build_model(from_hf_config(base, source="base"), seed=7)
    with torch.no_grad():  # non-zero biases, so a dropped bias shows in the logits
        for name, p in ours.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path / "export"
    files = write_hf_model(ours, out, base_config=base if with_base else None,
                           extra_files={"tokenizer.json": b"{}"})
    assert {"config.json", "generation_config.json", "model.safetensors",
            "tokenizer.json"} <= set(files)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = batch(ours.config.vocab_size)
    with torch.no_grad():
        expected, _ = ours.eval()(tokens)
        got = loaded(tokens).logits
    assert (got - expected).abs().max().item() < 1e-4
    assert from_hf_config(json.loads((out / "config.json").read_text()),
                          source="export") == ours.config


@pytest.mark.parametrize("legacy", [True, False])
def test_exported_config_loads_in_both_rope_forms(legacy):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, rope_theta=1234.0,
                      rope_scaling={"rope_type": "linear", "factor": 3.0})
    base = {"model_type": "llama", "rope_theta": 1.0} if legacy else None
    d = to_hf_config(cfg, base)
    assert ("rope_parameters" in d) != legacy
    loaded = transformers.AutoConfig.for_model(**d)
    assert loaded.rope_parameters["rope_theta"] == 1234.0
    assert loaded.rope_parameters["factor"] == 3.0
    back = from_hf_config(loaded.to_dict(), source="x")
    assert back == from_hf_config(d, source="d")
    assert (back.rope_theta, back.rope_scaling, back.num_parameters()) == (
        cfg.rope_theta, cfg.rope_scaling, cfg.num_parameters())


def test_sharded_export_reads_back_tensor_for_tensor(tmp_path):
    model = build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4,
                                    tie_embeddings=False), seed=2)
    files = write_hf_model(model, tmp_path / "m", base_config=None, max_shard_bytes=20_000)
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    back = read_safetensors(str(tmp_path / "m"))
    expected = to_hf_state_dict(model)
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in back)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert torch.equal(hf.lm_head.weight, model.head.weight)


def test_export_refuses_a_non_empty_directory_and_leaves_nothing_half_written(tmp_path):
    model = build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"--out .*out: exists and is not an empty directory"):
        write_hf_model(model, tmp_path / "out", base_config=None)
    with pytest.raises(ValueError, match="clashes"):
        write_hf_model(model, tmp_path / "new", base_config=None,
                       extra_files={"config.json": b"{}"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize(("change", "field"), [
    ({"hidden_act": "gelu"}, "'hidden_act' = 'gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'rope_scaling.rope_type' = 'yarn'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}},
     "'rope_parameters.rope_type' = 'dynamic'"),
    ({"model_type": "gpt2"}, "'model_type' = 'gpt2'.*llama, mistral, qwen2"),
    ({"frobnicate": 3}, "'frobnicate' = 3"),
    ({"pretraining_tp": 2}, "'pretraining_tp' = 2"),
])
def test_unsupported_fields_are_one_line_naming_the_field(change, field):
    d = {**transformers.LlamaConfig(**TINY).to_dict(), **change}
    with pytest.raises(ValueError, match=rf"^model.hf_config cfg.json: field {field}") as info:
        from_hf_config(d, source="cfg.json")
    assert "\n" not in str(info.value)


def test_every_key_transformers_emits_is_classified():
    for cls in (transformers.LlamaConfig, transformers.MistralConfig, transformers.Qwen2Config):
        cfg = from_hf_config(cls(**TINY).to_dict(), source=cls.__name__)
        assert (cfg.d_model, cfg.n_layers, cfg.vocab_size) == (32, 2, 96)
        assert cfg.qkv_bias == (cls is transformers.Qwen2Config)


def test_qwen2_sliding_window_only_when_switched_on():
    d = transformers.Qwen2Config(**TINY, sliding_window=16).to_dict()
    assert from_hf_config(d, source="q").sliding_window is None
    d.update(use_sliding_window=True, sliding_window=16)
    model = build_model(from_hf_config(d, source="q"))
    model(batch(96, 16))
    with pytest.raises(ValueError, match="sliding_window = 16"):
        model(batch(96, 17))


def test_tied_checkpoint_with_a_different_lm_head_is_refused():
    model = build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4))
    sd = to_hf_state_dict(model)
    same = {**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()}
    load_hf_state_dict(model, same, source="w")  # a tied checkpoint may carry it
    with pytest.raises(ValueError, match="lm_head.weight differs from the embedding"):
        load_hf_state_dict(model, {**sd, "lm_head.weight": torch.zeros(64, 32)}, source="w")
    sd.pop("model.layers.0.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"init_from w: .*missing model.layers.0.mlp.up_proj"):
        load_hf_state_dict(model, sd, source="w")


def test_bf16_weights_are_cast_to_float32():
    model = build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4))
    sd = {k: v.to(torch.bfloat16) for k, v in to_hf_state_dict(model).items()}
    load_hf_state_dict(model, sd, source="bf16")
    assert model.embed.weight.dtype == torch.float32
    assert torch.equal(model.embed.weight, sd["model.embed_tokens.weight"].float())


# --- the run config and create_run ------------------------------------------------

def _llama_dir(tmp_path, **extra):
    """A tiny Llama checkpoint saved the Hugging Face way; its directory."""
    cfg = transformers.LlamaConfig(**{**TINY, "vocab_size": 256,
                                      "max_position_embeddings": 128, **extra})
    torch.manual_seed(5)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    hf.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def test_run_config_keeps_the_hf_config_for_workers_that_cannot_read_the_file(tmp_path):
    from workers.config import RunConfig, load_config

    path = _llama_dir(tmp_path) / "config.json"
    cfg = load_config("tiny", [f"model.hf_config={path}", "model.overrides={z_loss: 0.1}",
                               "data.seq_len=64"])
    expected = from_hf_config(json.loads(path.read_text()), source="x").model_copy(
        update={"z_loss": 0.1})
    assert cfg.model_config_resolved == expected
    dumped = json.dumps(cfg.model_dump(mode="json"))
    path.unlink()  # what a worker on another machine sees
    again = RunConfig.model_validate(json.loads(dumped))
    assert again.model_config_resolved == expected


def test_run_config_errors_name_the_field(tmp_path):
    from workers.config import ConfigError, load_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**transformers.LlamaConfig(**TINY).to_dict(),
                                "hidden_act": "gelu"}))
    with pytest.raises(ConfigError, match=r"model.hf_config .*field 'hidden_act' = 'gelu'"):
        load_config("tiny", [f"model.hf_config={path}"])
    with pytest.raises(ConfigError, match=r"model.hf_config .*missing.json: cannot read"):
        load_config("tiny", [f"model.hf_config={tmp_path}/missing.json"])
    with pytest.raises(ConfigError, match="model.preset 'small' and model.hf_config"):
        load_config("tiny", ["model.preset=small",
                             f"model.hf_config={_llama_dir(tmp_path) / 'config.json'}"])


@pytest.fixture(scope="module")
def dataset() -> str:
    from workers.data.prepare import prepare_data

    url = "memory://test-hf/dataset"
    prepare_data(["builtin:shakespeare"], url, max_bytes=50_000)
    return url


def test_init_from_starts_the_run_from_the_file_bit_for_bit(tmp_path, dataset):
    from diloco.run import load_canonical, open_run, plan_for
    from workers.config import load_config
    from workers.runs import create_run

    src = _llama_dir(tmp_path, tie_word_embeddings=False)
    cfg = load_config("tiny", [f"model.hf_config={src / 'config.json'}",
                               f"model.init_from={src}", f"data.dataset={dataset}",
                               "data.seq_len=64", "sync.schedule.fragments=2"])
    url = f"file://{tmp_path}/run"
    create_run(cfg, url)
    model = build_model(cfg.model_config_resolved, seed=99)  # other weights, overwritten
    load_canonical(open_run(url), plan_for(model, cfg.sync), model)
    weights = read_safetensors(str(src / "model.safetensors"))
    got = to_hf_state_dict(model)
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[k], weights[k]) for k in got)


def test_init_from_with_a_missing_tensor_writes_nothing(tmp_path):
    from safetensors.torch import load_file, save_file

    from workers.config import ConfigError, load_config
    from workers.runs import create_run

    src = _llama_dir(tmp_path)
    weights = load_file(src / "model.safetensors")
    weights.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(weights, tmp_path / "broken.safetensors")
    cfg = load_config("tiny", [f"model.hf_config={src / 'config.json'}", "data.seq_len=64",
                               f"model.init_from={tmp_path / 'broken.safetensors'}"])
    with pytest.raises(ConfigError, match=r"model.init_from .*broken.safetensors: .*missing "
                                          r"model.layers.1.self_attn.k_proj.weight"):
        create_run(cfg, f"{tmp_path}/run")
    assert not (tmp_path / "run").exists()  # not even the dataset


@pytest.mark.parametrize("case", list(CASES))
def test_parameter_count_matches_transformers(case):
    """num_parameters() counts biases and an explicit head dim, as the model has them."""
    hf = hf_model(case)
    cfg = from_hf_config(hf.config.to_dict(), source=case)
    ours = build_model(cfg)
    assert cfg.num_parameters() == sum(p.numel() for p in ours.parameters())
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())


def test_llama3_positions_build_rotary_tables_only_as_long_as_used():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=131072)
    model = build_model(cfg)
    assert model.rope.cos.size(0) == 4096  # not 131072 rows
    model(torch.zeros(1, 5000, dtype=torch.long))
    assert model.rope.cos.size(0) == 5000


def test_read_safetensors_from_an_fsspec_url_shard_by_shard(tmp_path):
    import fsspec

    model = build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4), seed=1)
    files = write_hf_model(model, tmp_path / "m", base_config=None, max_shard_bytes=30_000)
    fs = fsspec.filesystem("memory")
    for name in files:
        fs.pipe(f"/hf-url-test/m/{name}", (tmp_path / "m" / name).read_bytes())
    back = read_safetensors("memory://hf-url-test/m")
    expected = to_hf_state_dict(model)
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in back)
    fs.rm(f"/hf-url-test/m/{[f for f in files if f.startswith('model-')][0]}")
    with pytest.raises(ValueError, match=r"init_from memory://hf-url-test/m: shard model-0000"):
        read_safetensors("memory://hf-url-test/m")
    with pytest.raises(ValueError, match="no .safetensors file"):
        read_safetensors("memory://hf-url-test/nothing-here")
