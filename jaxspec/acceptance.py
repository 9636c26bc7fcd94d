"""Acceptance rules for a chain of K draft tokens verified by one target forward over K+1 positions.

Both return (accepted [B] in 0..K, emitted [B, K+1]): emitted[:, :accepted] are the accepted drafts,
emitted[:, accepted] the target's own token (correction or bonus); later entries are padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.sampling import sample


def _leading_true(ok_BM: jax.Array) -> jax.Array:
    return jnp.cumprod(ok_BM.astype(jnp.int32), axis=1).sum(axis=1)


def greedy_accept(drafts_BM: jax.Array, target_logits_BK1V: jax.Array):
    """Longest prefix where draft == target argmax, then the target's argmax at the first mismatch."""
    target_BK1 = jnp.argmax(target_logits_BK1V, axis=-1).astype(jnp.int32)
    accepted_B = _leading_true(drafts_BM == target_BK1[:, :-1])
    # with all drafts equal to the argmax up to `accepted`, the target's tokens ARE the emitted tokens
    return accepted_B, target_BK1


def speculative_sampling_accept(key, drafts_BM, draft_probs_BMV, target_probs_BK1V):
    """Lossless speculative sampling: accept d with prob min(1, p(d)/q(d)); on rejection sample from
    normalize(max(p - q, 0)); after K acceptances sample the bonus token from p."""
    b, k = drafts_BM.shape
    key_u, key_tok = jax.random.split(key)
    p_d = jnp.take_along_axis(target_probs_BK1V[:, :k], drafts_BM[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(draft_probs_BMV, drafts_BM[..., None], axis=-1)[..., 0]
    u_BM = jax.random.uniform(key_u, (b, k))
    accepted_B = _leading_true(u_BM * q_d < p_d)  # u < p/q without dividing by q
    p_n = jnp.take_along_axis(target_probs_BK1V, accepted_B[:, None, None], axis=1)[:, 0]
    q_padded = jnp.concatenate([draft_probs_BMV, jnp.zeros_like(draft_probs_BMV[:, :1])], axis=1)
    q_n = jnp.take_along_axis(q_padded, accepted_B[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_n - q_n, 0.0)
    mass = residual.sum(-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)  # all accepted: q_n = 0 -> p
    final_B = sample(key_tok, residual)
    emitted_BK1 = jnp.concatenate([drafts_BM, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted_BK1 = emitted_BK1.at[jnp.arange(b), accepted_B].set(final_B)
    return accepted_B, emitted_BK1
