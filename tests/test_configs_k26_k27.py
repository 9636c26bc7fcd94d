"""Kimi-K2.6 / K2.7-Code targets and the MLA / EAGLE-3.1 drafter configs: every value, and what the planner counts
for them. docs/drafters.md says which values the model cards establish and which are K2.5's, assumed."""

import dataclasses

import pytest

from jaxspec import plan
from jaxspec.models import check_draft_fits
from model.config import Kernels, QuantConfig, YarnRope
from model.configs import known_config
from model.configs.drafts import known_draft_config

K25_YARN = YarnRope(factor=64.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                    mscale_all_dim=1.0)


@pytest.mark.parametrize("name", ["kimi-k2.6", "kimi-k2.7-code"])
def test_target_config_every_value(name):
    cfg = known_config(name)
    expected = dict(
        # from the model cards: 61 layers (1 dense), hidden 7168, expert hidden 2048, 64 heads, 384 experts,
        # 8 per token, 1 shared, "160K" vocabulary, 256K context, MLA, SwiGLU; K2.7-Code: K2-Thinking's INT4
        num_hidden_layers=61, first_k_dense_replace=1, hidden_size=7168, moe_intermediate_size=2048,
        num_attention_heads=64, n_routed_experts=384, num_experts_per_tok=8, n_shared_experts=1, vocab_size=163840,
        max_position_embeddings=262144,
        quant=QuantConfig(method="int4", group_size=32, ignore=(
            "lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            "re:vision_tower.*", "re:mm_projector.*")),
        # K2.5's values (the cards: "same architecture as K2.5"), assumed
        intermediate_size=18432, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_group=1, topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True, rms_norm_eps=1e-5,
        rope_theta=50000.0, rope_scaling=K25_YARN, bos_token_id=163584, eos_token_id=(163585,), pad_token_id=163839,
        tie_word_embeddings=False, rope_interleave=True, aux_layer_ids=None, model_type="kimi_k25",
        weight_prefix="language_model.",
        kernels=Kernels(),  # how jaxspec runs it, not read from config.json
    )
    assert {f.name for f in dataclasses.fields(cfg)} == set(expected)
    for key, value in expected.items():
        assert getattr(cfg, key) == value, key
    assert cfg.eagle_aux_layers == (1, 29, 57)


@pytest.mark.parametrize("name", ["kimi-k2.5-eagle3-mla", "kimi-k2.6-eagle3.1-mla", "kimi-k2.7-coder-eagle3.1-mla"])
def test_mla_drafter_configs(name):
    d = known_draft_config(name)
    eagle31 = "3.1" in name
    assert (d.attention, d.hidden_size, d.num_attention_heads, d.q_lora_rank, d.kv_lora_rank) == ("mla", 7168, 64, 1536, 512)
    assert (d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.head_dim) == (128, 64, 128, 192)
    assert (d.intermediate_size, d.vocab_size, d.draft_vocab_size, d.rms_norm_eps) == (18432, 163840, 163840, 1e-5)
    assert d.aux_layer_ids == (1, 29, 57)  # K2.5-MLA ships boundary ids (2, 30, 58), EAGLE-3.1 layer outputs
    assert (d.fc_norm, d.norm_output) == (eagle31, eagle31)
    assert d.rope_scaling == (K25_YARN if eagle31 else None)
    target = known_config("kimi-k2.5")
    assert check_draft_fits(target, d).aux_layer_ids == (1, 29, 57)


def test_planner_counts_the_mla_drafter_and_its_latent_cache():
    p = plan.make_plan("kimi-k2.7-code", devices=8, device_memory=141 * plan.GB, context=131072, batch=1)
    assert p.draft == "kimi-k2.7-coder-eagle3.1-mla"
    attention = 1536 * 14336 + 64 * 192 * 1536 + 576 * 14336 + 64 * 256 * 512 + 7168 * 64 * 128
    assert p.draft_weights[("attention", "bf16")] == attention * 2
    assert p.draft_weights[("lm_head", "bf16")] == 163840 * 7168 * 2
    # 4 layer norms, 3 fc_norm chunks, the q / kv LoRA norms
    assert p.draft_weights[("norms/router", "bf16")] == (4 * 7168 + 3 * 7168 + 1536 + 512) * 2
    assert p.kv["draft KV cache"] == 131072 * (512 + 64) * 2  # one latent layer, replicated
    assert p.fits
    llama = plan.make_plan("kimi-k2.7-code", 8, 141 * plan.GB, 131072, 1, draft="kimi-k2.5-eagle3")
    assert llama.kv["draft KV cache"] == 2 * 131072 * 64 * 128 * 2
