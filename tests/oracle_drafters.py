"""Drafters with known acceptance for tests: the target's own greedy continuation, and its negation."""

import jax.numpy as jnp

from model.decoder import forward


def oracle_drafter(key, w, cfg, state, k, greedy, sp):
    """Propose exactly the target's greedy continuation (every draft must be accepted)."""
    cache, tok_B, lengths_B = state.target_cache, state.pending, state.target_cache.lengths
    drafts = []
    for j in range(k):
        out = forward(w.target, cfg.target, tok_B[:, None], (lengths_B + j)[:, None], cache)
        cache = out.cache
        tok_B = jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)
        drafts.append(tok_B)
    return jnp.stack(drafts, axis=1), None, state.draft_cache


def wrong_drafter(key, w, cfg, state, k, greedy, sp):
    """Propose a token that is never the target's argmax (every first draft must be rejected)."""
    drafts_BM, _, cache = oracle_drafter(key, w, cfg, state, k, greedy, sp)
    return (drafts_BM + 1) % cfg.target.vocab_size, None, cache


def drafts_right_for(k, row_B, cycle):
    """How many leading drafts `partial_oracle_drafter` gets right: 0..K, varying with the row and the cycle."""
    return (3 * row_B + cycle * (row_B + 1)) % (k + 1)


def partial_oracle_drafter(key, w, cfg, state, k, greedy, sp):
    """The target's greedy continuation for the first drafts_right_for(...) drafts, a never-argmax token after."""
    drafts_BM, _, cache = oracle_drafter(key, w, cfg, state, k, greedy, sp)
    right_B = drafts_right_for(k, jnp.arange(drafts_BM.shape[0]), state.cycles)
    wrong_BM = (drafts_BM + 1) % cfg.target.vocab_size
    return jnp.where(jnp.arange(k)[None] < right_B[:, None], drafts_BM, wrong_BM), None, cache
