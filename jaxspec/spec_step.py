"""One speculative cycle -- K draft steps, the target's verify over K+1 tokens, acceptance, cache
bookkeeping and the draft's extend -- traced as ONE static-shape function.

Positions (chain drafting, L = committed target length, x_L = the pending token):
- draft step 1 was computed by the previous cycle's extend at draft position L-1 (token x_L, target
  feature f_{L-1}); steps 2..K run at positions L..L+K-2 on the draft's own hidden output;
- verify: target over [x_L, d_1..d_K] at positions L..L+K, giving logits and features f_L..f_{L+K};
- accept n drafts; emitted = d_1..d_n then the target's token; L advances by n + 1;
- extend: draft over positions L..L+K with the emitted tokens and target features f_L..f_{L+K}; its output
  at index n is draft step 1 of the next cycle. Slots past the new length are stale and get overwritten
  before any query can see them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.acceptance import greedy_accept, speculative_sampling_accept
from jaxspec.models import SpecConfig, SpecWeights
from jaxspec.sampling import processed_probs_by_rows, sample
from jaxspec.state import SpecState
from model.decoder import forward
from model.eagle3 import draft_forward, draft_to_target_ids, held_as_head
from model.shard_local import held_to_table, held_whole
from model.sharding import STATE_RULES


def draft_logits_in_target_vocab(dw, dcfg, logits_BXVd):
    """Scatter draft-vocab logits into the target vocabulary (-inf where the draft has no token)."""
    if dw.d2t is None:
        return logits_BXVd
    ids = draft_to_target_ids(dw, jnp.arange(dcfg.draft_vocab_size))
    full = jnp.full((*logits_BXVd.shape[:-1], dcfg.vocab_size), -jnp.inf, jnp.float32)
    return full.at[..., ids].set(logits_BXVd)


def propose(key, dw, dcfg, logits_BVd, greedy, sp):
    """One draft token per sequence in target ids, and the draft distribution q over the target vocab."""
    if greedy:
        tok = draft_to_target_ids(dw, jnp.argmax(logits_BVd, axis=-1).astype(jnp.int32))
        return tok, None
    q_BV = processed_probs_by_rows(draft_logits_in_target_vocab(dw, dcfg, held_as_head(logits_BVd, dw)), **sp)
    return held_whole(sample(key, q_BV)), q_BV


def draft_chain(key, w: SpecWeights, cfg: SpecConfig, state: SpecState, k: int, greedy: bool, sp):
    """K draft tokens [B, K] (target ids) and their distributions [B, K, V] (None when greedy)."""
    dcfg, dw = cfg.draft, w.draft
    lengths_B = state.target_cache.lengths
    keys = jax.random.split(key, k)
    tok_B, q_BV = propose(keys[0], dw, dcfg, state.draft_logits, greedy, sp)
    drafts, qs = [tok_B], [q_BV]
    h_BH, cache = state.draft_hidden, state.draft_cache
    for j in range(1, k):
        out = draft_forward(
            dw, dcfg, w.target.embed, w.target.lm_head, tok_B[:, None], h_BH[:, None],
            (lengths_B + j - 1)[:, None], cache,
        )
        cache, h_BH = out.cache, out.hidden[:, 0]
        tok_B, q_BV = propose(keys[j], dw, dcfg, out.logits[:, 0], greedy, sp)
        drafts.append(tok_B)
        qs.append(q_BV)
    q_BMV = None if greedy else jnp.stack(qs, axis=1)
    return jnp.stack(drafts, axis=1), q_BMV, cache


def speculative_cycle(w: SpecWeights, state: SpecState, sp: dict, *, cfg: SpecConfig, k: int, greedy: bool,
                      max_new_tokens: int, drafter=None) -> SpecState:
    """`drafter` replaces the EAGLE-3 chain (same signature as `draft_chain`); tests plug oracles in here."""
    return speculative_cycle_accepting(w, state, sp, cfg=cfg, k=k, greedy=greedy, max_new_tokens=max_new_tokens,
                                       drafter=drafter).state


class CycleOutput(NamedTuple):
    state: SpecState
    accepted: jax.Array  # [B] drafts each sequence accepted (what adaptive K learns from)
    verify_expert_ids: tuple[jax.Array, ...]  # per MoE layer [B*(K+1), topk]: the experts the verify ran


def speculative_cycle_accepting(w: SpecWeights, state: SpecState, sp: dict, *, cfg: SpecConfig, k: int, greedy: bool,
                                max_new_tokens: int, drafter=None) -> CycleOutput:
    """`speculative_cycle` that also returns what the cycle accepted and the experts its verify ran."""
    tcfg, dcfg = cfg.target, cfg.draft
    b = state.pending.shape[0]
    key, k_draft, k_accept = jax.random.split(state.key, 3)
    lengths_B = state.target_cache.lengths

    drafts_BM, q_BMV, draft_cache = (drafter or draft_chain)(k_draft, w, cfg, state, k, greedy, sp)

    verify_tokens_BK1 = jnp.concatenate([state.pending[:, None], drafts_BM], axis=1)
    positions_BK1 = lengths_B[:, None] + jnp.arange(k + 1)[None]
    verify = forward(w.target, tcfg, verify_tokens_BK1, positions_BK1, state.target_cache)

    if greedy:
        accepted_B, emitted_BK1 = greedy_accept(drafts_BM, verify.logits)
    else:
        p_BK1V = processed_probs_by_rows(verify.logits, **sp)
        accepted_B, emitted_BK1 = held_whole(speculative_sampling_accept(k_accept, drafts_BM, q_BMV, p_BK1V))

    ext = draft_forward(
        w.draft, dcfg, w.target.embed, w.target.lm_head, emitted_BK1, verify.aux_hidden, positions_BK1, draft_cache
    )
    pick = accepted_B[:, None, None]
    next_logits_BVd = jnp.take_along_axis(ext.logits, pick, axis=1)[:, 0]
    next_hidden_BH = jnp.take_along_axis(ext.hidden, pick, axis=1)[:, 0]

    new_state = commit(state, cfg, key, accepted_B, emitted_BK1, verify.cache, ext.cache, next_logits_BVd,
                       next_hidden_BH, max_new_tokens)
    return CycleOutput(new_state, accepted_B, verify.expert_ids)


def commit(state: SpecState, cfg: SpecConfig, key, accepted_B, emitted_BK1, target_cache, draft_cache,
           next_logits_BVd, next_hidden_BH, max_new_tokens: int) -> SpecState:
    """Write the emitted tokens (cut at EOS and max_new_tokens), advance lengths; freeze finished rows (a cycle
    on a finished batch changes no token, count or log: streaming queues one past the end)."""
    b, k1 = emitted_BK1.shape
    idx_K1 = jnp.arange(k1)[None]
    count_B = accepted_B + 1
    count_B = jnp.minimum(count_B, max_new_tokens - state.generated)
    if cfg.eos_ids:
        is_eos = jnp.isin(emitted_BK1, jnp.asarray(cfg.eos_ids)) & (idx_K1 < count_B[:, None])
        first_eos_B = jnp.where(is_eos.any(1), jnp.argmax(is_eos, axis=1), k1)
        count_B = jnp.minimum(count_B, first_eos_B + 1)
        hit_eos_B = is_eos.any(1)
    else:
        hit_eos_B = jnp.zeros((b,), bool)
    live_B = ~state.done
    count_B = jnp.where(live_B, count_B, 0)
    cols = jnp.where(idx_K1 < count_B[:, None], state.generated[:, None] + idx_K1, state.out_tokens.shape[1])
    out_tokens = state.out_tokens.at[jnp.arange(b)[:, None], cols].set(emitted_BK1, mode="drop")
    generated = state.generated + count_B
    done = state.done | hit_eos_B | (generated >= max_new_tokens)

    new_len_B = jnp.where(live_B, state.target_cache.lengths + accepted_B + 1, state.target_cache.lengths)
    pending_B = jnp.take_along_axis(emitted_BK1, accepted_B[:, None], axis=1)[:, 0]
    log_col = jnp.where(live_B, state.cycles, state.accepted_log.shape[1])
    accepted_log = state.accepted_log.at[jnp.arange(b), log_col].set(accepted_B, mode="drop")

    keep = lambda new, old: jnp.where(live_B.reshape((b,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
    return held_to_table(state.replace(
        target_cache=target_cache.replace(lengths=new_len_B),
        draft_cache=draft_cache,
        pending=keep(pending_B, state.pending),
        draft_logits=keep(next_logits_BVd, state.draft_logits),
        draft_hidden=keep(next_hidden_BH.astype(state.draft_hidden.dtype), state.draft_hidden),
        done=done,
        generated=generated,
        out_tokens=out_tokens,
        accepted_log=accepted_log,
        cycles=state.cycles + jnp.any(live_B).astype(state.cycles.dtype),  # none live: a no-op cycle
        key=key,
    ), STATE_RULES)
