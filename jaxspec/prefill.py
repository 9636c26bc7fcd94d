"""Prefill: the target over the prompt bucket (first token + aux states), then the draft over the prompt.

Prompts are right-padded to a power-of-two bucket; padding slots lie past each sequence's length and are
never visible. The draft's entry at position t pairs token x[t+1] with the target feature at t, so its
prefill sees the prompt shifted left by one with the target's first token at the last real position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.models import SpecConfig, SpecWeights
from jaxspec.sampling import processed_probs, sample
from jaxspec.state import BaselineState, SpecState
from model.decoder import forward
from model.eagle3 import draft_forward, init_draft_cache
from model.kv_cache import init_latent_cache

MIN_BUCKET = 16


def prompt_bucket(length: int) -> int:
    bucket = MIN_BUCKET
    while bucket < length:
        bucket *= 2
    return bucket


def _first_token(key, logits_BV, greedy, sp):
    if greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return sample(key, processed_probs(logits_BV, **sp))


def _target_prefill(w, cfg: SpecConfig, tokens_BT, lengths_B, key, sp, capacity, greedy):
    b, t = tokens_BT.shape
    cache = init_latent_cache(cfg.target, b, capacity, w.target.dtype)
    positions_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
    out = forward(w.target, cfg.target, tokens_BT, positions_BT, cache, logits_at=lengths_B - 1)
    first_B = _first_token(key, out.logits[:, 0], greedy, sp)
    return out, first_B, out.cache.replace(lengths=lengths_B)


def _outputs(cfg: SpecConfig, first_B, max_new_tokens, out_width):
    b = first_B.shape[0]
    out_tokens = jnp.zeros((b, out_width), jnp.int32).at[:, 0].set(first_B)
    done = jnp.full((b,), max_new_tokens <= 1)
    if cfg.eos_ids:
        done = done | jnp.isin(first_B, jnp.asarray(cfg.eos_ids))
    return out_tokens, done


def spec_prefill(w: SpecWeights, tokens_BT, lengths_B, key, sp, *, cfg: SpecConfig, capacity: int, k: int,
                 greedy: bool, max_new_tokens: int, max_cycles: int) -> SpecState:
    b, t = tokens_BT.shape
    key, k_first = jax.random.split(key)
    out, first_B, target_cache = _target_prefill(w, cfg, tokens_BT, lengths_B, k_first, sp, capacity, greedy)
    shifted_BT = jnp.concatenate([tokens_BT[:, 1:], jnp.zeros((b, 1), tokens_BT.dtype)], axis=1)
    shifted_BT = shifted_BT.at[jnp.arange(b), lengths_B - 1].set(first_B)
    draft_cache = init_draft_cache(cfg.draft, b, capacity, w.target.dtype)
    positions_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
    ext = draft_forward(w.draft, cfg.draft, w.target.embed, w.target.lm_head, shifted_BT, out.aux_hidden,
                        positions_BT, draft_cache)
    last = (lengths_B - 1)[:, None, None]
    out_tokens, done = _outputs(cfg, first_B, max_new_tokens, max_new_tokens + k + 1)
    return SpecState(
        target_cache=target_cache,
        draft_cache=ext.cache,
        pending=first_B,
        draft_logits=jnp.take_along_axis(ext.logits, last, axis=1)[:, 0],
        draft_hidden=jnp.take_along_axis(ext.hidden, last, axis=1)[:, 0],
        done=done,
        generated=jnp.ones((b,), jnp.int32),
        out_tokens=out_tokens,
        accepted_log=jnp.full((b, max_cycles), -1, jnp.int32),
        cycles=jnp.int32(0),
        key=key,
    )


def baseline_prefill(w: SpecWeights, tokens_BT, lengths_B, key, sp, *, cfg: SpecConfig, capacity: int,
                     greedy: bool, max_new_tokens: int) -> BaselineState:
    key, k_first = jax.random.split(key)
    _, first_B, target_cache = _target_prefill(w, cfg, tokens_BT, lengths_B, k_first, sp, capacity, greedy)
    out_tokens, done = _outputs(cfg, first_B, max_new_tokens, max_new_tokens + 1)
    return BaselineState(
        target_cache=target_cache, pending=first_B, done=done, generated=jnp.ones_like(lengths_B),
        out_tokens=out_tokens, steps=jnp.int32(0), key=key,
    )
