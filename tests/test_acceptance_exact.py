"""`speculative_sampling_accept` on fixed p and q, position by position, the bonus position included.

With distributions that do not depend on the context (p_j at position j, q_j for draft j), losslessness says:
complete each cycle's output after its last emitted token with fresh draws from p_j (what the next cycle does)
and the K+1 tokens are distributed exactly as the product of p_0..p_K. The number of accepted drafts has the
closed form P(accepted >= j) = prod_{i<j} (1 - TV(p_i, q_i)). Both are checked against exact probabilities
(chi-square, cells pooled to expected counts >= 5), and outcomes of probability 0 must never occur.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.acceptance import speculative_sampling_accept
from tests.broken_acceptance import RULE_NAMES, accept_by_index
from tests.sampling_stats import goodness_of_fit, log10_p_value

V, K = 4, 3
ROWS = 100_000  # per case: the smallest cell of the generic case expects ~50 draws
LOG10_ALPHA = -4  # per p-value; a case makes K + 3 of them


def _dirichlet(rng, n):
    return rng.dirichlet(np.ones(V), n)


def _onehot(*ids):
    return np.eye(V)[list(ids)]


def _cases():
    rng = np.random.default_rng(0)
    p_generic, q_generic = _dirichlet(rng, K + 1), _dirichlet(rng, K)
    return {
        "generic": (p_generic, q_generic),
        # p is 0 where q proposes and q is 0 where p has mass
        "zeros": (np.array([[0.0, 0.5, 0.5, 0.0], [0.7, 0.0, 0.0, 0.3], [0.2, 0.2, 0.0, 0.6], [0.0, 0.0, 0.25, 0.75]]),
                  np.array([[0.5, 0.5, 0.0, 0.0], [0.0, 0.4, 0.6, 0.0], [0.0, 0.1, 0.9, 0.0]])),
        "ties": (np.full((K + 1, V), 1 / V), np.array([[0.4, 0.4, 0.1, 0.1], [0.25] * 4, [0.5, 0.5, 0.0, 0.0]])),
        # draft 1 accepted, draft 2 rejected (the residual is p_1 itself); positions 2 and 3 come from later cycles
        "one_hot": (_onehot(1, 2, 0, 3), _onehot(1, 3, 0)),
        "p_equals_q": (np.tile(p_generic[:1], (K + 1, 1)), np.tile(p_generic[:1], (K, 1))),
        "disjoint_support": (np.array([[0.6, 0.4, 0.0, 0.0]] * (K + 1)), np.array([[0.0, 0.0, 0.3, 0.7]] * K)),
    }


CASES = _cases()
_ACCEPT_JIT = jax.jit(speculative_sampling_accept)
_RULES_JIT = jax.jit(accept_by_index)  # one program for the test-only rules, chosen by a traced index


def _test_rule(name):
    return functools.partial(_RULES_JIT, RULE_NAMES.index(name))


def _run(rule, p_K1V, q_MV, seed):
    """-> (accepted [N], completed tokens [N, K+1]) for ROWS cycles with drafts drawn from q."""
    rng = np.random.default_rng(seed)
    p32, q32 = p_K1V.astype(np.float32), q_MV.astype(np.float32)
    drafts = np.stack([rng.choice(V, ROWS, p=q_MV[j] / q_MV[j].sum()) for j in range(K)], 1).astype(np.int32)
    accepted, emitted = rule(jax.random.key(seed), jnp.asarray(drafts), jnp.broadcast_to(jnp.asarray(q32), (ROWS, K, V)),
                             jnp.broadcast_to(jnp.asarray(p32), (ROWS, K + 1, V)))
    accepted, emitted = np.asarray(accepted), np.asarray(emitted)
    fresh = np.stack([rng.choice(V, ROWS, p=p_K1V[j] / p_K1V[j].sum()) for j in range(K + 1)], 1)
    completed = np.where(np.arange(K + 1)[None] <= accepted[:, None], emitted, fresh)
    return accepted, completed


def _log10_p_values(p_K1V, q_MV, accepted, completed) -> dict[str, float]:
    """log10 p-value per check: the joint of all K+1 positions, each position's marginal, the accepted count."""
    out = {}
    joint = np.ravel_multi_index(completed.T, (V,) * (K + 1))
    exact_joint = np.array([np.prod([p_K1V[j, t] for j, t in enumerate(cell)])
                            for cell in itertools.product(range(V), repeat=K + 1)])
    out["joint"] = log10_p_value([goodness_of_fit(np.bincount(joint, minlength=V ** (K + 1)), exact_joint)])
    for j in range(K + 1):
        out[f"position {j}"] = log10_p_value([goodness_of_fit(np.bincount(completed[:, j], minlength=V), p_K1V[j])])
    overlap = np.minimum(p_K1V[:K], q_MV).sum(-1)  # 1 - TV(p_j, q_j)
    at_least = np.concatenate([[1.0], np.cumprod(overlap)])
    exact_accepted = at_least - np.concatenate([at_least[1:], [0.0]])
    out["accepted"] = log10_p_value([goodness_of_fit(np.bincount(accepted, minlength=K + 1), exact_accepted)])
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_accept_rule_output_distribution_is_exactly_p(case):
    p_K1V, q_MV = CASES[case]
    accepted, completed = _run(_ACCEPT_JIT, p_K1V, q_MV, seed=1)
    ps = _log10_p_values(p_K1V, q_MV, accepted, completed)
    assert min(ps.values()) > LOG10_ALPHA, ps
    if case == "p_equals_q":
        assert (accepted == K).all()  # u * q(d) < p(d) holds for every u in [0, 1)
    if case == "disjoint_support":
        assert (accepted == 0).all()
    if case == "one_hot":
        assert (accepted == 1).all() and (completed == [1, 2, 0, 3]).all()


def test_harness_rule_written_like_the_broken_ones_passes():
    p_K1V, q_MV = CASES["generic"]
    ps = _log10_p_values(p_K1V, q_MV, *_run(_test_rule("correct"), p_K1V, q_MV, seed=1))
    assert min(ps.values()) > LOG10_ALPHA, ps


@pytest.mark.parametrize("rule", RULE_NAMES[1:])
def test_broken_rules_are_rejected(rule):
    p_K1V, q_MV = CASES["generic"]
    accepted, completed = _run(_test_rule(rule), p_K1V, q_MV, seed=1)
    ps = _log10_p_values(p_K1V, q_MV, accepted, completed)
    check, log_p = min(ps.items(), key=lambda kv: kv[1])
    print(f"\nexact test, broken rule {rule}: rejected by the {check} check, p = 10^{log_p:.1f}")
    assert log_p < -9, ps
