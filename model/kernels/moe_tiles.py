"""What the Triton routed-experts kernels (moe_gather.py, moe_gemv.py) share: the tile configuration, its checks,
and the slots (which experts a step must read).

Slots: the unique experts of all T*K (token, choice) pairs, one slot each, so an expert chosen by several tokens is
read once (a verify of T tokens reads the union of their experts). Plain XLA, tiny arrays.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from model.quant import Int4Weight

MIN_TOKEN_TILE = 16  # Triton's dot needs every dimension >= 16


@dataclasses.dataclass(frozen=True)
class MoEKernelConfig:
    block_f: int = 32  # gate_up: rows of F per program
    block_h: int = 32  # down: rows of H per program
    block_k: int = 64  # words (int4) or elements (bf16) of the contracted dim per loop step and part
    num_warps: int = 4
    num_stages: int = 3
    variant: str = "mma"  # "mma": tensor-core dots (any T <= 128); "gemv": CUDA-core FMAs, moe_gemv.py
    scales: str = "gather"  # int4 group scales: "gather" one per word by index, "join" per group then repeated
    prefetch: bool = False  # gemv: issue the next step's loads before this step's arithmetic
    down_splits: int = 1  # down kernel: programs per block of H rows, each over a share of the slots
    slots: str = "unique"  # gemv: "unique" one slot per distinct expert, "pairs" one per (token, choice)


def token_tile(t: int) -> int:
    return max(MIN_TOKEN_TILE, 1 << (t - 1).bit_length())


def parts_of(w) -> int:
    return 8 if isinstance(w, Int4Weight) else 1


def weight_arrays(w) -> tuple[jax.Array, ...]:
    return (w.packed, w.scale) if isinstance(w, Int4Weight) else (w,)


def words_per_group(w) -> int:
    return w.group_size // 8 if isinstance(w, Int4Weight) else 1


def check_shapes(experts, cfg: MoEKernelConfig) -> None:
    """Raise ValueError when the tiles do not divide these expert shapes."""
    e, f, h = experts.gate.shape
    parts = parts_of(experts.gate)
    wpg = words_per_group(experts.gate)
    if wpg & (wpg - 1):
        raise ValueError(f"group size {experts.gate.group_size} must be 8 * a power of two")
    for name, n, b in (("F/parts", f // parts, cfg.block_f), ("F/parts", f // parts, cfg.block_k),
                       ("H/parts", h // parts, cfg.block_k), ("H", h, cfg.block_h)):
        if n % b or b % wpg:
            raise ValueError(f"{name}={n} is not a multiple of block {b} (or block not of whole groups)")
    if parts_of(experts.down) != parts:
        raise ValueError("gate/up and down must share one storage format")


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
