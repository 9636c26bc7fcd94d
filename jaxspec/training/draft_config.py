"""The EAGLE-3 draft's config.json (LlamaForCausalLMEagle3, as SpecForge writes it) for a given target."""

from __future__ import annotations

from model.config import TextConfig

DEFAULT_DRAFT = dict(num_attention_heads=4, head_dim=64, intermediate_size=1024, draft_vocab_size=2048)
SMOKE_DRAFT = dict(num_attention_heads=2, head_dim=16, intermediate_size=64, draft_vocab_size=128)
DRAFT_PRESETS = {"default": DEFAULT_DRAFT, "smoke": SMOKE_DRAFT}


def eagle3_config(target: TextConfig, preset: str = "default", draft_vocab_size: int | None = None) -> dict:
    """Hidden size equals the target's (fc maps the 3 concatenated aux states back to it)."""
    d = DRAFT_PRESETS[preset]
    heads = d["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "target_hidden_size": target.hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": d["head_dim"],
        "intermediate_size": d["intermediate_size"],
        "hidden_act": "silu",
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab_size or min(d["draft_vocab_size"], target.vocab_size),
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": target.max_position_embeddings,
        "tie_word_embeddings": False,
        "bos_token_id": target.bos_token_id,
        "eos_token_id": list(target.eos_token_id)[0] if target.eos_token_id else None,
        "torch_dtype": "bfloat16",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(target.eagle_aux_layers),
            "use_aux_hidden_state": True,
        },
    }
