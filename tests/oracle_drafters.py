"""Drafters with known acceptance for tests: the target's own greedy continuation, and its negation."""

import jax
import jax.numpy as jnp
import numpy as np

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


def looped_oracle_drafts(w, cfg, state, k):
    """`oracle_drafter`'s drafts from a loop over the K target steps (one step to compile, not K)."""
    lengths_B = state.target_cache.lengths

    def step(j, carry):
        cache, tok_B, drafts_BM = carry
        out = forward(w.target, cfg.target, tok_B[:, None], (lengths_B + j)[:, None], cache)
        tok_B = jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)
        return out.cache, tok_B, drafts_BM.at[:, j].set(tok_B)

    empty_BM = jnp.zeros((state.pending.shape[0], k), jnp.int32)
    return jax.lax.fori_loop(0, k, step, (state.target_cache, state.pending, empty_BM))[2]


class SwitchedDrafter:
    """The oracle, wrong and partial-oracle drafters behind one compiled program per K: each of them is the oracle's
    drafts with the first m kept and the rest made wrong (m = K, 0, or drafts_right_for), so the program computes
    the oracle's drafts once and asks the host which m to apply. A test switches drafters without compiling the
    prefill and the loop again for each (the engine keys its programs by the drafter object)."""

    NAMES = ("oracle", "wrong", "partial")

    def __init__(self):
        self.name = "oracle"

    def __call__(self, key, w, cfg, state, k, greedy, sp):
        drafts_BM, cache = looped_oracle_drafts(w, cfg, state, k), state.draft_cache
        mode = jax.pure_callback(lambda: np.int32(self.NAMES.index(self.name)), jax.ShapeDtypeStruct((), jnp.int32))
        partial_B = drafts_right_for(k, jnp.arange(drafts_BM.shape[0]), state.cycles)
        right_B = jnp.where(mode == 0, k, jnp.where(mode == 1, 0, partial_B))
        wrong_BM = (drafts_BM + 1) % cfg.target.vocab_size
        return jnp.where(jnp.arange(k)[None] < right_B[:, None], drafts_BM, wrong_BM), None, cache
