"""The four Kimi configs parse to REFERENCE.md section 1; unsupported values name their key."""

import json

import pytest

from model.config import ConfigError, text_config_from_dict
from model.configs import known_config
from model.rope import inv_frequencies, yarn_correction_range


@pytest.mark.parametrize("name", ["kimi-k2-instruct", "kimi-k2-instruct-0905", "kimi-k2-thinking", "kimi-k2.5"])
def test_common_backbone(name):
    c = known_config(name)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (7168, 61, 64)
    assert (c.q_lora_rank, c.kv_lora_rank) == (1536, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.qk_head_dim) == (128, 64, 128, 192)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts) == (384, 8, 1)
    assert (c.moe_intermediate_size, c.intermediate_size, c.first_k_dense_replace) == (2048, 18432, 1)
    assert (c.n_group, c.topk_group, c.routed_scaling_factor, c.norm_topk_prob) == (1, 1, 2.827, True)
    assert c.rope_theta == 50000 and c.vocab_size == 163840
    assert (c.bos_token_id, c.pad_token_id) == (163584, 163839)
    assert c.rope_scaling.original_max_position_embeddings == 4096
    assert c.eagle_aux_layers == (1, 29, 57)
    assert [c.is_moe_layer(i) for i in (0, 1, 60)] == [False, True, True]


EXPECTED = {
    # name: max_pos, factor, betas, eps, eos, quant, prefix, yarn (low, high), softmax scale
    "kimi-k2-instruct": (131072, 32, (1, 1), 1e-6, 163585, "fp8", "", (19, 20), 0.130862),
    "kimi-k2-instruct-0905": (262144, 64, (1, 1), 1e-6, 163585, "fp8", "", (19, 20), 0.144680),
    "kimi-k2-thinking": (262144, 64, (1, 1), 1e-5, 163586, "int4", "", (19, 20), 0.144680),
    "kimi-k2.5": (262144, 64, (32, 1), 1e-5, 163585, "int4", "language_model.", (8, 20), 0.144680),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_per_checkpoint_values(name):
    max_pos, factor, betas, eps, eos, quant, prefix, low_high, scale = EXPECTED[name]
    c = known_config(name)
    y = c.rope_scaling
    assert (c.max_position_embeddings, y.factor, (y.beta_fast, y.beta_slow)) == (max_pos, factor, betas)
    assert (y.mscale, y.mscale_all_dim) == (1, 1)
    assert c.rms_norm_eps == eps and c.eos_token_id == (eos,)
    assert c.quant.method == quant and c.weight_prefix == prefix
    assert yarn_correction_range(y, 64, 50000) == low_high
    assert c.softmax_scale == pytest.approx(scale, rel=1e-5)  # 192**-0.5 * (0.1 ln(factor) + 1)**2
    if quant == "int4":
        assert c.quant.group_size == 32 and "lm_head" in c.quant.ignore
    else:
        assert c.quant.block_size == (128, 128)


def test_yarn_frequencies_blend():
    c = known_config("kimi-k2.5")
    inv = inv_frequencies(64, 50000, c.rope_scaling)
    plain = inv_frequencies(64, 50000, None)
    assert inv[:8] == pytest.approx(plain[:8])  # below `low`: extrapolated (unchanged)
    assert inv[20:] == pytest.approx(plain[20:] / 64)  # above `high`: interpolated by the factor


def _raw(name):
    from model.configs import CONFIG_DIR

    return json.loads((CONFIG_DIR / f"{name}.json").read_text())


@pytest.mark.parametrize(
    "mutate, key",
    [
        (lambda d: d["rope_scaling"].update(type="linear"), "rope_scaling.type"),
        (lambda d: d.update(scoring_func="softmax"), "scoring_func"),
        (lambda d: d.update(topk_method="greedy"), "topk_method"),
        (lambda d: d.update(n_group=5), "n_group"),
        (lambda d: d.update(hidden_act="gelu"), "hidden_act"),
        (lambda d: d["quantization_config"].update(quant_method="awq"), "quant_method"),
        (lambda d: d.pop("kv_lora_rank"), "kv_lora_rank"),
        (lambda d: d.update(architectures=["LlamaForCausalLM"]), "architectures"),
    ],
)
def test_unsupported_values_name_the_key(mutate, key):
    d = _raw("kimi-k2-instruct")
    mutate(d)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        text_config_from_dict(d)


def test_k25_int4_details_are_checked():
    d = _raw("kimi-k2.5")
    d["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    with pytest.raises(ConfigError, match="num_bits"):
        text_config_from_dict(d)
