"""The target's MLA latent cache: per layer, normalized latent [B, S, C] and roped shared key [B, S, R].

Paged (`pages_BM` set, the server's slots): per layer a pool of pages [N, P, C] / [N, P, R] shared by every
sequence, and a block table [B, M] naming the pool page that holds positions m*P..(m+1)*P of sequence b (N where
none is: writes there are dropped, reads see zeros that the causal mask hides). A sequence's pages are read into
the contiguous [B, M*P, C] view attention takes, so every attention path runs unchanged over the same capacity; only
the pages a sequence holds cost memory.

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
    pages_BM: jax.Array | None = None  # [B, M] int32 block table when paged (latent / k_rope are then pools)

    @property
    def capacity(self) -> int:
        if self.pages_BM is not None:
            return self.pages_BM.shape[1] * self.latent[0].shape[1]
        return self.latent[0].shape[1]

    @property
    def batch(self) -> int:
        return self.latent[0].shape[0] if self.pages_BM is None else self.pages_BM.shape[0]


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


def _per_layer(cfg: TextConfig, lead: tuple[int, int], dtype) -> dict:
    """Every layer's latent and rope-key arrays of shape lead + (C | R,), zeros."""
    zeros = lambda d: jnp.zeros((*lead, d), dtype)  # noqa: E731
    n = cfg.num_hidden_layers
    return dict(latent=tuple(zeros(cfg.kv_lora_rank) for _ in range(n)),
                k_rope=tuple(zeros(cfg.qk_rope_head_dim) for _ in range(n)))


def init_latent_cache(cfg: TextConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> LatentCache:
    return LatentCache(**_per_layer(cfg, (batch, capacity), dtype), lengths=jnp.zeros((batch,), jnp.int32))


def init_paged_latent_cache(cfg: TextConfig, batch: int, capacity: int, num_pages: int, page_tokens: int,
                            dtype=jnp.bfloat16) -> LatentCache:
    """`batch` sequences of up to `capacity` positions (a multiple of `page_tokens`) over a pool of `num_pages`
    pages per layer; no sequence holds a page yet."""
    return LatentCache(**_per_layer(cfg, (num_pages, page_tokens), dtype), lengths=jnp.zeros((batch,), jnp.int32),
                       pages_BM=jnp.full((batch, capacity // page_tokens), num_pages, jnp.int32))


def write_pages(pool_NPX: jax.Array, new_BTX: jax.Array, positions_BT: jax.Array, pages_BM: jax.Array) -> jax.Array:
    """Store token t of sequence b at position positions[b, t] of its pages (dropped where it holds none, or past
    its table)."""
    page_tokens = pool_NPX.shape[1]
    page_BT = jnp.take_along_axis(pages_BM, positions_BT // page_tokens, axis=1, mode="fill",
                                  fill_value=pool_NPX.shape[0])
    return pool_NPX.at[page_BT, positions_BT % page_tokens].set(new_BTX.astype(pool_NPX.dtype), mode="drop")


def read_pages(pool_NPX: jax.Array, pages_BM: jax.Array) -> jax.Array:
    """Each sequence's pages as its contiguous cache [B, M*P, X] (zeros where it holds none)."""
    pages_BMPX = jnp.take(pool_NPX, pages_BM, axis=0, mode="fill", fill_value=0)
    b, m, p = pages_BMPX.shape[:3]
    return pages_BMPX.reshape(b, m * p, *pool_NPX.shape[2:])


def write_head_major_pages(pool_NKPD: jax.Array, new_BTKD: jax.Array, positions_BT: jax.Array,
                           pages_BM: jax.Array) -> jax.Array:
    """`write_pages` for a head-major pool [N, Nkv, P, D] (the Llama draft's paged K or V): token t of sequence b,
    [Nkv, D], at position positions[b, t] of its pages (dropped where it holds none, or past its table)."""
    page_tokens = pool_NKPD.shape[2]
    page_BT = jnp.take_along_axis(pages_BM, positions_BT // page_tokens, axis=1, mode="fill",
                                  fill_value=pool_NKPD.shape[0])
    # the head axis between the two advanced indices: they still lead the indexed shape, [B, T, Nkv, D]
    return pool_NKPD.at[page_BT, :, positions_BT % page_tokens].set(new_BTKD.astype(pool_NKPD.dtype), mode="drop")


def read_head_major_pages(pool_NKPD: jax.Array, pages_BM: jax.Array) -> jax.Array:
    """Each sequence's pages of a head-major pool as its contiguous head-major cache [B, Nkv, M*P, D] (zeros where
    it holds none). One gather lands the pages head-major, so no transpose of the cache follows it."""
    n, nkv, p, d = pool_NKPD.shape
    heads_K = jnp.arange(nkv)
    pages_BKMPD = pool_NKPD.at[pages_BM[:, None, :], heads_K[None, :, None]].get(mode="fill", fill_value=0)
    b, _, m = pages_BKMPD.shape[:3]
    return pages_BKMPD.reshape(b, nkv, m * p, d)


def write_slots(cache: jax.Array, new_BTX: jax.Array, positions_BT: jax.Array, slot_axis: int = 1) -> jax.Array:
    """Store token t of sequence b at slot positions[b, t] of `cache` ([B, S, X..] or, with `slot_axis` = 2, the
    draft's head-major [B, Nkv, S, D]); `new_BTX` is [B, T, X..] either way. Slots past the capacity are dropped
    (a padded prompt chunk longer than the cache holds writes there), except as below.

    One token of one sequence (decode, a draft step) is stored by one in-place dynamic_update_slice: XLA lowers a
    scatter, whatever its mode, to an update that first reads back the slot it overwrites so that it can keep it
    where the index is out of range, and that read is a kernel of its own per cache and layer at every step. Past
    the capacity that write lands on the last slot instead of being dropped. Only a finished sequence gets there:
    the engine's capacity holds every live row's verify run, and prompts are written in chunks of 16 or more, so
    their padding past the capacity is dropped by the scatter."""
    if cache.shape[0] == 1 and new_BTX.shape[1] == 1:
        update = jnp.moveaxis(new_BTX, 1, slot_axis).astype(cache.dtype)
        start = [jnp.zeros((), jnp.int32)] * cache.ndim
        start[slot_axis] = positions_BT[0, 0].astype(jnp.int32)
        return jax.lax.dynamic_update_slice(cache, update, start)
    batch_B1 = jnp.arange(cache.shape[0])[:, None]
    # with axes between them the two advanced indices still lead the indexed shape: [B, T, Nkv, D]
    index = (batch_B1, *[slice(None)] * (slot_axis - 1), positions_BT)
    return cache.at[index].set(new_BTX.astype(cache.dtype), mode="drop")


def visible_slots(positions_BT: jax.Array, capacity: int) -> jax.Array:
    """[B, T, S] bool: query (b, t) may attend slot s iff s <= its position (causal + past-length mask)."""
    return jnp.arange(capacity)[None, None, :] <= positions_BT[:, :, None]
