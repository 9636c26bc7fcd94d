"""Adaptive speculation (jaxspec.adaptive): the rule's model, greedy losslessness while K switches (forced schedules
and the rule itself), streaming, the cost table (measured, cached, never on disk on a CPU), and sampled output
distributed as plain sampling while K switches between cycles (chi-square)."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import adaptive_costs
from jaxspec.adaptive import (EXPLORE_BACKOFF, AdaptivePolicy, _observe, acceptance_rates, expected_tokens,
                              next_exploration, optimistic, priced_choice, probe_observe, throughput)
from jaxspec.adaptive_costs import CostTableError, parse_costs
from jaxspec.engine import Engine
from jaxspec.spec_step import draft_chain
from tests.switched_drafter import looped_oracle_drafts
from tests.speculative_cases import MAX_NEW, PROMPTS_3, baseline_tokens, pair  # noqa: F401 (fixtures)

STEPS = (0, 1, 2, 4)
# costs where speculation pays only with high acceptance: K = 4 wins at c = 1, K = 0 once c_1 <= 0.25
COSTS = ((0, 1.0), (1, 1.6), (2, 1.8), (4, 2.2))


# --- the rule ---------------------------------------------------------------------------------------------

def test_expected_tokens_is_the_accepted_prefix_model():
    c = jnp.asarray([[0.5, 0.5, 0.5, 0.5], [1.0, 1.0, 0.0, 1.0], [0.9, 0.8, 0.7, 0.6]])
    got = np.asarray(expected_tokens(c, STEPS, jnp.asarray([100, 100, 100])))
    want = [[1 + sum(np.prod(row[:j]) for j in range(1, k + 1)) for k in STEPS] for row in np.asarray(c)]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got[1], [1, 2, 3, 3])
    # a row with 2 tokens left gains nothing from a second draft
    np.testing.assert_allclose(np.asarray(expected_tokens(c, STEPS, jnp.asarray([2, 1, 100])))[:2],
                               [[1, 1.5, 1.5, 1.5], [1, 1, 1, 1]])


def choose(accept_BJ, cost_N, live_B, remaining_B, steps):
    """The rule's branch for a fresh generation (no branch run yet, so no first-run price)."""
    rate_N, _ = throughput(accept_BJ, cost_N, live_B, remaining_B, steps)
    return priced_choice(rate_N, 200.0, jnp.zeros(len(steps), bool), 0.0)


def test_rule_maximises_tokens_per_second_over_the_live_rows():
    cost = jnp.asarray([c for _, c in COSTS])
    live = jnp.asarray([True, True])
    many = jnp.asarray([100, 100])
    assert int(choose(jnp.ones((2, 4)), cost, live, many, STEPS)[0]) == 3  # K = 4
    assert int(choose(jnp.full((2, 4), 0.2), cost, live, many, STEPS)[0]) == 0  # plain decoding
    # one row that accepts everything and one that accepts nothing: 6 tokens / 2.2 beats 2 / 1.0
    mixed = jnp.asarray([[1.0] * 4, [0.0] * 4])
    assert int(choose(mixed, cost, live, many, STEPS)[0]) == 3
    # ... unless the accepting row is finished
    assert int(choose(mixed, cost, jnp.asarray([False, True]), many, STEPS)[0]) == 0
    # flat costs: more drafts never lose
    assert int(choose(jnp.full((2, 4), 0.1), jnp.ones(4), live, many, STEPS)[0]) == 3
    # optimism lifts only the deeper positions, up to the first one's rate
    np.testing.assert_allclose(np.asarray(optimistic(jnp.asarray([[0.9, 0.1, 0.95, 0.0]]))), [[0.9, 0.9, 0.95, 0.9]])


def test_a_branch_not_yet_run_pays_its_first_run():
    rate_N = jnp.asarray([100.0, 120.0, 125.0])  # tokens per second of three branches
    used_N = jnp.asarray([False, True, False])  # branch 1 runs now
    # 50 tokens left: branch 2 would save 50/120 - 50/125 = 17 ms, less than a 20 ms first run
    assert int(priced_choice(rate_N, 50.0, used_N, 0.02)[0]) == 1
    assert int(priced_choice(rate_N, 500.0, used_N, 0.02)[0]) == 2  # 167 ms saved: worth it
    assert int(priced_choice(rate_N, 50.0, jnp.zeros(3, bool), 0.02)[0]) == 2  # the first branch: no price
    assert int(priced_choice(rate_N, 50.0, jnp.asarray([True, True, True]), 0.02)[0]) == 2  # run before: no price
    _, stays = priced_choice(rate_N, 500.0, used_N, 0.0, current=1, hysteresis=0.05)
    assert bool(stays)  # within 5% of the best
    assert not bool(priced_choice(rate_N, 500.0, used_N, 0.0, current=0, hysteresis=0.05)[1])


def test_estimates_shrink_towards_the_shallower_position():
    none = jnp.zeros((1, 4))
    np.testing.assert_allclose(np.asarray(acceptance_rates(none, none, 0.5)), [[0.5] * 4])  # nothing seen: prior
    # position 1 seen accepting 8 times of 8: every deeper position, never tried, expects about as much
    hits = jnp.asarray([[8.0, 0, 0, 0]])
    trials = jnp.asarray([[8.0, 0, 0, 0]])
    c = np.asarray(acceptance_rates(hits, trials, 0.5))[0]
    np.testing.assert_allclose(c, [8.5 / 9] * 4, rtol=1e-6)
    # a deeper position's own evidence outweighs its neighbour's once it has some
    c = np.asarray(acceptance_rates(jnp.asarray([[8.0, 0.0, 0, 0]]), jnp.asarray([[8.0, 8.0, 0, 0]]), 0.5))[0]
    np.testing.assert_allclose(c[1], (8.5 / 9) / 9, rtol=1e-6)
    assert c[2] == c[3] == c[1]


def test_exploration_backs_off_while_it_confirms_the_rule():
    every, gap, nxt, explored = 4, 4, 3, []
    for cycle in range(200):  # plain steps win; every exploration's outcome leaves them winning
        exploring = cycle >= nxt
        if exploring:
            explored.append(cycle)
        nxt, gap = (int(x) for x in next_exploration(cycle, exploring, True, cycle == 0, gap, nxt, every))
    gaps = np.diff(explored)
    assert list(gaps[:4]) == [8, 16, 32, 64] and max(gaps) == every * EXPLORE_BACKOFF
    # an exploration that changes the rule's mind does not back off ...
    nxt, gap = next_exploration(300, True, False, False, 32, 300, every)
    assert (int(nxt), int(gap)) == (332, 32)
    # ... and the rule changing its choice brings exploration back to every `every` cycles
    nxt, gap = next_exploration(300, False, False, True, every * EXPLORE_BACKOFF, 900, every)
    assert (int(nxt), int(gap)) == (304, 4)


def test_a_catch_up_observes_as_one_observation_at_a_time():
    """probe_observe over a backlog equals `_observe` applied entry by entry; a sampled catch-up that reads only
    the most recent entries equals the same over those entries alone."""
    ema, n = 0.25, 6
    obs = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    start = (jnp.array([[2.0, 1.0]]), jnp.array([[3.0, 2.0]]))

    def one_at_a_time(entries):
        hits, trials = start
        for i in entries:
            hits, trials = _observe(hits, trials, jnp.array([[True, False]]), jnp.array([[obs[i], 0.0]]), ema)
        return hits, trials

    n_B = jnp.array([n], jnp.int32)
    every = probe_observe(start, jnp.asarray(obs)[None], jnp.arange(n)[None], n_B, ema)
    np.testing.assert_allclose(np.concatenate(every), np.concatenate(one_at_a_time(range(n))), rtol=1e-6)
    # the last 4 entries, as a sampled probe of width 4 reads them; a probe wider than the backlog reads padding
    # (negative entries), which observes nothing
    idx = jnp.array([[-2, -1, 2, 3, 4, 5]])
    last = probe_observe(start, jnp.asarray(np.concatenate([[1.0, 1.0], obs[2:]]))[None], idx, n_B, ema)
    np.testing.assert_allclose(np.concatenate(last), np.concatenate(one_at_a_time(range(2, n))), rtol=1e-6)
    assert float(last[1][0, 1]) == 2.0  # deeper positions untouched


def test_cost_table_is_the_slope_between_a_short_and_a_long_call(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(adaptive_costs.time, "perf_counter", lambda: clock[0])
    per_cycle = {0: 0.001, 1: 0.003}

    calls = []

    def run_forced(state, branch, cycles):  # every call costs 7 ms beyond its cycles
        calls.append((branch, cycles))
        clock[0] += 0.007 + cycles * per_cycle[branch]
        return state, cycles

    state = collections.namedtuple("State", "generated")(jnp.zeros(3))  # what `measure` copies and waits for
    got = adaptive_costs.measure(run_forced, state, 2, cycles=(16, 48), repeats=3, first_run=True)
    np.testing.assert_allclose(got.costs_s, [0.001, 0.003], rtol=1e-9)
    assert got.first_run_s == pytest.approx(0.007)  # the calls' fixed cost prices a branch's first run
    assert adaptive_costs.measure(run_forced, state, 2, cycles=(16, 48), repeats=1).first_run_s == 0.0  # on a CPU
    # each branch is warmed up by a long call (every path of it run once, untimed), then 3 rounds over the branches
    # of a timed pair each
    assert calls[:14] == [(0, 48), (1, 48)] + [(b, n) for _ in range(3) for b in (0, 1) for n in (16, 48)]


def test_on_a_cpu_the_fastest_round_prices_each_k(monkeypatch):
    """A CPU's default: a call of no cycle against one of 24, three rounds, the least per K (other load only adds
    time, so one slow round must not price a K)."""
    assert jax.default_backend() == "cpu"
    clock, calls = [0.0], []
    per_cycle = {0: 0.002, 1: 0.004}

    def run_forced(state, branch, cycles):
        calls.append((branch, cycles))
        slow = 1.5 if len(calls) in (3, 4) else 1.0  # the first round's K = 0 pair runs on a loaded machine
        clock[0] += 0.0005 + slow * cycles * per_cycle[branch]
        return state, cycles

    monkeypatch.setattr(adaptive_costs.time, "perf_counter", lambda: clock[0])
    state = collections.namedtuple("State", "generated")(jnp.zeros(3))
    got = adaptive_costs.measure(run_forced, state, 2)
    np.testing.assert_allclose(got.costs_s, [0.002, 0.004], rtol=1e-9)
    assert got.first_run_s == 0.0
    assert calls == [(0, 24), (1, 24)] + [(b, n) for _ in range(3) for b in (0, 1) for n in (0, 24)]


def test_off_a_cpu_cheap_rounds_are_repeated_within_the_budget(monkeypatch):
    """On an accelerator the median of the slopes prices each K, over more rounds where a round is cheap (a small
    model's table otherwise moves between processes by as much as neighbouring K differ), at most
    MEASURE_REPEATS_MAX, at least MEASURE_REPEATS."""
    monkeypatch.setattr(adaptive_costs.jax, "default_backend", lambda: "gpu")

    def rounds(per_cycle_s):
        clock, calls = [0.0], []

        def run_forced(state, branch, cycles):
            calls.append((branch, cycles))
            clock[0] += 0.001 + cycles * per_cycle_s * (branch + 1)
            return state, cycles

        monkeypatch.setattr(adaptive_costs.time, "perf_counter", lambda: clock[0])
        state = collections.namedtuple("State", "generated")(jnp.zeros(3))
        got = adaptive_costs.measure(run_forced, state, 2)
        np.testing.assert_allclose(got.costs_s, [per_cycle_s, 2 * per_cycle_s], rtol=1e-9)
        return (len(calls) - 2) // 4  # after the warm-up, a short and a long call per branch a round

    # warm-up long calls 49 + 97 ms: a round is at most 0.29 s, 3 rounds; at a tenth of that, 9 (the cap)
    assert rounds(1e-3) == adaptive_costs.MEASURE_REPEATS == 3
    assert rounds(1e-4) == adaptive_costs.MEASURE_REPEATS_MAX == 9
    warm_s = 2 * 0.001 + 48 * 6e-4 * (1 + 2)  # the two branches' warm-up long calls
    assert rounds(6e-4) == int(adaptive_costs.MEASURE_BUDGET_S / (2 * warm_s)) == 5


def test_measured_table_never_falls_with_k(monkeypatch):
    """More drafts are more work: a table whose t(K) falls with K holds noise; each run of violators is pooled."""
    assert adaptive_costs.nondecreasing([7.0, 15.0, 21.0, 19.0, 29.0]) == (7.0, 15.0, 20.0, 20.0, 29.0)
    assert adaptive_costs.nondecreasing([1.0, 3.0, 2.0, 2.0, 5.0]) == pytest.approx((1.0, 7 / 3, 7 / 3, 7 / 3, 5.0))
    assert adaptive_costs.nondecreasing([3.0, 2.0, 1.0]) == (2.0, 2.0, 2.0)
    clock = [0.0]
    monkeypatch.setattr(adaptive_costs.time, "perf_counter", lambda: clock[0])
    per_cycle = {0: 0.001, 1: 0.004, 2: 0.003}  # the K = 2 branch timed faster than K = 1

    def run_forced(state, branch, cycles):
        clock[0] += cycles * per_cycle[branch]
        return state, cycles

    state = collections.namedtuple("State", "generated")(jnp.zeros(3))
    got = adaptive_costs.measure(run_forced, state, 3, cycles=(16, 48), repeats=1)
    np.testing.assert_allclose(got.costs_s, [0.001, 0.0035, 0.0035], rtol=1e-9)


def test_policy_and_cost_table_validation():
    assert AdaptivePolicy().resolve_steps(4) == (0, 1, 2, 3, 4)
    assert AdaptivePolicy().resolve_steps(3) == (0, 1, 2, 3)
    assert AdaptivePolicy().resolve_steps(8) == (0, 1, 2, 3, 4, 6, 8)
    assert AdaptivePolicy().resolve_steps(5) == (0, 1, 2, 3, 4, 5)
    assert AdaptivePolicy().resolve_steps(1) == (0, 1)
    # the backlog: short on an accelerator while the probe reads c_1 from it, long on a CPU and without the probe
    assert AdaptivePolicy().backlog_on("gpu") == 8 and AdaptivePolicy().backlog_on("cpu") == 32
    assert AdaptivePolicy(probe=False).backlog_on("gpu") == 32 and AdaptivePolicy(backlog=4).backlog_on("cpu") == 4
    assert AdaptivePolicy().backlog_width == AdaptivePolicy().backlog_on(jax.default_backend())
    for bad in (AdaptivePolicy(steps=(0,)), AdaptivePolicy(steps=(0, 5)), AdaptivePolicy(ema=0.0),
                AdaptivePolicy(costs=((0, 1.0), (1, 1.0))), AdaptivePolicy(schedule=(5,)), AdaptivePolicy(backlog=0),
                AdaptivePolicy(hysteresis=1.0), AdaptivePolicy(hysteresis=-0.1)):
        with pytest.raises(ValueError):
            bad.validate(4)
    assert parse_costs('{"0": 10, "1": 12, "2": 13, "4": 16.5}', STEPS) == ((0, 0.01), (1, 0.012), (2, 0.013),
                                                                            (4, 0.0165))
    for text, needle in [('{"0": 1}', "compiled set"), ('{"0": 1, "1": 0, "2": 1, "4": 1}', "K=1"),
                         ("[1, 2]", "JSON object"), ("{nope", "not valid JSON"), ("/no/such/costs.json", "readable"),
                         ('{"x": 1}', "'x'")]:
        with pytest.raises(CostTableError) as e:
            parse_costs(text, STEPS)
        assert needle in str(e.value) and "--speculative-adaptive-costs" in str(e.value)


# --- greedy: lossless while K switches -------------------------------------------------------------------

def mixed_drafter(key, w, cfg, state, k, greedy, sp):
    """Row 0 proposes the target's continuation, row 1 never does, row 2 the EAGLE-3 draft's own tokens."""
    right = looped_oracle_drafts(w, cfg, state, k)  # oracle_drafter's tokens, one target step to compile
    wrong = (right + 1) % cfg.target.vocab_size  # wrong_drafter's tokens, without running the oracle twice
    eagle, q, cache = draft_chain(key, w, cfg, state, k, greedy, sp)
    row = jnp.arange(right.shape[0])[:, None]
    return jnp.where(row == 0, right, jnp.where(row == 1, wrong, eagle)), q, cache


def right_then_wrong_drafter(key, w, cfg, state, k, greedy, sp):
    """The target's continuation until 12 tokens are out, then never."""
    right = looped_oracle_drafts(w, cfg, state, k)
    wrong = (right + 1) % cfg.target.vocab_size
    return jnp.where(state.generated[:, None] < 12, right, wrong), None, state.draft_cache


SCHEDULE = (0, 2, 0, 0, 1, 4, 0)  # plain steps before, between and after cycles of every K
RULE_COSTS = ((0, 1.0), (4, 2.2))  # two branches: half the program to compile


def test_forced_k_switching_is_lossless_and_logged(pair, baseline_tokens):
    cfg, w = pair
    eng = Engine(cfg, w, num_steps=4, drafter=mixed_drafter,
                 adaptive=AdaptivePolicy(steps=STEPS, costs=COSTS, schedule=SCHEDULE, backlog=2,
                                         stretch=2))  # backlog 2: full catch-ups too
    res = eng.generate(PROMPTS_3, MAX_NEW)
    assert res.tokens == baseline_tokens
    ks = res.adaptive.k_per_cycle
    assert ks == [SCHEDULE[c % len(SCHEDULE)] for c in range(res.cycles)]
    assert res.adaptive.cost_source == "given" and res.adaptive.measure_s == 0.0
    assert sum(res.adaptive.k_histogram.values()) == res.cycles
    for row, (acc, toks) in enumerate(zip(res.accepted, res.tokens)):
        assert all(a == 0 for a, k in zip(acc, ks) if k == 0)  # a plain step drafts nothing
        if row == 0:  # the right drafter: every draft accepted while tokens remain
            assert all(a == k for a, k in zip(acc[:-2], ks) if k > 0)
        if row == 1:
            assert all(a == 0 for a in acc)
        assert 1 + sum(a + 1 for a in acc) >= len(toks) > sum(a + 1 for a in acc[:-1])
    assert res.stats.cycles == sum(1 for row in res.accepted for a, k in zip(row, ks) if k > 0)


@pytest.fixture(scope="module")
def rule_engine(pair):
    """The rule on its own: prior 1 (start at K = 4), a fast average so the switch happens within 24 tokens."""
    cfg, w = pair
    return Engine(cfg, w, num_steps=4, drafter=right_then_wrong_drafter,
                  adaptive=AdaptivePolicy(steps=(0, 4), costs=RULE_COSTS, prior=1.0, ema=0.5, backlog=4))


def test_rule_speculates_while_drafts_are_accepted_then_decodes_plainly(rule_engine, baseline_tokens):
    res = rule_engine.generate(PROMPTS_3, MAX_NEW)
    assert res.tokens == baseline_tokens
    ks = res.adaptive.k_per_cycle
    assert ks[:3] == [4, 4, 4]  # 1 + 3 x 5 > 12 tokens of right drafts
    assert 0 in ks and all(k == 0 for k in ks[ks.index(0):])  # then plain steps, the probe agreeing
    assert res.adaptive.expected_tokens > 0 and res.adaptive.expected_tokens_per_s > 0


def test_streaming_reports_what_the_device_loop_reports(rule_engine):
    on_device = rule_engine.generate(PROMPTS_3, MAX_NEW)
    events = list(rule_engine.stream(PROMPTS_3, MAX_NEW))
    streamed = events[-1]
    assert [sum((ev[i] for ev in events[:-1]), []) for i in range(3)] == streamed.tokens == on_device.tokens
    assert streamed.adaptive.k_per_cycle == on_device.adaptive.k_per_cycle
    assert streamed.accepted == on_device.accepted


def test_cost_table_is_measured_once_and_never_written_on_a_cpu(pair, rule_engine, tmp_path, monkeypatch):
    cfg, w = pair
    monkeypatch.setenv("JAXSPEC_COST_CACHE", str(tmp_path / "costs"))
    policy = AdaptivePolicy(steps=(0, 4), prior=1.0, ema=0.5, backlog=4)  # rule_engine's program: costs are data
    eng = Engine(cfg, w, num_steps=4, drafter=right_then_wrong_drafter, adaptive=policy)
    first = eng.generate(PROMPTS_3, MAX_NEW)
    assert first.adaptive.cost_source == "measured" and first.adaptive.measure_s > 0
    assert len(first.adaptive.costs_s) == 2 and all(0 < c < 10 for c in first.adaptive.costs_s)
    second = eng.generate(PROMPTS_3, MAX_NEW)
    assert second.adaptive.cost_source == "cached" and second.adaptive.costs_s == first.adaptive.costs_s
    assert second.tokens == first.tokens
    assert not (tmp_path / "costs").exists()


def test_off_a_cpu_a_table_falling_with_k_is_measured_again(monkeypatch):
    """A K priced more than MAX_FALL below a smaller K is noise: off a CPU the rounds run again (at most
    MEASURE_ATTEMPTS times) and the attempt that falls least prices the table."""
    monkeypatch.setattr(adaptive_costs.jax, "default_backend", lambda: "gpu")
    assert adaptive_costs.falls([1.0, 2.0, 2.0, 3.0]) == 0.0
    assert adaptive_costs.falls([1.0, 2.0, 1.5, 3.0]) == pytest.approx(0.25)
    clock, calls = [0.0], []
    # the first attempt's rounds price K = 2 at half its cost (a disturbance lasting them all), the next ones not
    disturbed = {"on": True}

    def run_forced(state, branch, cycles):
        calls.append((branch, cycles))
        per_cycle = [0.001, 0.002, 0.003][branch]
        if branch == 2 and disturbed["on"]:
            per_cycle /= 2
        clock[0] += 0.001 + cycles * per_cycle
        return state, cycles

    monkeypatch.setattr(adaptive_costs.time, "perf_counter", lambda: clock[0])
    state = collections.namedtuple("State", "generated")(jnp.zeros(3))

    def measure_with(disturbance_rounds):
        calls.clear()
        original = run_forced

        def counting(state, branch, cycles):
            # the warm-up (3 calls) and the first attempt's rounds (3 x 3 pairs) are disturbed
            disturbed["on"] = len(calls) < 3 + disturbance_rounds * 6
            return original(state, branch, cycles)

        return adaptive_costs.measure(counting, state, 3, cycles=(16, 48), repeats=3)

    got = measure_with(3)
    np.testing.assert_allclose(got.costs_s, [0.001, 0.002, 0.003], rtol=1e-9)
    assert len(calls) == 3 + 2 * 3 * 6  # warm-up, the disturbed attempt, one more
    got = measure_with(100)  # disturbed throughout: three attempts, then the pooled table
    assert len(calls) == 3 + 3 * 3 * 6
    np.testing.assert_allclose(got.costs_s, [0.001, 0.00175, 0.00175], rtol=1e-9)
