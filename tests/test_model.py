"""The language model: shapes, causality, RoPE, GQA, losses, init, presets.

Fast unit tests (a few seconds on 2 CPU cores). The GPU presets are never
instantiated: only their analytic parameter counts are checked.
"""

from __future__ import annotations

import math

import pytest
import torch

from diloco.fragments import find_blocks, plan_fragments
from workers.model import Rotary, Transformer, build_model, describe
from workers.model_config import PRESETS, ModelConfig

# A model small enough that every test below runs in milliseconds.
MINI = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)


def tokens(batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- shapes and masking --------------------------------------------------------------


def test_output_shapes_and_dtypes():
    model = build_model(MINI)
    x = tokens(3, 10, MINI.vocab_size)
    logits, loss = model(x)
    assert logits.shape == (3, 10, 64) and logits.dtype == torch.float32
    assert loss is None
    logits, loss = model(x, x)
    assert loss is not None and loss.shape == () and torch.isfinite(loss)


def test_causal_mask_is_exact():
    """Changing tokens after position t leaves logits at positions <= t bit-identical."""
    model = build_model(MINI).eval()
    x = tokens(2, 24, MINI.vocab_size, seed=1)
    base, _ = model(x)
    for t in (0, 7, 22):
        y = x.clone()
        y[:, t + 1 :] = (y[:, t + 1 :] + 1) % MINI.vocab_size
        changed, _ = model(y)
        assert torch.equal(changed[:, : t + 1], base[:, : t + 1])
        assert not torch.equal(changed[:, t + 1 :], base[:, t + 1 :])


def test_sequence_longer_than_max_seq_len_raises():
    model = build_model(MINI)
    model(tokens(1, 32, MINI.vocab_size))  # T == max_seq_len is fine
    with pytest.raises(ValueError, match=r"T = 33 .*max_seq_len = 32"):
        model(tokens(1, 33, MINI.vocab_size))


# --- RoPE --------------------------------------------------------------------------------


def test_rope_score_depends_only_on_relative_position():
    """Put the same q at every position and the same k at every position; after the
    rotation S[i, j] = q_i . k_j must depend on i - j only (a Toeplitz matrix)."""
    head_dim, T = 16, 40
    rope = Rotary(head_dim, max_seq_len=T, theta=10000.0)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(head_dim, generator=g).expand(1, 1, T, head_dim)
    k = torch.randn(head_dim, generator=g).expand(1, 1, T, head_dim)
    scores = (rope(q) @ rope(k).transpose(-1, -2))[0, 0]  # [T, T]
    for shift in (1, 5, 17):
        torch.testing.assert_close(scores[shift:, shift:], scores[:-shift, :-shift])
    # and it is not trivial: the score does change with the distance
    assert not torch.allclose(scores[10, 10], scores[10, 3])
    # position 0 is not rotated (angle 0)
    torch.testing.assert_close(rope(q)[..., 0, :], q[..., 0, :])


def test_rope_buffers_are_not_saved():
    model = build_model(MINI)
    assert not any("rope" in k for k in model.state_dict())
    assert model.rope.cos.shape == (MINI.max_seq_len, MINI.head_dim // 2)


# --- grouped-query attention -------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_gqa_equals_mha_with_repeated_kv_weights(kv_heads):
    """GQA with g = n_heads / n_kv_heads is MHA whose k and v weights repeat each kv
    head g times (kv head j serves query heads j*g .. j*g + g - 1)."""
    gqa_cfg = MINI.model_copy(update={"n_kv_heads": kv_heads})
    gqa = build_model(gqa_cfg, seed=3)
    hd, g = MINI.head_dim, MINI.n_heads // kv_heads
    wk = gqa.layers[0].attn.wk.weight
    assert wk.shape == (kv_heads * hd, MINI.d_model)

    mha = build_model(MINI, seed=3)
    state = gqa.state_dict()
    for name, value in list(state.items()):
        if name.endswith(("attn.wk.weight", "attn.wv.weight")):
            per_head = value.view(kv_heads, hd, MINI.d_model)
            state[name] = per_head.repeat_interleave(g, dim=0).reshape(-1, MINI.d_model)
    mha.load_state_dict(state)

    x = tokens(2, 12, MINI.vocab_size)
    out_gqa, _ = gqa(x)
    out_mha, _ = mha(x)
    assert out_gqa.shape == (2, 12, MINI.vocab_size)
    torch.testing.assert_close(out_gqa, out_mha, rtol=1e-5, atol=1e-5)


# --- losses ------------------------------------------------------------------------------


def test_loss_at_init_is_close_to_ln_vocab():
    """At init the logits are near zero (std about 0.02 * sqrt(256) = 0.32), so the
    loss is about ln(256) = 5.545 plus half the logit variance, about 0.05."""
    model = build_model(PRESETS["tiny"])
    x = tokens(4, 64, 256, seed=2)
    _, loss = model(x, tokens(4, 64, 256, seed=3))
    assert abs(loss.item() - math.log(256)) < 0.2


def test_z_loss_adds_exactly_its_term():
    """loss(z) - loss(0) == z * mean(logsumexp(logits)^2). At init logsumexp is about
    ln(64) = 4.16, so with z = 1e-3 the term is about 1e-3 * 17.3 = 0.017."""
    z = 1e-3
    plain = build_model(MINI, seed=5)
    with_z = build_model(MINI.model_copy(update={"z_loss": z}), seed=5)
    x, y = tokens(2, 16, 64, seed=6), tokens(2, 16, 64, seed=7)
    logits, loss_plain = plain(x, y)
    _, loss_z = with_z(x, y)

    l64 = logits.double()
    m = l64.max(dim=-1, keepdim=True).values
    lse = (l64 - m).exp().sum(-1).log() + m.squeeze(-1)  # written out, not torch.logsumexp
    expected = z * (lse**2).mean()
    assert 0.015 < expected.item() < 0.020
    torch.testing.assert_close((loss_z - loss_plain).double(), expected, rtol=1e-4, atol=1e-7)


def test_adamw_overfits_a_fixed_batch():
    torch.manual_seed(0)
    model = build_model(MINI)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    x = tokens(4, 16, 64, seed=8)
    y = torch.roll(x, -1, dims=1)
    _, first = model(x, y)
    for _ in range(40):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    # ln(64) = 4.16 at the start; 40 steps on 64 tokens memorise most of them
    assert first.item() > 4.0
    assert loss.item() < 0.5 * first.item()


def test_bf16_autocast_forward_and_backward_on_cpu():
    model = build_model(MINI.model_copy(update={"n_kv_heads": 2}))
    x = tokens(2, 16, 64)
    ref, _ = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(x, x)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    # bf16 keeps about 3 significant digits; logits at init are of order 0.1-1
    torch.testing.assert_close(logits, ref, rtol=0.05, atol=0.05)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# --- init and determinism ----------------------------------------------------------


def test_build_model_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    a, b, c = build_model(MINI, seed=7), build_model(MINI, seed=7), build_model(MINI, seed=8)
    assert torch.equal(torch.get_rng_state(), before)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not torch.equal(pa["embed.weight"], pc["embed.weight"])
    assert not torch.equal(pa["layers.1.mlp.w2.weight"], pc["layers.1.mlp.w2.weight"])


def test_transformer_init_follows_torch_manual_seed():
    torch.manual_seed(3)
    a = Transformer(MINI)
    torch.manual_seed(3)
    b = Transformer(MINI)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_init_statistics():
    """Weights ~ N(0, 0.02); wo and w2 ~ N(0, 0.02 / sqrt(2 * 4)) = N(0, 0.00707)."""
    model = build_model(PRESETS["tiny"])
    assert 0.019 < model.embed.weight.std().item() < 0.021
    assert 0.019 < model.layers[0].attn.wq.weight.std().item() < 0.021
    for proj in (model.layers[2].attn.wo, model.layers[2].mlp.w2):
        assert 0.0068 < proj.weight.std().item() < 0.0073
    assert torch.equal(model.norm.weight, torch.ones(256))
    assert torch.equal(model.layers[0].attn_norm.weight, torch.ones(256))


# --- parameter counts and presets ------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("kv_heads", [None, 2])
def test_num_parameters_matches_the_model(tie, kv_heads):
    config = MINI.model_copy(update={"tie_embeddings": tie, "n_kv_heads": kv_heads})
    model = build_model(config)
    assert n_params(model) == config.num_parameters()
    assert (model.head is None) == tie


def test_untied_adds_exactly_one_vocab_by_d_matrix():
    # MINI tied: per block 4*32*32 (attention) + 3*32*128 (MLP; 8/3*32 -> 128) + 2*32
    # = 4096 + 12288 + 64 = 16448; 2 blocks = 32896; + embed 64*32 = 2048 + norm 32
    # = 34976. Untied adds the head, 64*32 = 2048: 37024.
    assert MINI.num_parameters() == 34976
    untied = MINI.model_copy(update={"tie_embeddings": False})
    assert untied.num_parameters() == 34976 + 2048


def test_presets_counts():
    # tiny: block = 4*256^2 + 3*256*704 + 2*256 = 262144 + 540672 + 512 = 803328;
    # 4 blocks = 3213312; + embed 256*256 = 65536 + norm 256 -> 3279104.
    # small: block = 4*384^2 + 3*384*1024 + 768 = 589824 + 1179648 + 768 = 1770240;
    # 12 blocks = 21242880; + embed 98304 + norm 384 -> 21341568.
    expected = {"tiny": 3_279_104, "small": 21_341_568}
    for name, count in expected.items():
        config = PRESETS[name]
        assert config.num_parameters() == count
        assert n_params(Transformer(config)) == count


def test_gpu_presets_analytic_counts():
    """Not instantiated. gpu-150m: block = 4*768^2 + 3*768*2048 + 1536 = 7079424;
    18 blocks = 127429632; + embed 32000*768 = 24576000 + norm 768 -> 152006400.
    gpu-1b: block = 2*2048^2 + 2*2048*512 + 3*2048*5504 + 4096 = 44306432;
    22 blocks = 974741504; + embed 32000*2048 = 65536000 + 2048 -> 1040279552."""
    c150, c1b = PRESETS["gpu-150m"], PRESETS["gpu-1b"]
    assert c150.num_parameters() == 152_006_400
    assert 130e6 < c150.num_parameters() < 170e6
    assert (c150.vocab_size, c150.max_seq_len) == (32000, 1024)
    assert c1b.num_parameters() == 1_040_279_552
    assert 0.9e9 < c1b.num_parameters() < 1.2e9
    assert (c1b.vocab_size, c1b.max_seq_len) == (32000, 2048)
    assert c1b.kv_heads < c1b.n_heads  # GQA


def test_describe():
    text = describe(build_model(PRESETS["tiny"]))
    assert text == "3.28M params, 4 layers, d_model 256, 4 heads, vocab 256, tied embeddings"
    gqa = build_model(MINI.model_copy(update={"n_kv_heads": 1, "tie_embeddings": False}))
    assert "4 heads (1 kv)" in describe(gqa) and "untied" in describe(gqa)


# --- the synchroniser's view ---------------------------------------------------------


def test_layers_is_the_first_module_list():
    model = build_model(MINI)
    found = find_blocks(model)
    assert found is not None
    name, blocks = found
    assert name == "layers" and blocks is model.layers
    plan = plan_fragments(model, 2)
    assert plan[1].names[0] == "layers.1.attn_norm.weight"
    assert sum(f.numel for f in plan.fragments) == MINI.num_parameters()


# --- config validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"d_model": 30}, r"d_model must be divisible by n_heads: d_model = 30, n_heads = 4"),
        ({"d_model": 12, "n_heads": 4}, r"head dim .* must be even for RoPE"),
        ({"n_kv_heads": 3}, r"n_kv_heads must divide n_heads = 4, got 3"),
        ({"n_layers": 0}, r"n_layers must be >= 1, got 0"),
        ({"vocab_size": -1}, r"vocab_size must be >= 1"),
        ({"mlp_hidden": 0}, r"mlp_hidden must be >= 1 or unset"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
        ({"z_loss": -0.1}, r"z_loss must be >= 0"),
        ({"norm_eps": 0.0}, r"norm_eps must be > 0"),
        ({"n_head": 4}, r"unknown field\(s\) n_head; allowed: vocab_size"),
    ],
)
def test_config_validation_names_the_field(update, message):
    fields = MINI.model_dump() | update
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)


def test_mlp_hidden_default_rounds_up():
    # 8/3 * 256 = 682.7 -> next multiple of 64 is 704; 8/3 * 384 = 1024 exactly.
    assert ModelConfig(d_model=256).mlp_dim == 704
    assert ModelConfig(d_model=384, n_heads=6).mlp_dim == 1024
    assert ModelConfig(mlp_hidden=100).mlp_dim == 100
