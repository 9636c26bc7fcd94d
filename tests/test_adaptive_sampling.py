"""Adaptive speculation samples as plain sampling does while K switches between cycles: K forced to alternate
(plain steps then K = 2 cycles, and the reverse; the backlog catch-up runs between them), every generated position
and adjacent pair compared with the baseline sampler by the chi-square tests of test_sampling_losslessness.py."""

import pytest

from jaxspec.adaptive import AdaptivePolicy
from jaxspec.engine import Engine
from tests.losslessness_cases import (BATCH, SAMPLINGS, baseline, bonferroni_threshold, log10_p_values,  # noqa: F401
                                      pair, tokens_of)

NEW = 6


@pytest.mark.parametrize("schedule", [(0, 2), (2, 0)], ids=["plain-then-K2", "K2-then-plain"])
def test_sampled_output_is_unbiased_while_k_switches(pair, baseline, schedule):
    cfg, w = pair
    policy = AdaptivePolicy(steps=(0, 2), costs=((0, 1.0), (2, 1.0)), schedule=schedule, backlog=2, stretch=2)
    res = Engine(cfg, w, num_steps=2, adaptive=policy).generate(BATCH, NEW, sampling=SAMPLINGS["t1"], seed=7)
    assert res.adaptive.k_per_cycle[:4] == list(schedule) * 2
    ps = log10_p_values(tokens_of(res), baseline["t1"][:, :NEW])
    assert min(ps.values()) > bonferroni_threshold(len(ps)), ps
