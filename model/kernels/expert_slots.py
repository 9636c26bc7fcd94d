"""Which experts a step must read: the unique experts of all T*K (token, choice) pairs, one slot each.

The fused MoE kernel runs one pass over each slot's expert, so an expert chosen by several tokens is read
once (verify of T tokens reads the union of their experts, REFERENCE.md section 8). Plain XLA, tiny arrays.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class ExpertSlots(NamedTuple):
    expert_U: jax.Array  # [U] int32: expert id per slot, ascending; slots >= num_used hold 0 and are skipped
    num_used: jax.Array  # [1] int32: distinct experts among the T*K choices
    combine_UT: jax.Array  # [U, Tp] float32: routing weight of token t for slot u's expert (0 if not chosen)


def expert_slots(ids_TK: jax.Array, weights_TK: jax.Array, num_slots: int, tokens_padded: int) -> ExpertSlots:
    t = ids_TK.shape[0]
    sorted_P = jnp.sort(ids_TK.reshape(-1))
    first_P = jnp.concatenate([jnp.ones((1,), bool), sorted_P[1:] != sorted_P[:-1]])
    slot_P = jnp.cumsum(first_P) - 1  # slot of each sorted pair; duplicates share their expert's slot
    num_used = jnp.sum(first_P).astype(jnp.int32)
    # duplicates write the same id to the same slot; slots past num_used keep 0 and are never read
    expert_U = jnp.zeros((num_slots,), jnp.int32).at[slot_P].set(sorted_P.astype(jnp.int32), mode="drop")
    used_U = jnp.arange(num_slots) < num_used
    chosen_UTK = (expert_U[:, None, None] == ids_TK[None]) & used_U[:, None, None]
    combine_UT = jnp.sum(jnp.where(chosen_UTK, weights_TK.astype(jnp.float32)[None], 0.0), axis=-1)
    combine_UT = jnp.pad(combine_UT, ((0, 0), (0, tokens_padded - t)))
    return ExpertSlots(expert_U, num_used.reshape(1), combine_UT)


def split_range(num_used_ref, split, slots_per_split: int):
    """Inside a kernel: (first slot, number of used slots) of program `split`; 0 slots past the used ones."""
    first = split * slots_per_split
    return first, jnp.clip(num_used_ref[0] - first, 0, slots_per_split)
