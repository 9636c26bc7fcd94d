"""`noaux_tc` top-k routing (one expert group) after the router GEMV: a Pallas (Triton) kernel, one program per token.

Plain reference: `model.router.route` from the logits on (sigmoid, bias-corrected choice, top-k, unbiased
weights, normalisation, scaling). Why: XLA runs that as ~5 launches per MoE layer on a GPU (bias add, a
sort kernel, the weights' gather, sum, scale), where the work is a few hundred floats per token. The kernel keeps a token's E scores in registers and takes
the k largest by k rounds of max / lowest index of the max / mask, the order and tie rule of `lax.top_k`.
Group-limited routing (n_group > 1, DeepSeek-V3) stays on the XLA path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from model.router_weights import chosen_weights


# Warps per token's program (one warp, shuffles only, ran as fast: docs/performance.md).
NUM_WARPS = 4


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _topk_kernel(logits_ref, bias_ref, w_ref, ids_ref, *, experts, k, norm, scale):
    """Token t's k choices. Each round is two reductions over the token's block (the best value, the lowest index
    holding it); the chosen experts' scores are gathered once after the rounds, all k in one reduction. On a GPU
    the block of the next power of two past E loads its missing experts masked (the interpreter pads them)."""
    t = pl.program_id(0)
    width = _next_pow2(experts)
    idx_E = jnp.arange(width, dtype=jnp.int32)
    real_E = idx_E < experts
    block = pl.ds(0, width)
    logit_E = functools.reduce(jnp.add, [pl_triton.load(logits_ref.at[jnp.int32(s), t, block], mask=real_E, other=0.0)
                                         for s in range(logits_ref.shape[0])])  # the router GEMV's split partials
    score_E = jax.nn.sigmoid(logit_E)
    choice_E = jnp.where(real_E, score_E + pl_triton.load(bias_ref.at[block], mask=real_E, other=0.0), -jnp.inf)
    k_pad = _next_pow2(k)
    slot_K = jnp.arange(k_pad, dtype=jnp.int32)
    ids_K = jnp.zeros((k_pad,), jnp.int32)
    for j in range(k):
        best = jnp.max(choice_E)
        i = jnp.min(jnp.where(choice_E == best, idx_E, width))  # the lowest index among equals, as lax.top_k
        ids_K = jnp.where(slot_K == j, i, ids_K)
        choice_E = jnp.where(idx_E == i, -jnp.inf, choice_E)
    chosen_KE = (idx_E[None, :] == ids_K[:, None]) & (slot_K < k)[:, None]
    w_K = jnp.sum(jnp.where(chosen_KE, score_E[None, :], 0.0), axis=1)  # the padding slots hold 0
    if norm:
        w_K = w_K / (jnp.sum(w_K) + 1e-20)
    w_ref[t, :] = w_K * scale
    ids_ref[t, :] = ids_K


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def route_topk(logits_TE: jax.Array, bias_E: jax.Array, k: int, norm_topk_prob: bool, scaling: float,
               interpret: bool = False):
    """(weights [T, k] float32, expert ids [T, k] int32) from router logits [T, E], as `model.router.route`.

    The logits may also come as [P, T, E] partial sums over P (router_gemv.py), added here as they load.
    Differentiable in the logits like the XLA path (the bias only chooses, so it gets no gradient)."""
    return _route_topk(logits_TE, bias_E, k, norm_topk_prob, scaling, interpret)


def _route_topk_fwd(logits_TE, bias_E, k, norm_topk_prob, scaling, interpret):
    w_TK, ids_TK = _route_topk(logits_TE, bias_E, k, norm_topk_prob, scaling, interpret)
    return (w_TK, ids_TK), (logits_TE, bias_E, ids_TK)


def _route_topk_bwd(k, norm_topk_prob, scaling, interpret, res, cotangents):
    logits_TE, bias_E, ids_TK = res
    # the XLA path's weights: its gradient is the reference's
    summed_TE = logits_TE.sum(0) if logits_TE.ndim == 3 else logits_TE  # partials: each split adds with weight 1
    _, pullback = jax.vjp(lambda lg: chosen_weights(jax.nn.sigmoid(lg.astype(jnp.float32)), ids_TK, norm_topk_prob,
                                                    scaling), summed_TE)
    g_TE = pullback(cotangents[0])[0]
    return jnp.broadcast_to(g_TE, logits_TE.shape).astype(logits_TE.dtype), jnp.zeros_like(bias_E)


route_topk.defvjp(_route_topk_fwd, _route_topk_bwd)


def _route_topk(logits_TE, bias_E, k, norm_topk_prob, scaling, interpret):
    partials_ZTE = logits_TE if logits_TE.ndim == 3 else logits_TE[None]
    _, t, e = partials_ZTE.shape
    k_pad = _next_pow2(k)
    bias_E = bias_E.astype(jnp.float32)
    if interpret and e != _next_pow2(e):  # the interpreter cannot load past an array's end
        partials_ZTE = jnp.pad(partials_ZTE, ((0, 0), (0, 0), (0, _next_pow2(e) - e)))
        bias_E = jnp.pad(bias_E, (0, _next_pow2(e) - e))
    kernel = functools.partial(_topk_kernel, experts=e, k=k, norm=norm_topk_prob, scale=float(scaling))
    w_TK, ids_TK = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((t, k_pad), jnp.float32), jax.ShapeDtypeStruct((t, k_pad), jnp.int32)),
        grid=(t,),
        compiler_params=pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="router_topk",
    )(partials_ZTE.astype(jnp.float32), bias_E)
    return w_TK[:, :k], ids_TK[:, :k]  # a no-op for k = 8 (every Kimi / DeepSeek config)
