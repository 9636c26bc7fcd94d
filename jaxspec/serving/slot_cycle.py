"""One cycle over every slot -- each with its own position, sampling values, PRNG key and budget -- and the
device loop that runs a few cycles between host interactions.

The cycle is the engine's speculative cycle (jaxspec.spec_step) with per-slot sampling: greedy slots take the
argmax draft and greedy acceptance, sampled slots draw from their own processed distributions and use lossless
speculative sampling, each with its own key. A greedy slot therefore emits exactly what `Engine.generate` gives
its prompt alone, whatever its neighbours do. `sampled` is static: a loop with no sampled slot compiles to
the greedy path only (no sort over the vocabulary). K = 0 is plain decoding (a server without a drafter, or one
whose K is chosen per device loop: its plain steps extend the draft by the token they emit, so a later speculative
loop finds the draft current).

A paged target cache's block table is the draft's too (jaxspec.serving.slots): the draft runs over its pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.acceptance import greedy_accept, speculative_sampling_accept
from jaxspec.models import SpecConfig, SpecWeights
from jaxspec.sampling import processed_probs, sample
from jaxspec.serving.slots import SlotState
from jaxspec.spec_step import draft_logits_in_target_vocab
from jaxspec.state import on_host
from model.decoder import forward
from model.eagle3 import draft_forward, draft_to_target_ids, held_as_head
from model.shard_local import held_whole, per_device_rows


def _probs(logits_BXV, state: SlotState, to_target_vocab=None):
    """Each slot's logits processed with its own temperature / top-k / top-p, each device processing its share of
    the slots (`per_device_rows`: the processing sorts and sums along the vocabulary, which the target's logits
    arrive split over). `to_target_vocab`: first maps draft logits into the target's vocabulary, by rows too."""
    def rows(logits_bXV, *params):
        if to_target_vocab is not None:
            logits_bXV = to_target_vocab(logits_bXV)
        return jax.vmap(processed_probs)(logits_bXV, *params)

    return per_device_rows(rows, logits_BXV, *held_whole(state.sampling()))


def _sample_rows(keys_B, probs_BV):
    """One token a slot, drawn where its row lies, then held whole on every device as the engine's state is."""
    return held_whole(per_device_rows(jax.vmap(sample), held_whole(keys_B), probs_BV))


def _propose(keys_B, w: SpecWeights, cfg: SpecConfig, logits_BVd, state: SlotState, sampled: bool):
    """One draft token per slot (target ids) and, when any slot samples, the draft distributions [B, V]."""
    greedy_B = draft_to_target_ids(w.draft, jnp.argmax(logits_BVd, axis=-1).astype(jnp.int32))
    if not sampled:
        return greedy_B, None
    q_BV = _probs(held_as_head(logits_BVd, w.draft), state,
                  lambda logits: draft_logits_in_target_vocab(w.draft, cfg.draft, logits))
    return jnp.where(state.greedy, greedy_B, _sample_rows(keys_B, q_BV)), q_BV


def _draft_chain(keys_BM, w: SpecWeights, cfg: SpecConfig, state: SlotState, k: int, sampled: bool):
    lengths_B = state.target_cache.lengths
    tok_B, q_BV = _propose(keys_BM[:, 0], w, cfg, state.draft_logits, state, sampled)
    drafts, qs = [tok_B], [q_BV]
    h_BH, cache = state.draft_hidden, state.draft_cache
    for j in range(1, k):
        out = draft_forward(w.draft, cfg.draft, w.target.embed, w.target.lm_head, tok_B[:, None], h_BH[:, None],
                            (lengths_B + j - 1)[:, None], cache, state.target_cache.pages_BM)
        cache, h_BH = out.cache, out.hidden[:, 0]
        tok_B, q_BV = _propose(keys_BM[:, j], w, cfg, out.logits[:, 0], state, sampled)
        drafts.append(tok_B)
        qs.append(q_BV)
    return jnp.stack(drafts, axis=1), (jnp.stack(qs, axis=1) if sampled else None), cache


def _accept_row(key, drafts_M, q_MV, p_K1V):
    accepted, emitted = speculative_sampling_accept(key, drafts_M[None], q_MV[None], p_K1V[None])
    return accepted[0], emitted[0]


def _keys(state: SlotState, n: int):
    """Each slot's key split into its next key and `n` keys for this cycle: [B], [B, n]."""
    keys_B = jax.random.wrap_key_data(state.key_data)
    split_BN = jax.vmap(lambda kk: jax.random.split(kk, n + 1))(keys_B)
    return split_BN[:, 0], split_BN[:, 1:]


def slot_cycle(w: SpecWeights, state: SlotState, *, cfg: SpecConfig, k: int, sampled: bool):
    """(state, emitted [B, K+1], count [B], accepted [B], live [B]): the first `count` emitted tokens of each slot
    are its new output."""
    next_key_B, keys_BN = _keys(state, k + 1)
    lengths_B = state.target_cache.lengths
    if k == 0:
        out = forward(w.target, cfg.target, state.pending[:, None], lengths_B[:, None], state.target_cache)
        logits_BV = out.logits[:, 0]
        tok_B = jnp.argmax(logits_BV, -1).astype(jnp.int32)
        if sampled:
            tok_B = jnp.where(state.greedy, tok_B, _sample_rows(keys_BN[:, 0], _probs(logits_BV, state)))
        accepted_B = jnp.zeros_like(tok_B)
        if state.draft_cache is None:
            return _commit(state, cfg, next_key_B, accepted_B, tok_B[:, None], out.cache, None, None, None)
        # a speculating server's plain step (K chosen per loop) keeps the draft current: its entry at this position
        # (the token emitted, paired with the target's features there), as a cycle's extend writes it
        ext = draft_forward(w.draft, cfg.draft, w.target.embed, w.target.lm_head, tok_B[:, None], out.aux_hidden,
                            lengths_B[:, None], state.draft_cache, state.target_cache.pages_BM)
        return _commit(state, cfg, next_key_B, accepted_B, tok_B[:, None], out.cache, ext.cache, ext.logits[:, 0],
                       ext.hidden[:, 0])

    drafts_BM, q_BMV, draft_cache = _draft_chain(keys_BN[:, :k], w, cfg, state, k, sampled)
    verify_BK1 = jnp.concatenate([state.pending[:, None], drafts_BM], axis=1)
    positions_BK1 = lengths_B[:, None] + jnp.arange(k + 1)[None]
    verify = forward(w.target, cfg.target, verify_BK1, positions_BK1, state.target_cache)
    accepted_B, emitted_BK1 = greedy_accept(drafts_BM, verify.logits)
    if sampled:
        p_BK1V = _probs(verify.logits, state)
        acc_s, emit_s = held_whole(per_device_rows(jax.vmap(_accept_row), *held_whole((keys_BN[:, k], drafts_BM)),
                                                   q_BMV, p_BK1V))
        accepted_B = jnp.where(state.greedy, accepted_B, acc_s)
        emitted_BK1 = jnp.where(state.greedy[:, None], emitted_BK1, emit_s)
    ext = draft_forward(w.draft, cfg.draft, w.target.embed, w.target.lm_head, emitted_BK1, verify.aux_hidden,
                        positions_BK1, draft_cache, state.target_cache.pages_BM)
    pick = accepted_B[:, None, None]
    next_logits = jnp.take_along_axis(ext.logits, pick, axis=1)[:, 0]
    next_hidden = jnp.take_along_axis(ext.hidden, pick, axis=1)[:, 0]
    return _commit(state, cfg, next_key_B, accepted_B, emitted_BK1, verify.cache, ext.cache, next_logits, next_hidden)


def _commit(state: SlotState, cfg: SpecConfig, next_key_B, accepted_B, emitted_BK1, target_cache, draft_cache,
            next_logits_BVd, next_hidden_BH):
    """Cut each live slot's emitted tokens at EOS and its budget, advance it; leave done slots untouched."""
    b, k1 = emitted_BK1.shape
    idx_K1 = jnp.arange(k1)[None]
    live_B = ~state.done
    count_B = jnp.minimum(accepted_B + 1, state.max_new - state.generated)
    hit_eos_B = jnp.zeros((b,), bool)
    if cfg.eos_ids:
        is_eos = jnp.isin(emitted_BK1, jnp.asarray(cfg.eos_ids)) & (idx_K1 < count_B[:, None])
        hit_eos_B = is_eos.any(1)
        count_B = jnp.minimum(count_B, jnp.where(hit_eos_B, jnp.argmax(is_eos, axis=1), k1) + 1)
    count_B = jnp.where(live_B, count_B, 0)
    generated = state.generated + count_B
    done = state.done | (live_B & hit_eos_B) | (generated >= state.max_new)
    pending_B = jnp.take_along_axis(emitted_BK1, accepted_B[:, None], axis=1)[:, 0]

    def keep(new, old):
        return jnp.where(live_B.reshape((b,) + (1,) * (new.ndim - 1)), new.astype(old.dtype), old)

    replaced = dict(
        target_cache=target_cache.replace(lengths=keep(state.target_cache.lengths + accepted_B + 1,
                                                       state.target_cache.lengths)),
        pending=keep(pending_B, state.pending),
        done=done,
        generated=generated,
        key_data=keep(jax.random.key_data(next_key_B), state.key_data),
    )
    if draft_cache is not None:
        replaced.update(draft_cache=draft_cache, draft_logits=keep(next_logits_BVd, state.draft_logits),
                        draft_hidden=keep(next_hidden_BH, state.draft_hidden))
    return state.replace(**replaced), emitted_BK1, count_B, accepted_B, live_B


def run_cycles(w: SpecWeights, state: SlotState, cancel_B, *, cfg: SpecConfig, k: int, sampled: bool, cycles: int):
    """Up to `cycles` cycles on the device (fewer once every slot is done), after ending the slots in `cancel_B`.

    Returns (state, (tokens [B, cycles * (K+1)], counts [B], done [B], accepted drafts summed over live slot-cycles,
    live slot-cycles, cycles run, accepted_K1 [K+1]: live slot-cycles by drafts accepted, probe [2]), the latter
    written into host memory for the server's read after every step (`on_host`)): slot b's new tokens are
    tokens[b, :counts[b]]. `probe` (plain steps of a speculating server): of the live greedy slot-steps
    (trials), how many emitted the draft's own first guess (hits) -- what a first draft position would have
    accepted, observed for free while K = 0."""
    state = state.replace(done=state.done | cancel_B)
    b = state.batch
    width = cycles * (k + 1)
    rows_B1 = jnp.arange(b)[:, None]
    probing = k == 0 and state.draft_cache is not None

    def body(carry):
        i, st, buf_BW, n_B, acc, live_cycles, accepted_K1, probe_2 = carry
        if probing:
            guess_B = draft_to_target_ids(w.draft, jnp.argmax(st.draft_logits, axis=-1).astype(jnp.int32))
        st, emitted_BK1, count_B, accepted_B, live_B = slot_cycle(w, st, cfg=cfg, k=k, sampled=sampled)
        idx_K1 = jnp.arange(k + 1)[None]
        cols = jnp.where(idx_K1 < count_B[:, None], n_B[:, None] + idx_K1, width)
        buf_BW = buf_BW.at[rows_B1, cols].set(emitted_BK1, mode="drop")
        acc = acc + jnp.sum(jnp.where(live_B, accepted_B, 0))
        accepted_K1 = accepted_K1 + jnp.sum((accepted_B[:, None] == jnp.arange(k + 1)[None]) & live_B[:, None], 0)
        if probing:
            tried_B = live_B & st.greedy
            probe_2 = probe_2 + jnp.stack([jnp.sum(tried_B & (emitted_BK1[:, 0] == guess_B)), jnp.sum(tried_B)])
        return (i + 1, st, buf_BW, n_B + count_B, acc, live_cycles + jnp.sum(live_B.astype(jnp.int32)), accepted_K1,
                probe_2)

    def cond(carry):
        return (carry[0] < cycles) & ~jnp.all(carry[1].done)

    zero = jnp.int32(0)
    carry = (zero, state, jnp.zeros((b, width), jnp.int32), jnp.zeros((b,), jnp.int32), zero, zero,
             jnp.zeros((k + 1,), jnp.int32), jnp.zeros((2,), jnp.int32))
    ran, state, buf_BW, n_B, acc, live_cycles, accepted_K1, probe_2 = jax.lax.while_loop(cond, body, carry)
    return state, on_host((buf_BW, n_B, state.done, acc, live_cycles, ran, accepted_K1, probe_2))
