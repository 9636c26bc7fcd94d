"""Random weights for tests and benchmarks, in the exact pytree layout a converted checkpoint has."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from model.attention_mla import MLAWeights
from model.config import TextConfig
from model.decoder import KimiWeights, LayerWeights
from model.eagle3 import DraftConfig, DraftWeights
from model.mlp import MLPWeights
from model.moe import ExpertWeights, MoEWeights
from model.quant import Int4Weight


class _Draw:
    """Random draws from a JAX key (traceable: a jitted init draws every weight on device in one program) or from a
    numpy Generator (host arrays in milliseconds with nothing to compile: tiny models on a CPU, where compiling the
    jitted init costs ~10 s at -O0)."""

    def __init__(self, source):
        self.rng = source if isinstance(source, np.random.Generator) else None
        self.key = None if self.rng is not None else source

    def _sub(self):
        self.key, sub = jax.random.split(self.key)
        return sub

    def normal(self, shape):
        if self.rng is not None:
            return self.rng.standard_normal(shape, np.float32)
        return jax.random.normal(self._sub(), shape, jnp.float32)

    def bits(self, shape):
        if self.rng is not None:
            return self.rng.integers(0, 2**32, shape, dtype=np.uint32)
        return jax.random.bits(self._sub(), shape, jnp.uint32)

    def full(self, shape, value, dtype):
        return np.full(shape, value, dtype) if self.rng is not None else jnp.full(shape, value, dtype)

    def placed(self, tree):
        """The weights as device arrays (numpy draws are host arrays until here)."""
        return jax.tree.map(jnp.asarray, tree) if self.rng is not None else tree

    def stack(self, arrays):
        return np.stack(arrays) if self.rng is not None else jnp.stack(arrays)


def _normal(draw, shape, dtype, fan_in):
    return (draw.normal(shape) * fan_in**-0.5).astype(dtype)


def _norm_weight(draw, n, dtype):
    return (1.0 + 0.1 * draw.normal((n,))).astype(dtype)


def _int4(draw, shape, group):
    """Random INT4 weights whose dequantized values have about unit-fan-in variance."""
    *lead, out, inp = shape
    packed = draw.bits((*lead, out, inp // 8))
    scale = draw.full((*lead, out, inp // group), (inp**-0.5) / 4.6, jnp.bfloat16)  # std of U{-8..7} ~ 4.6
    return Int4Weight(packed, scale)


def _mlp(draw, hidden, inter, dtype):
    return MLPWeights(
        gate=_normal(draw, (inter, hidden), dtype, hidden),
        up=_normal(draw, (inter, hidden), dtype, hidden),
        down=_normal(draw, (hidden, inter), dtype, inter),
    )


def _mla_weights(draw, cfg: TextConfig, h_out: int, h_in: int, dtype) -> MLAWeights:
    """MLA weights reading an input of width h_in (the target: H; an MLA draft: its 2H concat) and writing h_out."""
    n, dn, r, dv, c = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q_in = h_in if cfg.q_lora_rank is None else cfg.q_lora_rank
    return MLAWeights(
        q_a_proj=None if cfg.q_lora_rank is None else _normal(draw, (cfg.q_lora_rank, h_in), dtype, h_in),
        q_a_norm=None if cfg.q_lora_rank is None else _norm_weight(draw, cfg.q_lora_rank, dtype),
        q_b_proj=_normal(draw, (n, dn + r, q_in), dtype, q_in),
        kv_a_proj=_normal(draw, (c + r, h_in), dtype, h_in),
        kv_a_norm=_norm_weight(draw, c, dtype),
        w_uk=_normal(draw, (n, c, dn), dtype, c),
        w_uv=_normal(draw, (n, dv, c), dtype, c),
        o_proj=_normal(draw, (h_out, n, dv), dtype, n * dv),
    )


def init_kimi_weights(cfg: TextConfig, key, dtype=jnp.bfloat16, experts: str = "bf16") -> KimiWeights:
    """`key`: a JAX key, or a numpy Generator (`_Draw`). `experts`: "bf16" (dense, in `dtype`) or "int4" (packed
    with bf16 group scales)."""
    draw = _Draw(key)
    h, n = cfg.hidden_size, cfg.num_attention_heads
    dn, r, dv, c = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    group = cfg.quant.group_size if cfg.quant and cfg.quant.method == "int4" else 32

    def layer(i):
        attn = _mla_weights(draw, cfg, h, h, dtype)
        if cfg.is_moe_layer(i):
            e, f = cfg.n_routed_experts, cfg.moe_intermediate_size
            if experts == "int4":
                ew = ExpertWeights(_int4(draw, (e, f, h), group), _int4(draw, (e, f, h), group), _int4(draw, (e, h, f), group))
            else:
                ew = ExpertWeights(
                    _normal(draw, (e, f, h), dtype, h), _normal(draw, (e, f, h), dtype, h), _normal(draw, (e, h, f), dtype, f)
                )
            ff = MoEWeights(
                router=_normal(draw, (e, h), dtype, h),  # Kimi stores it bf16; the logits are float32 from it
                router_bias=0.01 * draw.normal((e,)),
                experts=ew,
                shared=None if cfg.n_shared_experts == 0 else _mlp(draw, h, f * cfg.n_shared_experts, dtype),
            )
        else:
            ff = _mlp(draw, h, cfg.intermediate_size, dtype)
        return LayerWeights(_norm_weight(draw, h, dtype), _norm_weight(draw, h, dtype), attn, ff)

    return draw.placed(KimiWeights(
        embed=draw.normal((cfg.vocab_size, h)).astype(dtype),
        layers=tuple(layer(i) for i in range(cfg.num_hidden_layers)),
        final_norm=_norm_weight(draw, h, dtype),
        lm_head=_normal(draw, (cfg.vocab_size, h), dtype, h),
    ))


def init_draft_weights(cfg: DraftConfig, key, dtype=jnp.bfloat16, *, own_embed=False, d2t=None) -> DraftWeights:
    """`key`: a JAX key, or a numpy Generator (`_Draw`). `d2t`: numpy offsets [draft_vocab_size] (None: identity
    vocab, using the target's lm_head)."""
    draw = _Draw(key)
    h, n, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    reduced = d2t is not None
    llama = cfg.attention == "llama"
    ht = cfg.target_hidden_size or h
    return draw.placed(DraftWeights(
        fc=_normal(draw, (h, cfg.aux_width), dtype, cfg.aux_width),
        input_norm=_norm_weight(draw, h, dtype),
        hidden_norm=_norm_weight(draw, h, dtype),
        post_attention_norm=_norm_weight(draw, h, dtype),
        q_proj=_normal(draw, (n * d, 2 * h), dtype, 2 * h) if llama else None,
        k_proj=_normal(draw, (nkv * d, 2 * h), dtype, 2 * h) if llama else None,
        v_proj=_normal(draw, (nkv * d, 2 * h), dtype, 2 * h) if llama else None,
        o_proj=_normal(draw, (h, n * d), dtype, n * d) if llama else None,
        mlp=_mlp(draw, h, cfg.intermediate_size, dtype),
        final_norm=_norm_weight(draw, h, dtype),
        lm_head=_normal(draw, (cfg.draft_vocab_size, h), dtype, h) if reduced else None,
        embed=draw.normal((cfg.vocab_size, h)).astype(dtype) if own_embed else None,
        d2t=None if d2t is None else jnp.asarray(np.asarray(d2t), jnp.int32),
        mla=None if llama else _mla_weights(draw, cfg.mla_config, h, 2 * h, dtype),
        fc_norm=draw.stack([_norm_weight(draw, ht, dtype) for _ in range(cfg.aux_count)]) if cfg.fc_norm else None,
    ))
