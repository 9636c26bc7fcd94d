"""Plain decoding without speculation: the same target forward with T = 1, for fair comparisons."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.models import SpecConfig, SpecWeights
from jaxspec.sampling import next_token
from jaxspec.state import BaselineState
from model.decoder import forward
from model.shard_local import held_to_table
from model.sharding import STATE_RULES


def baseline_step(w: SpecWeights, state: BaselineState, sp: dict, *, cfg: SpecConfig, greedy: bool,
                  max_new_tokens: int) -> BaselineState:
    key, k_tok = jax.random.split(state.key)
    lengths_B = state.target_cache.lengths
    out = forward(w.target, cfg.target, state.pending[:, None], lengths_B[:, None], state.target_cache)
    logits_BV = out.logits[:, 0]
    tok_B = next_token(k_tok, logits_BV, greedy, sp)
    live_B = ~state.done
    b = tok_B.shape[0]
    col_B = jnp.where(live_B, state.generated, state.out_tokens.shape[1])
    generated = state.generated + live_B.astype(jnp.int32)
    done = state.done | (generated >= max_new_tokens)
    if cfg.eos_ids:
        done = done | (live_B & jnp.isin(tok_B, jnp.asarray(cfg.eos_ids)))
    return held_to_table(state.replace(
        target_cache=out.cache.replace(lengths=lengths_B + live_B.astype(jnp.int32)),
        pending=jnp.where(live_B, tok_B, state.pending),
        done=done,
        generated=generated,
        out_tokens=state.out_tokens.at[jnp.arange(b), col_B].set(tok_B, mode="drop"),
        steps=state.steps + jnp.any(live_B).astype(state.steps.dtype),  # none live: a no-op step
        key=key,
    ), STATE_RULES)
