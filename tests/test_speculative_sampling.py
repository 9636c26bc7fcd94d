"""Speculative sampling is lossless: the joint distribution of the first generated tokens matches plain
sampling (chi-square), and a deliberately broken acceptance rule is caught by the same test."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2_contingency

from jaxspec import acceptance, spec_step
from jaxspec import engine as engine_module
from jaxspec.engine import Engine
from jaxspec.sampling import SamplingParams, sample
from tests.tiny_models import tiny_pair

# --- sampling losslessness ------------------------------------------------------------------------

VOCAB = 8
N_SAMPLES = 20_000


def broken_accept(key, drafts_BK, draft_probs_BKV, target_probs_BK1V):
    """A classic bug: on rejection, sample from p instead of normalize(max(p - q, 0))."""
    accepted_B, emitted_BK1 = acceptance.speculative_sampling_accept(key, drafts_BK, draft_probs_BKV, target_probs_BK1V)
    b, k = drafts_BK.shape
    p_n = jnp.take_along_axis(target_probs_BK1V, accepted_B[:, None, None], axis=1)[:, 0]
    resample = sample(jax.random.fold_in(key, 7), p_n)
    fixed = jnp.where(accepted_B < k, resample, emitted_BK1[jnp.arange(b), accepted_B])
    return accepted_B, emitted_BK1.at[jnp.arange(b), accepted_B].set(fixed)


def _joint_first3(eng, sampling, speculative, seed):
    res = eng.generate([[1, 2, 3]] * N_SAMPLES, 3, sampling=sampling, seed=seed, speculative=speculative)
    toks = np.asarray(res.tokens)
    return toks[:, 0] * VOCAB * VOCAB + toks[:, 1] * VOCAB + toks[:, 2]


def _p_value(a, b):
    cells = VOCAB**3
    table = np.stack([np.bincount(a, minlength=cells), np.bincount(b, minlength=cells)])
    table = table[:, table.sum(0) > 0]
    return chi2_contingency(table)[1]


@pytest.fixture(scope="module")
def small_vocab_pair():
    return tiny_pair(seed=3, vocab=VOCAB, logit_scale=2.0)


@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)], ids=["t1", "t0.7_p0.9"])
def test_speculative_sampling_matches_baseline_distribution(small_vocab_pair, sampling):
    cfg, w = small_vocab_pair
    eng = Engine(cfg, w, num_steps=2)
    spec = _joint_first3(eng, sampling, True, seed=1)
    base = _joint_first3(eng, sampling, False, seed=2)
    assert _p_value(spec, base) > 1e-3


def test_broken_acceptance_rule_is_detected(small_vocab_pair, monkeypatch):
    cfg, w = small_vocab_pair
    sampling = SamplingParams(1.0)
    base = _joint_first3(Engine(cfg, w, num_steps=2), sampling, False, seed=2)
    monkeypatch.setattr(spec_step, "speculative_sampling_accept", broken_accept)
    monkeypatch.setattr(engine_module, "_PROGRAMS", {})  # programs traced with the good rule must not be reused
    broken = _joint_first3(Engine(cfg, w, num_steps=2), sampling, True, seed=1)
    assert _p_value(broken, base) < 1e-3
