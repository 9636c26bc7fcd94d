"""Speculative sampling reproduces the baseline sampler's distribution at every generated position, bonus
tokens included, for K in {1, 2, 4}, under every sampling option and with a reduced draft vocabulary
(test_sampling_broken_rules.py shows the same test rejects broken acceptance rules).

Each run samples 2K + 2 new tokens for many copies of prompts of different lengths in one batch, so rows sit at
different positions and accept different counts in the same cycle. Per position, and per pair of adjacent
positions, a chi-square homogeneity test (cells pooled to expected counts >= 5, summed over prompts) compares
the speculative tokens with the baseline's; a run passes when every one of its p-values clears a
Bonferroni-corrected 1e-3. One program per K serves every sampling option (their parameters are traced).
"""

import pytest

from jaxspec.engine import Engine
from tests.losslessness_cases import (BATCH, SAMPLINGS, baseline, bonferroni_threshold,  # noqa: F401
                                      log10_p_values, pair, reduced_vocab_pair, tokens_of)


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_every_position_matches_the_baseline(pair, baseline, k, sampling):
    cfg, w = pair
    res = Engine(cfg, w, num_steps=k).generate(BATCH, 2 * k + 2, sampling=SAMPLINGS[sampling], seed=k)
    spec = tokens_of(res)
    assert spec.shape == (len(BATCH), 2 * k + 2)
    assert max(res.stats.accepted_per_cycle) == k  # bonus tokens were sampled
    ps = log10_p_values(spec, baseline[sampling][:, : 2 * k + 2])
    assert min(ps.values()) > bonferroni_threshold(len(ps)), ps


@pytest.mark.parametrize("k", [1, 4])  # one bonus per accepted draft; the longest chain (each K is a compile)
def test_reduced_draft_vocabulary_matches_the_baseline(reduced_vocab_pair, baseline, k):
    cfg, w = reduced_vocab_pair
    res = Engine(cfg, w, num_steps=k).generate(BATCH, 2 * k + 2, sampling=SAMPLINGS["t1"], seed=10 + k)
    ps = log10_p_values(tokens_of(res), baseline["t1"][:, : 2 * k + 2])
    assert min(ps.values()) > bonferroni_threshold(len(ps)), ps
