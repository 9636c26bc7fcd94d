"""Greedy continuations by the target: the sequences a greedy chain-drafting engine actually verifies.

Prefill the prompt through the latent cache, then one token per step inside `lax.fori_loop`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.training.casting import compute_copy
from model.config import TextConfig
from model.decoder import forward
from model.kv_cache import init_latent_cache


@functools.partial(jax.jit, static_argnames=("cfg", "total_len", "dtype"))
def greedy_continue(weights, prompts_BT, *, cfg: TextConfig, total_len: int, dtype=jnp.bfloat16):
    """[B, P] prompts -> [B, total_len] tokens: the prompt, then the target's argmax token at each step."""
    w = compute_copy(weights, dtype)
    b, p = prompts_BT.shape
    cache = init_latent_cache(cfg, b, total_len, dtype)
    positions_BT = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    out = forward(w, cfg, prompts_BT, positions_BT, cache, logits_at=jnp.full((b,), p - 1, jnp.int32))
    tokens_BT = jnp.zeros((b, total_len), jnp.int32).at[:, :p].set(prompts_BT)
    tokens_BT = tokens_BT.at[:, p].set(jnp.argmax(out.logits[:, 0], -1).astype(jnp.int32))

    def step(pos, carry):
        tokens_BT, cache = carry
        tok_B1 = jax.lax.dynamic_slice_in_dim(tokens_BT, pos, 1, axis=1)
        o = forward(w, cfg, tok_B1, jnp.full((b, 1), pos, jnp.int32), cache)
        nxt_B1 = jnp.argmax(o.logits, -1).astype(jnp.int32)
        return jax.lax.dynamic_update_slice_in_dim(tokens_BT, nxt_B1, pos + 1, axis=1), o.cache

    tokens_BT, _ = jax.lax.fori_loop(p, total_len - 1, step, (tokens_BT, out.cache))
    return tokens_BT
