"""jaxspec configs -> Hugging Face config.json dicts, for checkpoints saved from in-memory weights
(a training script has a TextConfig / DraftConfig, not the file it came from)."""

from __future__ import annotations

from model.config import TextConfig
from model.eagle3 import DraftConfig, aux_ids_to_hf


def text_config_to_hf(cfg: TextConfig) -> dict:
    """A DeepseekV3 config.json that `text_config_from_dict` parses back to `cfg`, except the source's
    `weight_prefix` and `quant` (they describe HF files, not the in-memory weights being saved)."""
    d = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.n_shared_experts,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": 1,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_interleave": cfg.rope_interleave,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id) if len(cfg.eos_token_id) != 1 else cfg.eos_token_id[0],
        "pad_token_id": cfg.pad_token_id,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "num_nextn_predict_layers": 0,
    }
    if cfg.rope_scaling is not None:
        y = cfg.rope_scaling
        d["rope_scaling"] = {
            "type": "yarn", "factor": y.factor, "original_max_position_embeddings": y.original_max_position_embeddings,
            "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "mscale": y.mscale, "mscale_all_dim": y.mscale_all_dim,
        }
    if cfg.aux_layer_ids is not None:
        d["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
    return d


def draft_config_to_hf(cfg: DraftConfig) -> dict:
    """A LlamaForCausalLMEagle3 / Eagle3DeepseekV2ForCausalLM config.json that `draft_config_from_dict` parses back
    to `cfg`."""
    d = {
        "architectures": ["LlamaForCausalLMEagle3" if cfg.attention == "llama" else "Eagle3DeepseekV2ForCausalLM"],
        "model_type": "llama" if cfg.attention == "llama" else "kimi_k2",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False,
        "eagle_config": {"use_aux_hidden_state": True},
    }
    if cfg.attention == "llama":
        d["head_dim"] = cfg.head_dim
    else:
        d.update(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                 qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim)
        if cfg.rope_scaling is not None:
            y = cfg.rope_scaling
            d["rope_scaling"] = {
                "type": "yarn", "factor": y.factor, "original_max_position_embeddings": y.original_max_position_embeddings,
                "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "mscale": y.mscale, "mscale_all_dim": y.mscale_all_dim,
            }
    for flag in ("fc_norm", "norm_output", "norm_before_residual"):
        if getattr(cfg, flag):
            d[flag] = True
    if cfg.aux_layer_ids is not None:
        d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = aux_ids_to_hf(cfg.aux_layer_ids)
    if cfg.target_hidden_size is not None:
        d["target_hidden_size"] = cfg.target_hidden_size
    return d
