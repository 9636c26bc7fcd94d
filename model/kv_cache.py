"""The target's MLA latent cache: per layer, normalized latent [B, S, C] and roped shared key [B, S, R].

Slot s holds absolute position s. A forward writes its T new tokens at their positions and attends to
slots <= the query's position, so slots past a sequence's length (padding, rejected drafts) are never
read before they are overwritten.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from model.config import TextConfig


@struct.dataclass
class LatentCache:
    latent: tuple[jax.Array, ...]  # per layer [B, S, kv_lora_rank]
    k_rope: tuple[jax.Array, ...]  # per layer [B, S, qk_rope_head_dim]
    lengths: jax.Array  # [B] int32: committed tokens per sequence

    @property
    def capacity(self) -> int:
        return self.latent[0].shape[1]

    @property
    def batch(self) -> int:
        return self.latent[0].shape[0]


CAPACITY_MULTIPLE = 64  # the attention kernels step through the cache in blocks of up to 64 slots
# Longer caches go through XLA's attention (model.attention_mla: all but decode at batch 8), whose context GEMM at
# one sequence splits the slots into 64 chunks: with a capacity that is not a multiple of 64 x 8 XLA pads the
# whole latent cache of every layer first, every step
LONG_CAPACITY = 4096
LONG_CAPACITY_MULTIPLE = 512


def round_capacity(slots: int) -> int:
    """The cache capacity the engine allocates for `slots` positions."""
    multiple = LONG_CAPACITY_MULTIPLE if slots > LONG_CAPACITY else CAPACITY_MULTIPLE
    return -(-slots // multiple) * multiple


def init_latent_cache(cfg: TextConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> LatentCache:
    zeros = lambda d: jnp.zeros((batch, capacity, d), dtype)  # noqa: E731
    n = cfg.num_hidden_layers
    return LatentCache(
        latent=tuple(zeros(cfg.kv_lora_rank) for _ in range(n)),
        k_rope=tuple(zeros(cfg.qk_rope_head_dim) for _ in range(n)),
        lengths=jnp.zeros((batch,), jnp.int32),
    )


def write_slots(cache: jax.Array, new_BTX: jax.Array, positions_BT: jax.Array, slot_axis: int = 1) -> jax.Array:
    """Store token t of sequence b at slot positions[b, t] of `cache` ([B, S, X..] or, with `slot_axis` = 2, the
    draft's head-major [B, Nkv, S, D]); `new_BTX` is [B, T, X..] either way (slots past the capacity are dropped)."""
    batch_B1 = jnp.arange(cache.shape[0])[:, None]
    # with axes between them the two advanced indices still lead the indexed shape: [B, T, Nkv, D]
    index = (batch_B1, *[slice(None)] * (slot_axis - 1), positions_BT)
    return cache.at[index].set(new_BTX.astype(cache.dtype), mode="drop")


def visible_slots(positions_BT: jax.Array, capacity: int) -> jax.Array:
    """[B, T, S] bool: query (b, t) may attend slot s iff s <= its position (causal + past-length mask)."""
    return jnp.arange(capacity)[None, None, :] <= positions_BT[:, :, None]
