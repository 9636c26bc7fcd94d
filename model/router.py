"""DeepSeek-V3 `noaux_tc` routing: sigmoid scores, bias-corrected group-limited top-k, unbiased weights."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from model.config import TextConfig
from model.router_weights import chosen_weights
from model.kernels import router_gemv, target
from model.kernels.dispatch import router_kernel_applies
from model.kernels.router_topk import route_topk
from model.shard_local import per_device_replicated


def router_logits(x_TH: jax.Array, router_EH: jax.Array) -> jax.Array:
    """[T, E] float32 logits, products exact in float32 (the choice of experts is sensitive to them)."""
    return jnp.einsum("th,eh->te", x_TH.astype(jnp.float32), router_EH.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def route(x_TH: jax.Array, router_EH: jax.Array, bias_E: jax.Array, cfg: TextConfig):
    """Return (weights [T, K] float32, expert ids [T, K] int32) for T tokens.

    With the router kernel (`cfg.kernels.router`, `model.kernels.dispatch.router_kernel_applies`): the logits by
    model/kernels/router_gemv.py between its MIN_TOKENS and MAX_TOKENS, the top-k by model/kernels/router_topk.py
    (Pallas interpret mode off the GPU). Otherwise the plain XLA path below, which is also the kernels' reference."""
    if router_kernel_applies(cfg.kernels, x_TH.shape[0], cfg):
        # under a mesh every device routes every token itself (`per_device_replicated`), as the routed experts'
        # shard_map expects: all of them see all T x K choices
        return per_device_replicated(functools.partial(route_by_kernels, cfg=cfg), x_TH, router_EH, bias_E)
    logits_TE = router_logits(x_TH, router_EH)
    scores_TE = jax.nn.sigmoid(logits_TE)
    choice_TE = scores_TE + bias_E.astype(jnp.float32)
    if cfg.n_group > 1:
        t, e = choice_TE.shape
        grouped = choice_TE.reshape(t, cfg.n_group, e // cfg.n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        _, kept_groups = jax.lax.top_k(group_scores, cfg.topk_group)
        group_kept = jnp.zeros_like(group_scores, dtype=bool).at[jnp.arange(t)[:, None], kept_groups].set(True)
        kept_TE = jnp.repeat(group_kept, e // cfg.n_group, axis=1)
        choice_TE = jnp.where(kept_TE, choice_TE, -jnp.inf)
    _, ids_TK = jax.lax.top_k(choice_TE, cfg.num_experts_per_tok)
    return chosen_weights(scores_TE, ids_TK, cfg.norm_topk_prob, cfg.routed_scaling_factor), ids_TK.astype(jnp.int32)


def route_by_kernels(x_TH: jax.Array, router_EH: jax.Array, bias_E: jax.Array, cfg: TextConfig):
    """`route` by the router kernels: the logits by router_gemv.py between its MIN_TOKENS and MAX_TOKENS (XLA's
    float32 product elsewhere), the top-k by router_topk.py."""
    interpret = target.interpret()
    if router_gemv.MIN_TOKENS <= x_TH.shape[0] <= router_gemv.MAX_TOKENS:  # verify: the GEMV's partial sums
        logits = router_gemv.router_logit_partials(x_TH, router_EH, interpret)
    else:
        logits = router_logits(x_TH, router_EH)
    return route_topk(logits, bias_E, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.routed_scaling_factor,
                      interpret)
