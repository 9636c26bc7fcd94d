"""Kimi-K2.5's architecture scaled down, written as a DeepseekV3 config.json dict.

Everything K2.5 has is kept: MLA with q-LoRA, a dense first layer, `noaux_tc` sigmoid routing over
routed experts plus one shared expert, YaRN rope (K2.5's betas 32/1), INT4 pack-quantized routed experts.
"""

from __future__ import annotations

from jaxspec.training.tokenizer import BOS_ID, EOS_ID, PAD_ID

# hidden 256, 6 layers (1 dense + 5 MoE of 32 experts, top-4): ~20M parameters, ~18 MB with INT4 experts
DEFAULT_DIMS = dict(
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    intermediate_size=768,
    moe_intermediate_size=128,
    n_routed_experts=32,
    num_experts_per_tok=4,
    # with 6 layers EAGLE-3's default (1, N//2-1, N-4) = (1, 2, 2) repeats a layer: low, middle, last instead
    eagle_aux_hidden_state_layer_ids=[1, 3, 5],
    max_position_embeddings=4096,
    original_max_position_embeddings=1024,
)

# small enough for a CPU smoke test in seconds
SMOKE_DIMS = dict(
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    intermediate_size=64,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    eagle_aux_hidden_state_layer_ids=[0, 1, 2],
    max_position_embeddings=512,
    original_max_position_embeddings=128,
)

PRESETS = {"default": DEFAULT_DIMS, "smoke": SMOKE_DIMS}

INT4_GROUP_SIZE = 32


def int4_quantization_config(group_size: int = INT4_GROUP_SIZE) -> dict:
    """compressed-tensors pack-quantized INT4 for routed experts only, as Kimi-K2.5 ships."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                            "group_size": group_size, "dynamic": False, "observer": "minmax"},
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
        "kv_cache_scheme": None,
    }


def mini_k25_config(vocab_size: int, preset: str = "default", int4_experts: bool = False) -> dict:
    """A DeepseekV3ForCausalLM config.json dict (parsed by model.config.text_config_from_dict)."""
    d = dict(PRESETS[preset])
    factor = d["max_position_embeddings"] / d["original_max_position_embeddings"]
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "vocab_size": vocab_size,
        "hidden_size": d["hidden_size"],
        "intermediate_size": d["intermediate_size"],
        "moe_intermediate_size": d["moe_intermediate_size"],
        "num_hidden_layers": d["num_hidden_layers"],
        "num_attention_heads": d["num_attention_heads"],
        "num_key_value_heads": d["num_attention_heads"],
        "n_shared_experts": 1,
        "n_routed_experts": d["n_routed_experts"],
        "num_experts_per_tok": d["num_experts_per_tok"],
        "routed_scaling_factor": 2.827,
        "kv_lora_rank": d["kv_lora_rank"],
        "q_lora_rank": d["q_lora_rank"],
        "qk_rope_head_dim": d["qk_rope_head_dim"],
        "qk_nope_head_dim": d["qk_nope_head_dim"],
        "v_head_dim": d["v_head_dim"],
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": 1,
        "topk_group": 1,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": d["max_position_embeddings"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": d["original_max_position_embeddings"],
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "bfloat16",
        "eagle_aux_hidden_state_layer_ids": d["eagle_aux_hidden_state_layer_ids"],
    }
    if int4_experts:
        cfg["quantization_config"] = int4_quantization_config()
    return cfg
