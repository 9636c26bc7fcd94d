"""The device side of a server's prefix cache: a pool of pages, each the caches of PAGE_TOKENS consecutive prompt
positions (the target's latent and rope key in every layer, and the draft's cache), and the two programs that move
pages between the pool and a batch-1 prefill's caches.

A prompt's full pages are saved into the pool once it is prefilled; a later prompt that starts with the same
pages (`jaxspec.serving.prefix_index.PrefixIndex` decides which) has them restored into the caches its prefill
starts from, and prefills only the rest. Each pool array holds a page's positions on its second axis whatever
the cache's layout (the draft's head-major [B, Nkv, S, D] included), so one gather or scatter over the first
axis moves whole pages. Page ids are data: one compiled program serves every hit length and every page.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from model.eagle3 import DraftCache
from model.kv_cache import CAPACITY_MULTIPLE

# Positions per page: the capacity of every cache is a multiple of it (model.kv_cache.round_capacity), so a
# cache is a whole number of pages.
PAGE_TOKENS = CAPACITY_MULTIPLE


@struct.dataclass
class PrefixPages:
    # one array per cache array (the target's latent per layer, its rope key per layer, the draft's arrays):
    # [pages, PAGE_TOKENS, ...] with the cache array's other axes after the position
    arrays: tuple[jax.Array, ...]

    @property
    def num_pages(self) -> int:
        return self.arrays[0].shape[0] if self.arrays else 0


def _cache_arrays(target_cache, draft_cache) -> list[tuple[jax.Array, int]]:
    """(array, its position axis) of every cache array a prompt's prefill writes, in a fixed order."""
    arrays = [(x, 1) for x in target_cache.latent] + [(x, 1) for x in target_cache.k_rope]
    if isinstance(draft_cache, DraftCache):
        arrays += [(draft_cache.k, 2), (draft_cache.v, 2)]
    elif draft_cache is not None:
        arrays += [(draft_cache.latent, 1), (draft_cache.k_rope, 1)]
    return arrays


def _with_arrays(target_cache, draft_cache, new: list[jax.Array]):
    n = len(target_cache.latent)
    target_cache = target_cache.replace(latent=tuple(new[:n]), k_rope=tuple(new[n : 2 * n]))
    if isinstance(draft_cache, DraftCache):
        draft_cache = draft_cache.replace(k=new[2 * n], v=new[2 * n + 1])
    elif draft_cache is not None:
        draft_cache = draft_cache.replace(latent=new[2 * n], k_rope=new[2 * n + 1])
    return target_cache, draft_cache


def _pages_of(cache_1SX: jax.Array, axis: int) -> jax.Array:
    """A batch-1 cache array -> its pages [S / PAGE_TOKENS, PAGE_TOKENS, ...other axes]."""
    x = jnp.moveaxis(cache_1SX[0], axis - 1, 0)
    return x.reshape(x.shape[0] // PAGE_TOKENS, PAGE_TOKENS, *x.shape[1:])


def _cache_of(pages_MPX: jax.Array, axis: int) -> jax.Array:
    """The inverse of `_pages_of`."""
    x = pages_MPX.reshape(-1, *pages_MPX.shape[2:])
    return jnp.moveaxis(x, 0, axis - 1)[None]


def init_prefix_pages(target_cache, draft_cache, num_pages: int) -> PrefixPages:
    """An empty pool of `num_pages` pages for caches shaped as these batch-1 ones (arrays or shapes)."""
    def page_shape(x, axis):  # the cache array's axes but batch and position
        return tuple(d for i, d in enumerate(x.shape) if i not in (0, axis))

    return PrefixPages(tuple(jnp.zeros((num_pages, PAGE_TOKENS, *page_shape(x, axis)), x.dtype)
                             for x, axis in _cache_arrays(target_cache, draft_cache)))


def save_pages(pool: PrefixPages, target_cache, draft_cache, page_ids_M: jax.Array) -> PrefixPages:
    """Page m of the batch-1 caches (positions m*P..(m+1)*P) into pool page page_ids_M[m]; ids past the pool
    (num_pages) write nothing. M is the caches' capacity / PAGE_TOKENS."""
    return PrefixPages(tuple(
        page.at[page_ids_M].set(_pages_of(x, axis).astype(page.dtype), mode="drop")
        for page, (x, axis) in zip(pool.arrays, _cache_arrays(target_cache, draft_cache))))


def restore_pages(pool: PrefixPages, target_cache, draft_cache, page_ids_M: jax.Array, hit_tokens: jax.Array):
    """The batch-1 caches with positions below `hit_tokens` (a whole number of pages) taken from pool pages
    page_ids_M[0], [1], ...; the rest as they were. Returns (target cache, draft cache)."""
    new = []
    for page, (x, axis) in zip(pool.arrays, _cache_arrays(target_cache, draft_cache)):
        taken = _cache_of(page[jnp.clip(page_ids_M, 0, page.shape[0] - 1)], axis).astype(x.dtype)
        hit_S = jnp.arange(x.shape[axis]) < hit_tokens
        new.append(jnp.where(hit_S.reshape((-1,) + (1,) * (x.ndim - axis - 1)), taken, x))
    return _with_arrays(target_cache, draft_cache, new)
