"""What a batch of sequences carries from one speculative cycle to the next (all static shapes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
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


def progress(state) -> jax.Array:
    """What streaming reads after a cycle, as one int32 array: per row the tokens emitted so far and whether it
    finished, then the token buffer. On a GPU each array read back costs its own transfer and wait."""
    return jnp.concatenate([state.generated.astype(jnp.int32), state.done.astype(jnp.int32),
                            state.out_tokens.astype(jnp.int32).reshape(-1)])


def on_host(x: jax.Array) -> jax.Array:
    """`x` written by the program itself into the host's memory, for the host to read once the program ends. On a
    GPU the first read of a device array after a device loop costs several times the wait for the loop's end, where
    an array the program left in host memory is there when it ends (docs/performance.md, "What reading a call's
    result costs"). A mesh program's output sharding keeps it in host memory (`jaxspec.sharded.lower_program`)."""
    return jax.device_put(x, jax.memory.Space.Host)


def read_progress(progress_read, b: int) -> tuple:
    """`progress` read back on the host for `b` rows: (generated_B, out_tokens_BN, done_B) as numpy."""
    read = np.asarray(progress_read)
    return read[:b].astype(np.int64), read[2 * b:].reshape(b, -1), read[b:2 * b].astype(bool)


def new_tokens(progress_read, shown) -> list[list[int]]:
    """Each row's tokens emitted since `shown` (its count per row, advanced in place) from a progress read back on
    the host (`read_progress`)."""
    generated, out_tokens, _ = progress_read
    new = [out_tokens[i, shown[i]: generated[i]].tolist() for i in range(len(shown))]
    shown[:] = generated
    return new


def loop_with_progress(step):
    """`step` in a device loop until every row is done; returns the state and its progress in the host's memory
    (`on_host`), which the host reads once the loop ends."""
    def loop(w, state, sp):
        state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: step(w, s, sp), state)
        return state, on_host(progress(state))

    return loop


def with_progress(step):
    """`step` that also returns its progress (a new array in host memory, `on_host`: the state is donated to the
    next cycle, queued before the host reads this)."""
    def cycle(w, state, sp):
        state = step(w, state, sp)
        return state, on_host(progress(state))

    return cycle
