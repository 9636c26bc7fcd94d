"""Oracle drafters for the greedy tests that compile less than tests/oracle_drafters.py's: the target's K greedy
steps in a loop (one step to compile, not K), and the oracle, wrong and partial-oracle drafters behind one program."""

import jax
import jax.numpy as jnp
import numpy as np

from model.decoder import forward
from tests.oracle_drafters import drafts_right_for


def looped_oracle_drafts(w, cfg, state, k):
    """tests.oracle_drafters.oracle_drafter's drafts (the target's greedy continuation) from a loop over the K
    target steps: one step to compile, not K."""
    lengths_B = state.target_cache.lengths

    def step(j, carry):
        cache, tok_B, drafts_BM = carry
        out = forward(w.target, cfg.target, tok_B[:, None], (lengths_B + j)[:, None], cache)
        tok_B = jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)
        return out.cache, tok_B, drafts_BM.at[:, j].set(tok_B)

    empty_BM = jnp.zeros((state.pending.shape[0], k), jnp.int32)
    return jax.lax.fori_loop(0, k, step, (state.target_cache, state.pending, empty_BM))[2]


class SwitchedDrafter:
    """tests.oracle_drafters' oracle, wrong and partial-oracle drafters behind one compiled program per K: each is
    the oracle's drafts with the first m kept and the rest made wrong (m = K, 0, or drafts_right_for), so the
    program computes the oracle's drafts once and asks the host which m applies. Tests switch drafters without
    compiling the prefill and the loop again for each (the engine keys its programs by the drafter object)."""

    NAMES = ("oracle", "wrong", "partial")

    def __init__(self):
        self.name = "oracle"

    def __call__(self, key, w, cfg, state, k, greedy, sp):
        drafts_BM = looped_oracle_drafts(w, cfg, state, k)
        mode = jax.pure_callback(lambda: np.int32(self.NAMES.index(self.name)), jax.ShapeDtypeStruct((), jnp.int32))
        partial_B = drafts_right_for(k, jnp.arange(drafts_BM.shape[0]), state.cycles)
        right_B = jnp.where(mode == 0, k, jnp.where(mode == 1, 0, partial_B))
        wrong_BM = (drafts_BM + 1) % cfg.target.vocab_size
        return jnp.where(jnp.arange(k)[None] < right_B[:, None], drafts_BM, wrong_BM), None, state.draft_cache


def looped_oracle_drafter(key, w, cfg, state, k, greedy, sp):
    """tests.oracle_drafters.oracle_drafter (every draft is accepted), its K target steps in a loop."""
    return looped_oracle_drafts(w, cfg, state, k), None, state.draft_cache
