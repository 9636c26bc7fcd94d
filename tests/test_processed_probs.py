"""`processed_probs` against a float64 numpy reference written from the definitions:

- temperature t: softmax(logits / t);
- top-k k > 0: keep the k largest logits (every logit tied with the k-th is kept too), 0 = off;
- top-p p < 1: in descending order keep each token whose preceding mass is < p (the smallest set reaching p);
  a token tied with the last kept one is kept too, so the result does not depend on how ties are ordered;
  p = 1 = off: every token keeps its softmax probability, however small;
- top-k applies first, top-p to the renormalised top-k distribution; the kept mass is renormalised.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.sampling import SamplingParams, processed_probs


def reference_probs(logits_V, temperature, top_k, top_p):
    z = np.asarray(logits_V, np.float64) / temperature
    if top_k > 0:
        kth = np.sort(z)[::-1][min(top_k, len(z)) - 1]
        z = np.where(z >= kth, z, -np.inf)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if top_p < 1:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        last_kept = probs[order][before < top_p].min()
        probs = np.where(probs >= last_kept, probs, 0.0)
        probs /= probs.sum()
    return probs


def _assert_same_support(got, ref):
    """Tokens the definition removes are 0; tokens it keeps are > 0 (unless float32 underflows them: < 1e-30)."""
    assert (got[ref == 0] == 0).all()
    assert (got[ref > 1e-30] > 0).all()


_PROBS_JIT = jax.jit(processed_probs)  # the parameters are traced: one program per logits shape


def _jax_probs(logits_XV, sampling: SamplingParams):
    return np.asarray(_PROBS_JIT(jnp.asarray(logits_XV, jnp.float32), **sampling.as_arrays()))


SETTINGS = [
    SamplingParams(1.0), SamplingParams(0.7), SamplingParams(1.6), SamplingParams(0.05),
    SamplingParams(1.0, top_k=1), SamplingParams(1.0, top_k=5), SamplingParams(0.8, top_k=40),
    SamplingParams(1.0, top_k=100),  # k > V: off
    SamplingParams(1.0, top_p=0.9), SamplingParams(0.7, top_p=0.9), SamplingParams(1.0, top_p=0.3),
    SamplingParams(1.3, top_p=0.05),  # only the top token
    SamplingParams(0.7, top_k=5, top_p=0.9), SamplingParams(1.0, top_k=20, top_p=0.5),
]


@pytest.mark.parametrize("sampling", SETTINGS, ids=lambda s: f"t{s.temperature}_k{s.top_k}_p{s.top_p}")
def test_matches_reference_on_random_logits(sampling):
    logits = np.random.default_rng(0).standard_normal((16, 64)) * 2.0
    ref = np.stack([reference_probs(row, sampling.temperature, sampling.top_k, sampling.top_p) for row in logits])
    got = _jax_probs(logits, sampling)
    _assert_same_support(got, ref)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("top_p, kept", [(0.35, 1), (0.5, 3), (0.75, 3), (0.85, 5)])
def test_ties_at_the_top_p_boundary_are_kept_together(top_p, kept):
    # probabilities 0.4, 0.2, 0.2, 0.1, 0.1: a nucleus that ends inside a tie keeps the whole tie
    probs = np.array([0.1, 0.2, 0.4, 0.2, 0.1])
    logits = np.log(probs)
    ref = reference_probs(logits, 1.0, 0, top_p)
    got = _jax_probs(logits[None], SamplingParams(1.0, top_p=top_p))[0]
    assert (ref > 0).sum() == kept and (got > 0).sum() == kept
    _assert_same_support(got, ref)
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_ties_at_the_top_k_boundary_are_kept_together():
    logits = np.array([3.0, 1.0, 2.0, 2.0, 0.0, 2.0])
    got = _jax_probs(logits[None], SamplingParams(1.0, top_k=2))[0]
    ref = reference_probs(logits, 1.0, 2, 1.0)
    assert (got > 0).sum() == 4
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_top_p_one_keeps_every_token():
    """top_p = 1 is 'off': a long tail whose float32 running mass reaches 1 before its end still keeps its tokens."""
    logits = np.random.default_rng(1).standard_normal((4, 256)) * 10.0
    got = _jax_probs(logits, SamplingParams(1.0, top_p=1.0))
    ref = np.stack([reference_probs(row, 1.0, 0, 1.0) for row in logits])
    assert (got > 0).all()
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=1e-12)


def test_minus_infinity_logits_stay_impossible():
    """A reduced draft vocabulary scatters -inf into the target vocabulary; every option must keep those at 0."""
    logits = np.random.default_rng(2).standard_normal((3, 32))
    logits[:, ::3] = -np.inf
    for sampling in (SamplingParams(1.0), SamplingParams(0.7, top_p=0.9), SamplingParams(1.0, top_k=25)):
        got = _jax_probs(logits, sampling)
        ref = np.stack([reference_probs(row, sampling.temperature, sampling.top_k, sampling.top_p) for row in logits])
        assert (got[:, ::3] == 0).all()
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("top_p", [1e-40, 1e-50])  # a float32 subnormal, and a value float32 rounds to 0
def test_a_top_p_too_small_for_float32_still_keeps_the_top_token(top_p):
    """The nucleus is never empty: a top_p that is > 0 (so valid) but 0 or subnormal in float32 keeps the most
    likely token, as the definition does, instead of leaving no token and sampling from NaN."""
    logits = np.random.default_rng(3).standard_normal((3, 64))
    got = _jax_probs(logits, SamplingParams(1.0, top_p=top_p))
    np.testing.assert_array_equal(got, np.eye(64)[logits.argmax(-1)])
