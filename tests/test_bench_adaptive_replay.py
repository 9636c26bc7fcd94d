"""bench.labs.adaptive_replay: the offline replay of the adaptive rule over per-position acceptance."""

from bench.labs.adaptive_replay import replay_fixed, replay_rule
from jaxspec.adaptive import AdaptivePolicy

COSTS = {0: 1.0, 1: 1.3, 2: 1.5, 4: 1.9}  # ms per cycle
STEPS = (0, 1, 2, 4)


def test_fixed_k_emits_the_accepted_prefix_and_one_token_per_cycle():
    every = [8] * 64  # the draft chain always right
    r = replay_fixed(every, 41, 4, COSTS)
    assert r.k_log == [4] * 8  # 40 tokens after the prefill's first, 5 a cycle
    assert abs(r.tokens_per_s - 40 / (8 * 1.9) * 1e3) < 1e-6
    assert replay_fixed([0] * 64, 41, 2, COSTS).k_log == [2] * 40  # every draft rejected: one token a cycle


def test_rule_speculates_deep_on_right_drafts_and_decodes_plainly_on_wrong_ones():
    policy = AdaptivePolicy(steps=STEPS)
    right = replay_rule([8] * 200, 129, COSTS, policy, STEPS, switch_ms=0.0)
    hold = policy.stretch  # the prior's choice runs its 8 cycles, then the evidence takes over
    assert all(k > 0 for k in right.k_log[:hold]) and set(right.k_log[hold:]) == {4}
    wrong = replay_rule([0] * 200, 129, COSTS, policy, STEPS, switch_ms=0.0)
    assert wrong.k_log[-60:] == [0] * 60 and wrong.k_log[0] > 0  # the prior's first run speculates, then stops
    priced = replay_rule([0] * 200, 129, COSTS, policy, STEPS, switch_ms=0.0, update_ms=5.0)
    assert priced.k_log == wrong.k_log and priced.tokens_per_s < wrong.tokens_per_s  # one second branch: 5 ms
