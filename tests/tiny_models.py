"""Tiny random target + EAGLE-3 draft built in memory (test helper)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import SpecConfig, SpecWeights
from model.config import TextConfig, YarnRope
from model.eagle3 import DraftConfig
from model.init import init_draft_weights, init_kimi_weights


def tiny_target_config(vocab: int = 64, **kw) -> TextConfig:
    base = dict(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, q_lora_rank=16,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, intermediate_size=48,
        moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rms_norm_eps=1e-5, rope_theta=50000.0,
        rope_scaling=YarnRope(factor=8.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                              mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=512, bos_token_id=None, eos_token_id=(), pad_token_id=0,
        aux_layer_ids=(0, 1, 2),
    )
    base.update(kw)
    return TextConfig(**base)


def tiny_draft_config(target: TextConfig, draft_vocab: int | None = None) -> DraftConfig:
    return DraftConfig(
        hidden_size=target.hidden_size, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=64, vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab or target.vocab_size, rope_theta=10000.0, rms_norm_eps=1e-6,
        aux_layer_ids=target.aux_layer_ids,
    )


def tiny_pair(seed: int = 0, vocab: int = 64, draft_vocab: int | None = None, dtype=jnp.float32, eos=(),
              logit_scale: float = 1.0, **target_kw):
    """A random target (logits scaled by `logit_scale` to sharpen/flatten) and a random draft."""
    cfg = tiny_target_config(vocab, eos_token_id=tuple(eos), **target_kw)
    dcfg = tiny_draft_config(cfg, draft_vocab)
    # numpy draws: nothing to compile (a jax init compiles one small program per op and shape when eager)
    k1, k2 = np.random.default_rng(seed).spawn(2)
    tw = init_kimi_weights(cfg, k1, dtype)
    tw = tw.replace(lm_head=tw.lm_head * logit_scale)
    d2t = None
    if draft_vocab:
        chosen = np.sort(np.random.default_rng(seed).choice(vocab, draft_vocab, replace=False))
        d2t = chosen - np.arange(draft_vocab)
    dw = init_draft_weights(dcfg, k2, dtype, d2t=d2t)
    return SpecConfig(cfg, dcfg, tuple(eos)), SpecWeights(tw, dw)
