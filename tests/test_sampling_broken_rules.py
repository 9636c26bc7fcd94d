"""The losslessness test of test_sampling_losslessness.py rejects every deliberately broken acceptance rule
(tests/broken_acceptance.py) under every sampling option, and top-p applied on the draft side only; the same
program with the correct rule passes. One compiled program serves every rule: it asks the host which to apply.
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
from tests.losslessness_cases import (BATCH, SAMPLINGS, baseline, bonferroni_threshold,  # noqa: F401
                                      log10_p_values, pair, tokens_of)

BROKEN_K = 1  # every cycle that accepts its draft samples a bonus token: the most bonus tokens per row


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
    ps = log10_p_values(tokens_of(res), baseline[baseline_sampling or sampling][:, : 2 * BROKEN_K + 2])
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
