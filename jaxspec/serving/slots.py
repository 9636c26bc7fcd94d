"""The state of a fixed number of batch slots, each an independent sequence (or idle), and how a prompt
prefilled at batch 1 enters one slot.

Every per-slot value has the slot on axis 0, so inserting a prompt is one dynamic_update_slice per array at a
traced slot index: one compiled program serves every slot. An idle slot is `done`; the cycle still computes it
(static shapes) but commits nothing for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.models import SpecConfig
from model.eagle3 import DraftCache, DraftLatentCache, init_draft_cache, init_paged_draft_cache
from model.kv_cache import LatentCache, init_latent_cache, init_paged_latent_cache


@struct.dataclass
class SlotState:
    target_cache: LatentCache  # lengths [B]: tokens committed per slot
    # None when the server does not speculate; pools when the target cache is paged, read through its block table
    draft_cache: DraftCache | DraftLatentCache | None
    pending: jax.Array  # [B] int32: the last emitted token, not yet run through the target
    draft_logits: jax.Array  # [B, Vd] float32 ([B, 0] without a draft)
    draft_hidden: jax.Array  # [B, H] ([B, 0] without a draft)
    done: jax.Array  # [B] bool: finished, cancelled or idle
    generated: jax.Array  # [B] int32: tokens emitted for the slot's request (the prefill's first included)
    max_new: jax.Array  # [B] int32: the request's token budget
    greedy: jax.Array  # [B] bool: argmax decoding (temperature 0)
    temperature: jax.Array  # [B] float32 (> 0; unused where greedy)
    top_k: jax.Array  # [B] int32 (0 = off)
    top_p: jax.Array  # [B] float32 (1 = off)
    key_data: jax.Array  # [B, ...] uint32: each slot's own PRNG key, so its draws do not depend on its neighbours

    @property
    def batch(self) -> int:
        return self.pending.shape[0]

    def sampling(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.temperature, self.top_k, self.top_p


def init_slots(cfg: SpecConfig, weights, batch: int, capacity: int, dtype, with_draft: bool,
               cache_pages: int | None = None, page_tokens: int = 0) -> SlotState:
    """`batch` idle slots with caches of `capacity` positions; with `cache_pages`, the target's cache is a pool of
    that many pages of `page_tokens` shared by the slots (model.kv_cache), none held yet, and so is the draft's:
    its pages are read through the target cache's block table, so a slot's page ids name its pages in both."""
    key_data = jax.random.key_data(jax.random.split(jax.random.key(0), batch))
    if with_draft:
        head = weights.target.lm_head if weights.draft.lm_head is None else weights.draft.lm_head
        embed = weights.target.embed if weights.draft.embed is None else weights.draft.embed
        draft_cache = (init_draft_cache(cfg.draft, batch, capacity, dtype) if cache_pages is None else
                       init_paged_draft_cache(cfg.draft, cache_pages, page_tokens, dtype))
        draft_logits = jnp.zeros((batch, head.shape[0]), jnp.float32)
        draft_hidden = jnp.zeros((batch, cfg.draft.hidden_size), embed.dtype)
    else:
        draft_cache, draft_logits, draft_hidden = None, jnp.zeros((batch, 0), jnp.float32), jnp.zeros((batch, 0), dtype)
    return SlotState(
        target_cache=(init_latent_cache(cfg.target, batch, capacity, dtype) if cache_pages is None else
                      init_paged_latent_cache(cfg.target, batch, capacity, cache_pages, page_tokens, dtype)),
        draft_cache=draft_cache,
        pending=jnp.zeros((batch,), jnp.int32),
        draft_logits=draft_logits,
        draft_hidden=draft_hidden,
        done=jnp.ones((batch,), bool),
        generated=jnp.zeros((batch,), jnp.int32),
        max_new=jnp.zeros((batch,), jnp.int32),
        greedy=jnp.ones((batch,), bool),
        temperature=jnp.ones((batch,), jnp.float32),
        top_k=jnp.zeros((batch,), jnp.int32),
        top_p=jnp.ones((batch,), jnp.float32),
        key_data=key_data,
    )


def insert_prefilled(slots: SlotState, one, slot, max_new, greedy, temperature, top_k, top_p, pages_M=None, *,
                     eos_ids: tuple[int, ...]) -> SlotState:
    """Slot `slot` takes over the batch-1 prefill state `one` (jaxspec.state.SpecState or BaselineState, with
    caches of the slots' capacity) and the request's budget and sampling values (all traced scalars). A paged
    cache takes the slot's pages `pages_M` [M] (the pool's size where it holds none) as its table row, and the
    prefilled positions of the target's and the draft's caches into them."""
    def put(all_X, one_X):
        return jax.lax.dynamic_update_slice_in_dim(all_X, one_X.astype(all_X.dtype), slot, axis=0)

    def put_pages(pool_NX, one_1X, position_axis=1):
        """The batch-1 cache's page m into pool page pages_M[m]. `position_axis`: where both hold positions (1 in
        [1, S, X] and [N, P, X]; 2 in the draft's head-major [1, Nkv, S, D] and [N, Nkv, P, D])."""
        one_X, a = one_1X[0], position_axis - 1
        # positions -> (page, position in the page), the page leading as in the pool
        split = one_X.reshape(*one_X.shape[:a], -1, pool_NX.shape[position_axis], *one_X.shape[a + 1:])
        return pool_NX.at[pages_M].set(jnp.moveaxis(split, a, 0).astype(pool_NX.dtype), mode="drop")

    first = one.pending[0]
    done = max_new <= 1
    if eos_ids:
        done = done | jnp.isin(first, jnp.asarray(eos_ids))
    row = lambda x: jnp.reshape(x, (1,))  # noqa: E731
    cache = slots.target_cache
    if cache.pages_BM is None:
        target_cache = jax.tree.map(put, cache, one.target_cache)
    else:
        target_cache = cache.replace(
            latent=tuple(map(put_pages, cache.latent, one.target_cache.latent)),
            k_rope=tuple(map(put_pages, cache.k_rope, one.target_cache.k_rope)),
            lengths=put(cache.lengths, one.target_cache.lengths), pages_BM=put(cache.pages_BM, pages_M[None]))
    replaced = dict(
        target_cache=target_cache,
        pending=put(slots.pending, one.pending),
        done=put(slots.done, row(done)),
        generated=put(slots.generated, row(jnp.int32(1))),
        max_new=put(slots.max_new, row(max_new)),
        greedy=put(slots.greedy, row(greedy)),
        temperature=put(slots.temperature, row(jnp.maximum(temperature, 1e-6))),
        top_k=put(slots.top_k, row(top_k)),
        top_p=put(slots.top_p, row(top_p)),
        key_data=put(slots.key_data, jax.random.key_data(one.key)[None]),
    )
    draft = slots.draft_cache
    if draft is not None:
        if cache.pages_BM is None:
            draft_cache = jax.tree.map(put, draft, one.draft_cache)
        elif isinstance(draft, DraftCache):
            draft_cache = DraftCache(put_pages(draft.k, one.draft_cache.k, 2), put_pages(draft.v, one.draft_cache.v, 2))
        else:
            draft_cache = DraftLatentCache(put_pages(draft.latent, one.draft_cache.latent),
                                           put_pages(draft.k_rope, one.draft_cache.k_rope))
        replaced.update(draft_cache=draft_cache,
                        draft_logits=put(slots.draft_logits, one.draft_logits),
                        draft_hidden=put(slots.draft_hidden, one.draft_hidden))
    return slots.replace(**replaced)
