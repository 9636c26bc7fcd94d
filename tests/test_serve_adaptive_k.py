"""The server's adaptive draft length (jaxspec.serving.adaptive_k): the rule against synthetic loops (a drafter that
never matches is switched off, one that matches well drafts deep, times are scaled across occupancies), and the
slot engine running a speculating server's loops at K chosen per loop, plain ones included: greedy answers equal
plain decoding's, and a plain loop leaves the draft as a cycle that accepted nothing would."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.sampling import SamplingParams
from jaxspec.serving.adaptive_k import BatchAdaptiveK, line_through, occupancy_bucket
from jaxspec.serving.slot_engine import SlotEngine, StepResult
from tests.sharded_pair import NUM_STEPS, sharded_pair


def _loop(k, live, seconds_per_cycle, accept, cycles=4, greedy=True):
    """A StepResult of `cycles` cycles over `live` slots whose drafts are each accepted with probability `accept`
    (expected counts), taking `seconds_per_cycle`."""
    n = live * cycles
    if k == 0:
        return StepResult([], np.zeros(0, bool), 0, n, cycles, 0, (n,), (round(accept * n), n if greedy else 0),
                          seconds_per_cycle * cycles)
    by_count = [n * accept**j * (1 - accept) for j in range(k)] + [n * accept**k]
    accepted = sum(j * c for j, c in enumerate(by_count))
    return StepResult([], np.zeros(0, bool), int(accepted), n, cycles, k, tuple(by_count), (0, 0),
                      seconds_per_cycle * cycles)


def _run(policy, loops, accept, cost, live=8, greedy=True):
    last, ks = None, []
    for _ in range(loops):
        k = policy(last)
        ks.append(k)
        last = _loop(k, live, cost(k), accept, greedy=greedy)
    return ks


def test_a_drafter_that_never_matches_is_switched_off_within_a_few_loops():
    policy = BatchAdaptiveK(4, explore_every=16)
    ks = _run(policy, 40, accept=0.0, cost=lambda k: 1.0 + 0.25 * k)
    assert ks[0] == 4 and 0 in ks[:6]  # every K is timed once, then plain steps
    assert policy.k == 0 and ks[10:].count(0) >= 27  # the rest: plain, but for the neighbour's refresh
    assert policy.acceptance()[1] < 0.1


def test_plain_steps_are_said_with_the_figures_and_shown_on_metrics():
    from jaxspec.serving.metrics import Metrics

    policy = BatchAdaptiveK(4, explore_every=16)
    _run(policy, 12, accept=0.0, cost=lambda k: 1.0 + 0.25 * k)
    assert policy.k == 0
    line = policy.verdict()
    # K = 1: 1.0x tokens for a cycle of 1.25 plain steps, the cheapest of the Ks that do not pay
    assert line.startswith("speculation off:") and "K, 1," in line and "1.25 plain steps" in line
    metrics = Metrics(8)
    metrics.speculation(policy.report())
    text = metrics.render()
    assert "jaxspec_speculation_k 0" in text and 'jaxspec_cycle_cost_plain_steps{k="4"} 2.0' in text
    assert 'jaxspec_draft_acceptance_estimate{position="1"}' in text
    good = BatchAdaptiveK(4)
    _run(good, 30, accept=0.9, cost=lambda k: 1.0 + 0.1 * k)
    assert good.verdict() is None  # speculating: nothing to say


def test_a_drafter_that_matches_drafts_deep_and_a_middling_one_where_its_rate_is_best():
    deep = BatchAdaptiveK(4)
    _run(deep, 30, accept=0.9, cost=lambda k: 1.0 + 0.1 * k)
    assert deep.k == 4
    middle = BatchAdaptiveK(4)
    _run(middle, 60, accept=0.6, cost=lambda k: 1.0 + 0.35 * k)
    # E[tokens | K] / t(K) at c = 0.6: K=0 1.00, 1 1.19, 2 1.15, 3 1.07, 4 0.98
    assert middle.k == 1
    assert middle.acceptance()[1:] == pytest.approx([0.6] * 4, abs=0.05)


def test_plain_loops_learn_the_first_position_from_the_probe_and_sampled_batches_from_exploration():
    probed = BatchAdaptiveK(2)
    probed.observe(_loop(0, 4, 1.0, 0.95))
    assert probed.acceptance()[1] > 0.8  # a plain loop observed the draft's first guesses matching
    sampled = BatchAdaptiveK(2, explore_every=8)
    ks = _run(sampled, 40, accept=0.0, cost=lambda k: 1.0 + 0.5 * k, greedy=False)
    assert ks[-1] in (0, 1) and 1 in ks[20:]  # still looked at from time to time (no probe without greedy slots)


def test_times_are_kept_per_occupancy_and_scaled_from_the_nearest_measured_one():
    assert [occupancy_bucket(x) for x in (0, 1, 1.5, 3, 8, 9)] == [1, 1, 2, 4, 8, 16]
    policy = BatchAdaptiveK(1)
    policy.k = 1
    policy.observe(_loop(1, 8, 100.0, 0.5))  # each program's first run is not a time: it carries one-time costs
    policy.observe(_loop(0, 8, 100.0, 0.5))
    policy.observe(_loop(1, 8, 2.0, 0.5))
    policy.observe(_loop(0, 8, 1.0, 0.5))
    policy.observe(_loop(1, 64, 6.0, 0.5))  # only K = 1 measured at 64 slots
    assert policy.cycle_time(0, 64) == pytest.approx(3.0)  # 6 x (1 / 2), as at 8 slots
    assert policy.cycle_time(1, 64) == pytest.approx(6.0)
    with pytest.raises(ValueError, match="num_steps >= 1"):
        BatchAdaptiveK(0)


def test_a_time_is_the_median_of_its_last_loops_and_unmeasured_ones_follow_the_line_through_the_measured():
    policy = BatchAdaptiveK(3)
    for k, seconds in ((1, 99.0), (1, 4.0), (1, 8.0), (1, 5.0), (3, 99.0), (3, 9.0)):  # first runs: not times
        policy.observe(_loop(k, 4, seconds, 0.5))
    assert policy.cycle_time(1, 4) == pytest.approx(5.0)  # the median of 4, 8 and 5 seconds a cycle
    policy.k = 1
    assert policy.cycle_time(2, 4) == pytest.approx((5.0 + 9.0) / 2)  # halfway along K = 1 .. 3
    points = {0: 1.0, 1: 2.5, 3: 4.0, 4: 6.5}
    assert line_through(points) == pytest.approx(tuple(np.polyfit(list(points), list(points.values()), 1)))


@pytest.fixture(scope="module")
def pair():
    return sharded_pair()


def test_a_speculating_server_with_plain_loops_answers_as_plain_decoding_and_keeps_its_draft_current(pair):
    cfg, w = pair
    kw = dict(max_batch=2, max_context=128, cycles_per_step=2, prefill_chunk=32)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
    plain = SlotEngine(cfg, w, num_steps=0, **kw)
    schedule = iter([0, 2, 0, 1, 0, 0, 2, 2, 0, 1] * 4)
    mixed = SlotEngine(cfg, w, num_steps=NUM_STEPS, choose_k=lambda last: next(schedule), **kw)
    mixed.choose_k.ks = (0, 1, 2)
    mixed.warm_up()
    assert {key[1] for key in mixed._programs if key[0] == "loop"} == {0, 1, 2}
    out = {}
    for name, engine in (("plain", plain), ("mixed", mixed)):
        got = [[engine.prefill(s, p, 12, SamplingParams(), seed=1)[0]] for s, p in enumerate(prompts)]
        while not all(len(g) >= 12 for g in got):
            result = engine.step(np.zeros((2,), bool), any_sampled=False)
            for s in range(2):
                got[s] += result.tokens[s]
        out[name] = [g[:12] for g in got]
    assert out["mixed"] == out["plain"]

    # one plain loop leaves the draft where a cycle of K = 1 whose draft was rejected would
    def after(k):
        engine = SlotEngine(cfg, w, num_steps=NUM_STEPS, choose_k=lambda last: k, cycles_per_step=1, max_batch=2,
                            max_context=128, prefill_chunk=32)
        engine.prefill(0, prompts[0], 12, SamplingParams(), seed=1)
        result = engine.step(np.zeros((2,), bool), any_sampled=False)
        return engine.state, result

    plain_state, plain_result = after(0)
    rejected_state, rejected_result = after(1)
    assert rejected_result.accepted == 0 and plain_result.tokens[0] == rejected_result.tokens[0]
    assert plain_result.probe[1] == 1 and rejected_result.accepted_by_count == (1, 0)
    np.testing.assert_allclose(plain_state.draft_logits[0], rejected_state.draft_logits[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(plain_state.draft_hidden[0], rejected_state.draft_hidden[0], rtol=1e-5, atol=1e-5)
    length = int(plain_state.target_cache.lengths[0])
    for a, b in zip(jnp.asarray(plain_state.draft_cache.k)[0], jnp.asarray(rejected_state.draft_cache.k)[0]):
        np.testing.assert_allclose(a[:length], b[:length], rtol=1e-5, atol=1e-5)


def test_serve_refuses_adaptive_without_a_draft_length():
    from jaxspec.cli_common import UsageError
    from jaxspec.serve import _check, build_parser

    with pytest.raises(UsageError, match="--speculative-adaptive needs --speculative-num-steps >= 1"):
        _check(build_parser().parse_args(["--speculative-adaptive", "--speculative-num-steps", "0"]))


def test_serve_is_adaptive_by_default_wherever_there_is_a_k_to_choose():
    from jaxspec.serve import _check, build_parser

    def adaptive(*argv):
        a = build_parser().parse_args(list(argv))
        _check(a)
        return a.speculative_adaptive

    assert adaptive() is True and adaptive("--speculative-num-steps", "2") is True
    assert adaptive("--speculative-num-steps", "0") is False  # plain decoding: nothing to choose
    assert adaptive("--no-speculative-adaptive") is False
