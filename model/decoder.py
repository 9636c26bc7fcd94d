"""The Kimi K2 / DeepseekV3 decoder: one forward for decode (T=1), verify (T=K+1) and prefill buckets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from model.attention_mla import MLAWeights, fuse_input_projections, mla, split_input_projections
from model.config import TextConfig
from model.embedding import embedding_rows
from model.kv_cache import LatentCache
from model.mlp import MLPWeights, swiglu
from model.moe import MoEWeights, moe
from model.norms import rms_norm
from model.rope import cos_sin, target_rope_tables
from model.shard_local import held_to_rules


@struct.dataclass
class LayerWeights:
    input_norm: jax.Array  # [H]
    post_attention_norm: jax.Array  # [H]
    attn: MLAWeights
    mlp: MLPWeights | MoEWeights  # dense for layers < first_k_dense_replace


@struct.dataclass
class KimiWeights:
    embed: jax.Array  # [V, H]
    layers: tuple[LayerWeights, ...]  # separate arrays per layer: the layer loop unrolls at trace time
    final_norm: jax.Array  # [H]
    lm_head: jax.Array  # [V, H]

    @property
    def dtype(self):
        return self.embed.dtype


def fuse_attention_inputs(w: KimiWeights) -> KimiWeights:
    """`w` with every layer's q_a and kv_a projections as one weight (`model.attention_mla.fuse_input_projections`):
    the layout weights are run in, built once when they are loaded."""
    return w.replace(layers=tuple(lw.replace(attn=fuse_input_projections(lw.attn)) for lw in w.layers))


def split_attention_inputs(w: KimiWeights) -> KimiWeights:
    """The inverse of `fuse_attention_inputs`: every layer's q_a and kv_a apart, as checkpoints store them."""
    return w.replace(layers=tuple(lw.replace(attn=split_input_projections(lw.attn)) for lw in w.layers))


class ForwardOutput(NamedTuple):
    logits: jax.Array  # [B, T, V] float32 (or [B, 1, V] when logits_at is given)
    aux_hidden: jax.Array  # [B, T, len(aux_layers) * H]: residual stream leaving each aux layer
    cache: LatentCache  # lengths unchanged: the caller decides what is committed
    final_hidden: jax.Array  # [B, T, H] after the final norm
    expert_ids: tuple[jax.Array, ...] = ()  # per MoE layer [B*T, K]: the experts each token ran


def decoder_layer(x_BTH, lw: LayerWeights, cos, sin, positions_BT, latent, k_rope, expert_ids_TK=None, pages_BM=None,
                  *, cfg: TextConfig, attention: str):
    """One layer: (residual stream out [B, T, H], latent cache, rope-key cache, the experts each token ran [B*T, K]
    or None in a dense layer). `pages_BM`: the block table of a paged cache (model.kv_cache)."""
    attn_BTH, latent, k_rope = mla(
        rms_norm(x_BTH, lw.input_norm, cfg.rms_norm_eps), lw.attn, cfg, cos, sin, positions_BT, latent, k_rope, attention,
        pages_BM=pages_BM,
    )
    x_BTH = x_BTH + attn_BTH
    h_BTH = rms_norm(x_BTH, lw.post_attention_norm, cfg.rms_norm_eps)
    if isinstance(lw.mlp, MoEWeights):
        ff_BTH, ids_TK = moe(h_BTH, lw.mlp, cfg, expert_ids_TK)
    else:
        ff_BTH, ids_TK = swiglu(h_BTH, lw.mlp), None
    return x_BTH + ff_BTH, latent, k_rope, ids_TK


# Each layer is a call of this one jitted function. JAX traces and lowers a jitted callee once per signature (the
# dense first layers, the MoE layers) and calls it from every layer, so tracing and lowering a program (its Pallas
# kernels included) cost the same at 61 layers as at 2. XLA inlines the calls before it optimizes, so the program
# that runs is the one an unrolled Python loop builds.
layer_call = jax.jit(decoder_layer, static_argnames=("cfg", "attention"))


def forward(
    w: KimiWeights,
    cfg: TextConfig,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    cache: LatentCache,
    *,
    logits_at: jax.Array | None = None,
    attention: str = "absorbed",
    expert_ids: Sequence[jax.Array] | None = None,
) -> ForwardOutput:
    """Run T new tokens per sequence at `positions` (slot = position) through the target.

    `logits_at` [B] picks one token per sequence for the lm_head (prefill needs only the last). `expert_ids`: one
    [B*T, K] array per MoE layer replacing the router's choices (`model.moe.moe`; benchmarks only)."""
    inv_freq, multiplier = target_rope_tables(cfg)
    cos, sin = cos_sin(positions_BT, inv_freq, multiplier)
    x_BTH = embedding_rows(w.embed, tokens_BT, vocab_sharded=True)
    aux_ids = set(cfg.eagle_aux_layers)
    aux, latents, k_ropes, chosen = [], [], [], []
    for i, lw in enumerate(w.layers):
        forced_TK = None
        if expert_ids is not None and isinstance(lw.mlp, MoEWeights):
            forced_TK = expert_ids[len(chosen)]
        x_BTH, latent, k_rope, ids_TK = layer_call(
            x_BTH, lw, cos, sin, positions_BT, cache.latent[i], cache.k_rope[i], forced_TK, cache.pages_BM, cfg=cfg,
            attention=attention,
        )
        latents.append(latent)
        k_ropes.append(k_rope)
        if ids_TK is not None:
            chosen.append(ids_TK)
        if i in aux_ids:
            aux.append(x_BTH)
    final_BTH = rms_norm(x_BTH, w.final_norm, cfg.rms_norm_eps)
    head_in = final_BTH
    if logits_at is not None:
        head_in = jnp.take_along_axis(final_BTH, logits_at[:, None, None].astype(jnp.int32), axis=1)
    logits = jnp.einsum("bth,vh->btv", head_in, w.lm_head.astype(head_in.dtype), preferred_element_type=jnp.float32)
    # the logits leave split over the vocabulary, as lm_head is; held there, a consumer laying them out otherwise
    # (sampling by rows) reshards them rather than reshaping the forward behind them
    logits = held_to_rules(logits, (None, None, "vocab"))
    aux_BTA = jnp.concatenate(aux, axis=-1) if aux else jnp.zeros((*x_BTH.shape[:2], 0), x_BTH.dtype)
    new_cache = LatentCache(latent=tuple(latents), k_rope=tuple(k_ropes), lengths=cache.lengths, pages_BM=cache.pages_BM)
    return ForwardOutput(logits, aux_BTA, new_cache, final_BTH, tuple(chosen))
