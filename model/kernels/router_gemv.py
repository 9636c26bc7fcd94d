"""Router logits for decode and verify: a Pallas (Triton) GEMV over the [E, H] router (bf16 as Kimi stores it, or
float32), split over H.

Plain reference: the einsum in `model.router.route` (float32, Precision.HIGHEST). Why: at 2-8 tokens XLA
runs it as a split-K GEMM plus a reduction launch, several times the router's byte floor, because the [T, 384]
output gives its tiles little to share out. Here program (block of E rows, split of H) reads its
[block_e, H / splits] share once and multiplies it in float32 (exact products, as HIGHEST) into every
token's partial sum; the top-k kernel (router_topk.py) adds the splits' partials as it loads the logits, so the
logits never exist as a separate array.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton


# Outside [MIN_TOKENS, MAX_TOKENS] XLA's einsum runs: at one token it is a single reduction as fast as the GEMV,
# above eight tokens a GEMM.
MIN_TOKENS = 2
MAX_TOKENS = 8
BLOCK_E = 16  # router rows per program
BLOCK_K = 256  # hidden elements per loop step
# Loop steps per program. 1: H = 7168 gives 28 splits, 24 x 28 = 672 programs of 16 KB, each load issued at once.
STEPS = 1


def tiles(experts: int, hidden: int) -> tuple[int, int, int]:
    """(block_e, block_k, splits) for these shapes: the defaults, shrunk to powers of two that divide them."""
    block_e = math.gcd(experts, BLOCK_E)
    block_k = math.gcd(hidden, BLOCK_K)
    steps = hidden // block_k
    splits = steps // STEPS if steps % STEPS == 0 else steps
    return block_e, block_k, splits


def _gemv_kernel(x_ref, w_ref, out_ref, *, tokens, block_e, block_k, steps):
    e0 = pl.program_id(0) * block_e
    k_first = pl.program_id(1) * steps * block_k

    def step(i, accs):
        # reduced every step: the loop is short, and [block_e] sums keep up to 8 tokens in few registers
        k0 = k_first + i * block_k
        w = w_ref[pl.ds(e0, block_e), pl.ds(k0, block_k)].astype(jnp.float32)
        return tuple(a + jnp.sum(w * x_ref[t, pl.ds(k0, block_k)].astype(jnp.float32)[None, :], axis=1)
                     for t, a in enumerate(accs))

    zeros = tuple(jnp.zeros((block_e,), jnp.float32) for _ in range(tokens))
    accs = jax.lax.fori_loop(0, steps, step, zeros)
    for t, a in enumerate(accs):
        out_ref[pl.program_id(1), t, pl.ds(e0, block_e)] = a


def _partials(x_TH, router_EH, interpret):
    t, hidden = x_TH.shape
    experts = router_EH.shape[0]
    block_e, block_k, splits = tiles(experts, hidden)
    steps = hidden // block_k // splits
    kernel = functools.partial(_gemv_kernel, tokens=t, block_e=block_e, block_k=block_k, steps=steps)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, t, experts), jnp.float32),
        grid=(experts // block_e, splits),
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="router_gemv",
    )(x_TH, router_EH)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def router_logit_partials(x_TH: jax.Array, router_EH: jax.Array, interpret: bool = False) -> jax.Array:
    """[S, T, E] float32 partial logits whose sum over S is x @ router.T; T <= MAX_TOKENS.

    Differentiable like the einsum it replaces (training can route on a GPU)."""
    if x_TH.shape[0] > MAX_TOKENS:
        raise ValueError(f"router_logit_partials takes at most {MAX_TOKENS} tokens, got {x_TH.shape[0]}")
    return _partials(x_TH, router_EH, interpret)


def _fwd(x_TH, router_EH, interpret):
    return _partials(x_TH, router_EH, interpret), (x_TH, router_EH)


def _bwd(interpret, res, g_ZTE):
    """Partial s is x[:, chunk s] @ router[:, chunk s].T: each chunk of H gets its own split's cotangent."""
    x_TH, router_EH = res
    s, t, e = g_ZTE.shape
    hi = jax.lax.Precision.HIGHEST
    x_TZH = x_TH.astype(jnp.float32).reshape(t, s, -1)
    router_EZH = router_EH.astype(jnp.float32).reshape(e, s, -1)
    dx = jnp.einsum("ste,esc->tsc", g_ZTE, router_EZH, precision=hi).reshape(x_TH.shape).astype(x_TH.dtype)
    drouter = jnp.einsum("ste,tsc->esc", g_ZTE, x_TZH, precision=hi).reshape(router_EH.shape).astype(router_EH.dtype)
    return dx, drouter


router_logit_partials.defvjp(_fwd, _bwd)
