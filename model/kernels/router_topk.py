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


def _pow2_chunks(n: int) -> list[tuple[int, int]]:
    """(offset, size) pieces of 0..n with power-of-two sizes (Triton blocks): 384 -> (0, 256), (256, 128)."""
    out, off = [], 0
    for bit in reversed(range(n.bit_length())):
        if n >> bit & 1:
            out.append((off, 1 << bit))
            off += 1 << bit
    return out


def _logits(logits_ref, t, off, size):
    """Token t's logits [off, off + size): the sum of the router GEMV's split partials ([S, T, E])."""
    return functools.reduce(jnp.add, [logits_ref[s, t, pl.ds(off, size)] for s in range(logits_ref.shape[0])])


def _topk_kernel(logits_ref, bias_ref, w_ref, ids_ref, *, experts, k, norm, scale):
    t = pl.program_id(0)
    chunks = _pow2_chunks(experts)  # E need not be a power of two: no masks, no padded copies
    idx = [off + jnp.arange(size, dtype=jnp.int32) for off, size in chunks]
    score = [jax.nn.sigmoid(_logits(logits_ref, t, off, size)) for off, size in chunks]
    choice = [s + bias_ref[pl.ds(off, size)] for s, (off, size) in zip(score, chunks)]
    k_pad = _next_pow2(k)
    slot_K = jnp.arange(k_pad, dtype=jnp.int32)
    ids_K = jnp.zeros((k_pad,), jnp.int32)
    w_K = jnp.zeros((k_pad,), jnp.float32)
    for j in range(k):
        best = functools.reduce(jnp.maximum, [jnp.max(c) for c in choice])
        # the lowest index among equals, as lax.top_k
        i = functools.reduce(jnp.minimum, [jnp.min(jnp.where(c == best, x, experts)) for c, x in zip(choice, idx)])
        w = functools.reduce(jnp.add, [jnp.sum(jnp.where(x == i, s, 0.0)) for s, x in zip(score, idx)])
        ids_K = jnp.where(slot_K == j, i, ids_K)
        w_K = jnp.where(slot_K == j, w, w_K)
        choice = [jnp.where(x == i, -jnp.inf, c) for c, x in zip(choice, idx)]
    if norm:
        w_K = w_K / (jnp.sum(w_K) + 1e-20)  # the padding slots hold 0
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
    kernel = functools.partial(_topk_kernel, experts=e, k=k, norm=norm_topk_prob, scale=float(scaling))
    w_TK, ids_TK = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((t, k_pad), jnp.float32), jax.ShapeDtypeStruct((t, k_pad), jnp.int32)),
        grid=(t,),
        compiler_params=pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="router_topk",
    )(partials_ZTE.astype(jnp.float32), bias_E.astype(jnp.float32))
    return w_TK[:, :k], ids_TK[:, :k]  # a no-op for k = 8 (every Kimi / DeepSeek config)
