"""Speculative sampling reproduces the baseline sampler's distribution at every generated position, bonus
tokens included, for K in {1, 2, 4}, under every sampling option and with a reduced draft vocabulary; and the
same test rejects each deliberately broken acceptance rule (tests/broken_acceptance.py).

Each run samples 2K + 2 new tokens for many copies of prompts of different lengths in one batch, so rows sit at
different positions and accept different counts in the same cycle. Per position, and per pair of adjacent
positions, a chi-square homogeneity test (cells pooled to expected counts >= 5, summed over prompts) compares
the speculative tokens with the baseline's; a run passes when every one of its p-values clears a
Bonferroni-corrected 1e-3. Programs are shared: one per K for all sampling options (their parameters are
traced), one for every broken rule (the rule is chosen from the host at run time).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import engine as engine_module
from jaxspec import spec_step
from jaxspec.engine import Engine
from jaxspec.sampling import SamplingParams
from tests.broken_acceptance import RULE_NAMES, RuleFromHost
from tests.sampling_stats import homogeneity, log10_p_value
from tests.tiny_models import tiny_pair

VOCAB = 8
# two dense layers: the statistics need many rows, not a deep model; compile time is what the suite pays for
PAIR_KW = dict(vocab=VOCAB, logit_scale=2.0, num_hidden_layers=2, first_k_dense_replace=2, aux_layer_ids=(0, 1),
               hidden_size=16, intermediate_size=16)
PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 1, 2, 3, 4, 5, 6]]
ROWS_PER_PROMPT = 500
BATCH = [p for p in PROMPTS for _ in range(ROWS_PER_PROMPT)]
MAX_NEW = 2 * 4 + 2  # the baseline covers the longest run (K = 4)
LOG10_FAMILY_ALPHA = -3
SAMPLINGS = {"t1": SamplingParams(1.0), "t0.7_p0.9": SamplingParams(0.7, top_p=0.9), "top_k5": SamplingParams(1.0, top_k=5)}
BROKEN_K = 1  # every cycle that accepts its draft samples a bonus token: the most bonus tokens per row


def log10_p_values(spec_BN: np.ndarray, base_BN: np.ndarray) -> dict[str, float]:
    """log10 p per position and per adjacent pair over the first N tokens, strata = prompts."""
    n = spec_BN.shape[1]
    strata = [slice(i * ROWS_PER_PROMPT, (i + 1) * ROWS_PER_PROMPT) for i in range(len(PROMPTS))]
    out = {}
    for j in range(n):
        out[f"token {j}"] = log10_p_value([
            homogeneity(np.bincount(spec_BN[s, j], minlength=VOCAB), np.bincount(base_BN[s, j], minlength=VOCAB))
            for s in strata])
    for j in range(n - 1):
        pair = lambda t: t[:, j] * VOCAB + t[:, j + 1]  # noqa: E731
        out[f"tokens {j},{j + 1}"] = log10_p_value([
            homogeneity(np.bincount(pair(spec_BN[s]), minlength=VOCAB**2), np.bincount(pair(base_BN[s]), minlength=VOCAB**2))
            for s in strata])
    return out


def bonferroni_threshold(checks: int) -> float:
    return LOG10_FAMILY_ALPHA - np.log10(checks)


def _tokens(res) -> np.ndarray:
    assert all(len(t) == len(res.tokens[0]) for t in res.tokens)
    return np.asarray(res.tokens, np.int64)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=3, **PAIR_KW)


@pytest.fixture(scope="module")
def reduced_vocab_pair(pair):
    cfg, w = tiny_pair(seed=3, draft_vocab=5, **PAIR_KW)
    # the same target as `pair` (tiny_pair derives it from the seed alone), so `pair`'s baseline serves both
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(w.target), jax.tree.leaves(pair[1].target)))
    return cfg, w


@pytest.fixture(scope="module")
def baseline(pair):
    cfg, w = pair
    eng = Engine(cfg, w, num_steps=1)
    return {name: _tokens(eng.generate(BATCH, MAX_NEW, sampling=s, seed=100, speculative=False))
            for name, s in SAMPLINGS.items()}


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_every_position_matches_the_baseline(pair, baseline, k, sampling):
    cfg, w = pair
    res = Engine(cfg, w, num_steps=k).generate(BATCH, 2 * k + 2, sampling=SAMPLINGS[sampling], seed=k)
    spec = _tokens(res)
    assert spec.shape == (len(BATCH), 2 * k + 2)
    assert max(res.stats.accepted_per_cycle) == k  # bonus tokens were sampled
    ps = log10_p_values(spec, baseline[sampling][:, : 2 * k + 2])
    assert min(ps.values()) > bonferroni_threshold(len(ps)), ps


@pytest.mark.parametrize("k", [1, 2, 4])
def test_reduced_draft_vocabulary_matches_the_baseline(reduced_vocab_pair, baseline, k):
    cfg, w = reduced_vocab_pair
    res = Engine(cfg, w, num_steps=k).generate(BATCH, 2 * k + 2, sampling=SAMPLINGS["t1"], seed=10 + k)
    ps = log10_p_values(_tokens(res), baseline["t1"][:, : 2 * k + 2])
    assert min(ps.values()) > bonferroni_threshold(len(ps)), ps


class _HostSwitch:
    """Which rule the broken-rule program applies, and the top-p the drafter applies on its side only."""

    def __init__(self):
        self.rule = RuleFromHost()
        self.draft_top_p = 1.0

    def drafter(self, key, w, cfg, state, k, greedy, sp):
        extra = jax.pure_callback(lambda: np.float32(self.draft_top_p), jax.ShapeDtypeStruct((), jnp.float32))
        return spec_step.draft_chain(key, w, cfg, state, k, greedy, dict(sp, top_p=jnp.minimum(sp["top_p"], extra)))


@pytest.fixture(scope="module")
def broken_engine(pair):
    """An engine whose one compiled program runs the rule the host picks; built outside the shared program table."""
    cfg, w = pair
    switch = _HostSwitch()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(spec_step, "speculative_sampling_accept", switch.rule)
        mp.setattr(engine_module, "_PROGRAMS", {})
        eng = Engine(cfg, w, num_steps=BROKEN_K, drafter=switch.drafter)
        eng.generate(BATCH[:1] * len(BATCH), 2 * BROKEN_K + 2, sampling=SAMPLINGS["t1"])  # compile with the patch
        yield eng, switch


def _broken_run(broken_engine, baseline, rule_index, sampling, draft_top_p=1.0, baseline_sampling=None):
    eng, switch = broken_engine
    switch.rule.index, switch.draft_top_p = rule_index, draft_top_p
    try:
        res = eng.generate(BATCH, 2 * BROKEN_K + 2, sampling=sampling, seed=7)
    finally:
        switch.rule.index, switch.draft_top_p = 0, 1.0
    assert eng.compile_count == 2  # prefill and loop, compiled once for every rule
    ps = log10_p_values(_tokens(res), baseline[baseline_sampling or sampling][:, : 2 * BROKEN_K + 2])
    return ps


def test_the_switchable_program_with_the_correct_rule_passes(broken_engine, baseline):
    ps = _broken_run(broken_engine, baseline, 0, SAMPLINGS["t1"], baseline_sampling="t1")
    assert min(ps.values()) > bonferroni_threshold(len(ps)), ps


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("rule", RULE_NAMES[1:])
def test_broken_rules_are_rejected(broken_engine, baseline, rule, sampling):
    ps = _broken_run(broken_engine, baseline, RULE_NAMES.index(rule), SAMPLINGS[sampling], baseline_sampling=sampling)
    check, log_p = min(ps.items(), key=lambda kv: kv[1])
    print(f"\nend to end, K={BROKEN_K}, {sampling}, broken rule {rule}: rejected by {check}, p = 10^{log_p:.1f}")
    assert log_p < bonferroni_threshold(len(ps)), ps


def test_top_p_on_the_draft_side_only_is_rejected(broken_engine, baseline):
    """The target's verify distribution without top-p, the draft's with it: the output follows the untruncated
    target, not the baseline's top-p 0.9 distribution."""
    ps = _broken_run(broken_engine, baseline, 0, SamplingParams(0.7, top_p=1.0), draft_top_p=0.9,
                     baseline_sampling="t0.7_p0.9")
    check, log_p = min(ps.items(), key=lambda kv: kv[1])
    print(f"\nend to end, K={BROKEN_K}, broken: top-p on the draft side only: rejected by {check}, p = 10^{log_p:.1f}")
    assert log_p < bonferroni_threshold(len(ps)), ps
