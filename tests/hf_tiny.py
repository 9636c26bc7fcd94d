"""Tiny HF DeepseekV3 / Kimi checkpoints written by transformers' own save_pretrained (test helper)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.827,
    norm_topk_prob=True,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    max_position_embeddings=2048,
    rope_scaling=dict(type="yarn", factor=64.0, original_max_position_embeddings=32,
                      beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    initializer_range=0.1,
)


def tiny_config_dict(**overrides) -> dict:
    d = dict(TINY)
    d.update(overrides)
    return d


def make_hf_model(seed: int = 0, **overrides):
    """A float32 DeepseekV3ForCausalLM with random weights, router bias included (HF inits it to 0)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(**tiny_config_dict(**overrides))
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.05)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model


def save_hf_model(model, directory: Path) -> Path:
    model.save_pretrained(directory, safe_serialization=True)
    return Path(directory)


def hf_logits(model, tokens, positions=None):
    with torch.no_grad():
        ids = torch.as_tensor(tokens, dtype=torch.long)
        pos = None if positions is None else torch.as_tensor(positions, dtype=torch.long)
        out = model(input_ids=ids, position_ids=pos, output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]
