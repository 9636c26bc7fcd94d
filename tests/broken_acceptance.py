"""Deliberately wrong speculative-sampling rules (test-only), each the shape of a real bug. The losslessness tests
must reject every one; they share `speculative_sampling_accept`'s signature so they can stand in for it."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


def _leading_true(ok_BM):
    return jnp.cumprod(ok_BM.astype(jnp.int32), axis=1).sum(axis=1)


def _inverse_cdf_sample(key, weights_BV):
    """Inverse-CDF draw that trusts its weights to sum to 1: the excess of u over their sum lands on the last id."""
    u_B1 = jax.random.uniform(key, weights_BV.shape[:-1] + (1,))
    idx = (jnp.cumsum(weights_BV, axis=-1) <= u_B1).sum(-1)
    return jnp.minimum(idx, weights_BV.shape[-1] - 1).astype(jnp.int32)


def _rule(key, drafts_BM, draft_probs_BMV, target_probs_BK1V, *, ratio_inverted=False, renormalise=True,
          bonus_position_shift=0, one_too_many=False, residual_is_p=False):
    b, k = drafts_BM.shape
    key_u, key_tok = jax.random.split(key)
    p_d = jnp.take_along_axis(target_probs_BK1V[:, :k], drafts_BM[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(draft_probs_BMV, drafts_BM[..., None], axis=-1)[..., 0]
    u_BM = jax.random.uniform(key_u, (b, k))
    ok_BM = (u_BM * p_d < q_d) if ratio_inverted else (u_BM * q_d < p_d)
    accepted_B = _leading_true(ok_BM)
    if one_too_many:
        accepted_B = jnp.minimum(accepted_B + 1, k)
    all_in_B = accepted_B == k
    p_row_B = jnp.where(all_in_B, k + bonus_position_shift, accepted_B)
    p_n = jnp.take_along_axis(target_probs_BK1V, p_row_B[:, None, None], axis=1)[:, 0]
    q_padded = jnp.concatenate([draft_probs_BMV, jnp.zeros_like(draft_probs_BMV[:, :1])], axis=1)
    q_n = jnp.take_along_axis(q_padded, accepted_B[:, None, None], axis=1)[:, 0]
    if residual_is_p:
        residual = p_n
    else:
        residual = jnp.maximum(p_n - jnp.where(all_in_B[:, None], 0.0, q_n), 0.0)
    if renormalise:
        mass = residual.sum(-1, keepdims=True)
        residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)
        final_B = jax.random.categorical(key_tok, jnp.log(residual), axis=-1).astype(jnp.int32)
    else:
        final_B = _inverse_cdf_sample(key_tok, residual)
    emitted_BK1 = jnp.concatenate([drafts_BM, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted_BK1 = emitted_BK1.at[jnp.arange(b), accepted_B].set(final_B)
    return accepted_B, emitted_BK1


# name -> rule; "top_p_draft_side_only" is not an acceptance rule: test_sampling_losslessness builds it as a drafter
BROKEN_RULES: dict[str, Callable] = {
    "residual_not_renormalised": functools.partial(_rule, renormalise=False),
    "ratio_inverted": functools.partial(_rule, ratio_inverted=True),
    "bonus_from_last_draft_position": functools.partial(_rule, bonus_position_shift=-1),
    "one_token_too_many": functools.partial(_rule, one_too_many=True),
    "rejection_resamples_p": functools.partial(_rule, residual_is_p=True),
}
# the correct rule written the same way: shows the harness above is not what the tests reject
CORRECT_RULE = _rule
RULE_NAMES = ["correct", *BROKEN_RULES]


def accept_by_index(index, key, drafts_BM, draft_probs_BMV, target_probs_BK1V):
    """RULE_NAMES[index] with the index traced: every rule runs from one compiled program."""
    rules = [CORRECT_RULE, *BROKEN_RULES.values()]
    return jax.lax.switch(index, rules, key, drafts_BM, draft_probs_BMV, target_probs_BK1V)


class RuleFromHost:
    """An acceptance rule that asks the host which of RULE_NAMES to apply each time it runs, so one compiled
    speculative program serves the correct and every broken rule (a compile of the tiny pair costs more than
    sampling thousands of rows with it)."""

    def __init__(self):
        self.index = 0

    def _read(self):
        return np.int32(self.index)

    def __call__(self, key, drafts_BM, draft_probs_BMV, target_probs_BK1V):
        index = jax.pure_callback(self._read, jax.ShapeDtypeStruct((), jnp.int32))
        return accept_by_index(index, key, drafts_BM, draft_probs_BMV, target_probs_BK1V)
