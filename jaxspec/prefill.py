"""Prefill: the target over the prompt bucket (first token + aux states), then the draft over the prompt.

Prompts are right-padded to a power-of-two bucket; padding slots lie past each sequence's length and are
never visible. The draft's entry at position t pairs token x[t+1] with the target feature at t, so its
prefill sees the prompt shifted left by one with the target's first token at the last real position.
Buckets longer than the chunk run as a device loop over chunks (target, then draft, per chunk), each
attending to the cache the earlier chunks wrote: long prompts need chunk x capacity of scores, not
bucket x capacity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.models import SpecConfig, SpecWeights
from jaxspec.sampling import next_token
from jaxspec.state import BaselineState, SpecState
from model.decoder import forward
from model.eagle3 import draft_forward, init_draft_cache
from model.kv_cache import init_latent_cache

MIN_BUCKET = 16
# Prompt positions per prefill chunk (a power of two, so it divides every larger bucket): attention's
# working memory is chunk x capacity scores per head.
DEFAULT_CHUNK = 512


def valid_chunk(chunk: int) -> bool:
    return chunk >= MIN_BUCKET and not chunk & (chunk - 1)


def prompt_bucket(length: int) -> int:
    bucket = MIN_BUCKET
    while bucket < length:
        bucket *= 2
    return bucket


def next_tokens(tokens_BT):
    """[B, T] -> the token after each position (x[t+1]; 0 past the end): what the draft's prefill pairs with the
    target's feature at t."""
    return jnp.concatenate([tokens_BT[:, 1:], jnp.zeros((tokens_BT.shape[0], 1), tokens_BT.dtype)], axis=1)


def prefill_chunk(w, cfg: SpecConfig, toks_BT, nxt_BT, lengths_B, key, sp, greedy, start, carry):
    """Target (and draft) over prompt positions start..start+size (`toks_BT` [B, size] and their `next_tokens`);
    the first token of every sequence whose last prompt position falls in this chunk. carry = (target cache, draft
    cache | None, first [B], draft logits, draft hidden) with the last three taken at each sequence's last
    position. `start` may be traced: one program serves every chunk of a prompt."""
    target_cache, draft_cache, first_B, dlogits_BV, dhidden_BH = carry
    b, size = toks_BT.shape
    positions_BT = jnp.broadcast_to(start + jnp.arange(size, dtype=jnp.int32), (b, size))
    last_B = lengths_B - 1
    mine_B = (last_B >= start) & (last_B < start + size)
    local_B = jnp.clip(last_B - start, 0, size - 1)
    out = forward(w.target, cfg.target, toks_BT, positions_BT, target_cache, logits_at=local_B)
    first_B = jnp.where(mine_B, next_token(key, out.logits[:, 0], greedy, sp), first_B)
    if draft_cache is not None:
        # the draft's entry at position p pairs token x[p+1] with the target's feature at p; x[last+1] is `first`
        nxt_BT = jnp.where(positions_BT == last_B[:, None], first_B[:, None], nxt_BT)
        ext = draft_forward(w.draft, cfg.draft, w.target.embed, w.target.lm_head, nxt_BT, out.aux_hidden,
                            positions_BT, draft_cache)
        at = local_B[:, None, None]
        keep = lambda new_BTX, old_BX: jnp.where(  # noqa: E731
            mine_B[:, None], jnp.take_along_axis(new_BTX, at, axis=1)[:, 0].astype(old_BX.dtype), old_BX)
        dlogits_BV, dhidden_BH = keep(ext.logits, dlogits_BV), keep(ext.hidden, dhidden_BH)
        draft_cache = ext.cache
    return out.cache, draft_cache, first_B, dlogits_BV, dhidden_BH


def _prefill(w, cfg: SpecConfig, tokens_BT, lengths_B, key, sp, capacity, greedy, chunk: int, with_draft: bool):
    """The prompt bucket in chunks of `chunk` positions (a device loop), so attention's working memory is
    chunk x capacity rather than bucket x capacity: long prompts fit. Returns `prefill_chunk`'s carry after the
    last chunk: (target cache, draft cache | None, first token [B], draft logits [B, V] and hidden [B, H] at the
    last position)."""
    b, t = tokens_BT.shape
    size = min(chunk, t)
    if t % size:
        raise ValueError(f"prompt bucket {t} is not a multiple of the prefill chunk {size}")
    next_BT = next_tokens(tokens_BT)

    def run(start, carry):
        chunk_of = lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)  # noqa: E731
        return prefill_chunk(w, cfg, chunk_of(tokens_BT), chunk_of(next_BT), lengths_B, key, sp, greedy, start, carry)

    carry = prefill_carry(w, cfg, b, capacity, with_draft)
    if t == size:
        return run(0, carry)
    return jax.lax.fori_loop(0, t // size, lambda i, c: run(i * size, c), carry)


def prefill_carry(w, cfg: SpecConfig, b: int, capacity: int, with_draft: bool) -> tuple:
    """`prefill_chunk`'s carry before the first chunk: empty caches of `capacity` slots for `b` sequences."""
    dtype = w.target.dtype
    if with_draft:
        # widths and dtypes as draft_forward makes them
        head = w.target.lm_head if w.draft.lm_head is None else w.draft.lm_head
        embed = w.target.embed if w.draft.embed is None else w.draft.embed
        draft = (init_draft_cache(cfg.draft, b, capacity, dtype), jnp.zeros((b, head.shape[0]), jnp.float32),
                 jnp.zeros((b, cfg.draft.hidden_size), embed.dtype))
    else:
        draft = (None, jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0), dtype))
    return (init_latent_cache(cfg.target, b, capacity, dtype), draft[0], jnp.zeros((b,), jnp.int32), *draft[1:])


def _outputs(cfg: SpecConfig, first_B, max_new_tokens, out_width):
    b = first_B.shape[0]
    out_tokens = jnp.zeros((b, out_width), jnp.int32).at[:, 0].set(first_B)
    done = jnp.full((b,), max_new_tokens <= 1)
    if cfg.eos_ids:
        done = done | jnp.isin(first_B, jnp.asarray(cfg.eos_ids))
    return out_tokens, done


def prefill_keys(key):
    """A request's key -> (the key its state carries on, the key its first token is sampled with)."""
    state_key, first_key = jax.random.split(key)
    return state_key, first_key


def spec_state(carry, lengths_B, key, *, cfg: SpecConfig, k: int, max_new_tokens: int, max_cycles: int) -> SpecState:
    """The speculative state once every chunk of the prompt is prefilled (`prefill_chunk`'s carry); `key` is the
    state's key (`prefill_keys`)."""
    target_cache, draft_cache, first_B, dlogits, dhidden = carry
    b = first_B.shape[0]
    out_tokens, done = _outputs(cfg, first_B, max_new_tokens, max_new_tokens + k + 1)
    return SpecState(
        target_cache=target_cache.replace(lengths=lengths_B),
        draft_cache=draft_cache,
        pending=first_B,
        draft_logits=dlogits,
        draft_hidden=dhidden,
        done=done,
        generated=jnp.ones((b,), jnp.int32),
        out_tokens=out_tokens,
        accepted_log=jnp.full((b, max_cycles), -1, jnp.int32),
        cycles=jnp.int32(0),
        key=key,
    )


def baseline_state(carry, lengths_B, key, *, cfg: SpecConfig, max_new_tokens: int) -> BaselineState:
    """`spec_state` for plain decoding."""
    target_cache, _, first_B, _, _ = carry
    out_tokens, done = _outputs(cfg, first_B, max_new_tokens, max_new_tokens + 1)
    return BaselineState(
        target_cache=target_cache.replace(lengths=lengths_B), pending=first_B, done=done,
        generated=jnp.ones_like(lengths_B), out_tokens=out_tokens, steps=jnp.int32(0), key=key,
    )


def spec_prefill(w: SpecWeights, tokens_BT, lengths_B, key, sp, *, cfg: SpecConfig, capacity: int, k: int,
                 greedy: bool, max_new_tokens: int, max_cycles: int, chunk: int = DEFAULT_CHUNK) -> SpecState:
    key, k_first = prefill_keys(key)
    carry = _prefill(w, cfg, tokens_BT, lengths_B, k_first, sp, capacity, greedy, chunk, with_draft=True)
    return spec_state(carry, lengths_B, key, cfg=cfg, k=k, max_new_tokens=max_new_tokens, max_cycles=max_cycles)


def baseline_prefill(w: SpecWeights, tokens_BT, lengths_B, key, sp, *, cfg: SpecConfig, capacity: int,
                     greedy: bool, max_new_tokens: int, chunk: int = DEFAULT_CHUNK) -> BaselineState:
    key, k_first = prefill_keys(key)
    carry = _prefill(w, cfg, tokens_BT, lengths_B, k_first, sp, capacity, greedy, chunk, with_draft=False)
    return baseline_state(carry, lengths_B, key, cfg=cfg, max_new_tokens=max_new_tokens)
