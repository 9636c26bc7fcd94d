"""What a batch of sequences carries from one speculative cycle to the next (all static shapes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from model.eagle3 import DraftCache, DraftLatentCache
from model.kv_cache import LatentCache


@struct.dataclass
class SpecState:
    target_cache: LatentCache  # lengths [B] = L: tokens committed to the target cache
    draft_cache: DraftCache | DraftLatentCache  # the Llama draft's K/V or the MLA draft's latent cache
    pending: jax.Array  # [B] int32: x_L, emitted but not yet run through the target
    draft_logits: jax.Array  # [B, Vd] float32: the draft's first proposal for the next cycle (position L-1)
    draft_hidden: jax.Array  # [B, H]: the draft's output at position L-1, the h of its second step
    done: jax.Array  # [B] bool
    generated: jax.Array  # [B] int32: tokens emitted so far (the prefill's first token included)
    out_tokens: jax.Array  # [B, N] int32: emitted tokens (N = max_new_tokens + K + 1)
    accepted_log: jax.Array  # [B, C] int32: drafts accepted in each cycle, -1 where no cycle ran
    cycles: jax.Array  # [] int32
    key: jax.Array  # PRNG key


@struct.dataclass
class BaselineState:
    target_cache: LatentCache
    pending: jax.Array  # [B] int32
    done: jax.Array
    generated: jax.Array
    out_tokens: jax.Array  # [B, N]
    steps: jax.Array  # [] int32
    key: jax.Array


def progress(state) -> tuple:
    """What streaming reads after a cycle: tokens emitted so far, the token buffer, which rows finished."""
    return state.generated, state.out_tokens, state.done


def new_tokens(progress_read, shown) -> list[list[int]]:
    """Each row's tokens emitted since `shown` (its count per row, advanced in place) from a progress read back on
    the host."""
    generated, out_tokens, _ = progress_read
    new = [out_tokens[i, shown[i]: generated[i]].tolist() for i in range(len(shown))]
    shown[:] = generated
    return new


def with_progress(step):
    """`step` that also returns its progress as separate arrays: the state is donated to the next cycle, queued
    before the host reads these."""
    def cycle(w, state, sp):
        state = step(w, state, sp)
        return state, jax.tree.map(jnp.copy, progress(state))

    return cycle
