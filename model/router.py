"""DeepSeek-V3 `noaux_tc` routing: sigmoid scores, bias-corrected group-limited top-k, unbiased weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.config import TextConfig


def route(x_TH: jax.Array, router_EH: jax.Array, bias_E: jax.Array, cfg: TextConfig):
    """Return (weights [T, K] float32, expert ids [T, K] int32) for T tokens."""
    logits_TE = jnp.einsum(
        "th,eh->te", x_TH.astype(jnp.float32), router_EH.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    scores_TE = jax.nn.sigmoid(logits_TE)
    choice_TE = scores_TE + bias_E.astype(jnp.float32)
    if cfg.n_group > 1:
        t, e = choice_TE.shape
        grouped_TGX = choice_TE.reshape(t, cfg.n_group, e // cfg.n_group)
        group_score_TG = jax.lax.top_k(grouped_TGX, 2)[0].sum(-1)
        _, keep_TJ = jax.lax.top_k(group_score_TG, cfg.topk_group)
        group_kept_TG = jnp.zeros_like(group_score_TG, dtype=bool).at[jnp.arange(t)[:, None], keep_TJ].set(True)
        kept_TE = jnp.repeat(group_kept_TG, e // cfg.n_group, axis=1)
        choice_TE = jnp.where(kept_TE, choice_TE, -jnp.inf)
    _, ids_TK = jax.lax.top_k(choice_TE, cfg.num_experts_per_tok)
    weights_TK = jnp.take_along_axis(scores_TE, ids_TK, axis=1)
    if cfg.norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(-1, keepdims=True) + 1e-20)
    return weights_TK * cfg.routed_scaling_factor, ids_TK.astype(jnp.int32)
