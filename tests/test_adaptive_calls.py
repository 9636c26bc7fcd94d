"""Adaptive speculation by call (jaxspec.adaptive_calls, the GPU default): the host rule and its stay band, greedy
output equal to plain decoding while K changes between calls, a drafter that never matches switched off, the
streamed run, and sampled output distributed as plain sampling."""

import collections
import dataclasses
import functools

import numpy as np
import pytest

from jaxspec.adaptive_calls import (PerCallPolicy, Pool, acceptance_BJ, better_k, finish_times_N, observed_GN,
                                    stay_band, window_counts)
from jaxspec.engine import Engine
from jaxspec.sampling import SamplingParams
from tests.speculative_cases import MAX_NEW, PROMPTS_3, baseline_tokens, pair  # noqa: F401 (fixtures)
from tests.switched_drafter import looped_oracle_drafts

STEPS = (0, 1, 2, 3)
# costs where speculation pays only with high acceptance: K = 3 wins at c = 1, plain decoding at c = 0.2
COSTS = ((0, 1.0), (1, 1.6), (2, 1.8), (3, 2.0))


# --- the rule ---------------------------------------------------------------------------------------------

def test_window_counts_observe_the_accepted_prefix_and_the_first_rejection():
    log = np.array([[3, 0, 1, -1], [2, 2, -1, -1]])  # K = 3: row 0 accepted 3, 0, 1 drafts; row 1 2, 2
    hits, trials = window_counts(log, 0, 4, 3, 4, 32)
    np.testing.assert_array_equal(hits, [[2, 1, 1, 0], [2, 2, 0, 0]])
    np.testing.assert_array_equal(trials, [[3, 2, 1, 0], [2, 2, 2, 0]])  # position 4 is never drafted at K = 3
    hits, trials = window_counts(log, 0, 3, 3, 4, 1)  # the window: the last cycle only
    np.testing.assert_array_equal(trials, [[1, 1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(window_counts(log, 1, 3, 3, 4, 32)[1][0], [2, 1, 0, 0])  # from the call's start


def test_rule_takes_the_k_that_finishes_first_and_leaves_only_where_it_pays_the_switch():
    cost = np.array([c for _, c in COSTS])
    live, remaining = np.array([True]), np.array([100])
    c = acceptance_BJ(np.zeros((1, 3)), np.zeros((1, 3)), np.zeros(3), np.zeros(3), 1.0)
    np.testing.assert_allclose(c, 1.0)  # no observation: the prior at every depth
    assert better_k(finish_times_N(c, remaining, live, cost, STEPS), 0, 0.0, 0.03) == (3, True)
    low = acceptance_BJ(np.zeros((1, 3)), np.full((1, 3), 50.0), np.zeros(3), np.zeros(3), 1.0)
    assert better_k(finish_times_N(low, remaining, live, cost, STEPS), 3, 0.0, 0.03) == (0, True)
    # the same gain is not worth a switch that costs more than it saves, nor with few tokens left
    t = finish_times_N(low, remaining, live, cost, STEPS)
    assert better_k(t, 3, float(t[3] - t[0]) + 1.0, 0.03) == (0, False)
    assert better_k(finish_times_N(low, np.array([100]), live, cost, STEPS), 3, 2.5, 0.03)[1]
    assert not better_k(finish_times_N(low, np.array([2]), live, cost, STEPS), 3, 2.5, 0.03)[1]
    # the smallest K within the margin of the fastest is taken (plain decoding's time is known, a deeper K's
    # estimate the least sure), and nothing outside it
    assert better_k(np.array([10.0, 9.8, 12.0]), 2, 0.0, 0.03) == (0, True)
    assert better_k(np.array([10.0, 9.0, 12.0]), None, 0.0, 0.03) == (1, True)
    assert better_k(np.array([12.0, 10.0, 10.2, 9.9]), None, 0.0, 0.03) == (1, True)
    assert better_k(np.array([12.0, 10.5, 10.1, 9.9]), None, 0.0, 0.03) == (2, True)
    assert better_k(np.array([12.0, 10.5, 10.1, 9.9]), None, 0.0, 0.0) == (3, True)
    # ... among the K whose every position was observed; where none within the margin was, the fastest, so its
    # cycles observe the depths the smaller K would leave unobserved
    observed = observed_GN(np.array([[5.0, 0.0, 0.0]]), (0, 1, 2, 3))[0]
    assert observed.tolist() == [True, True, False, False]
    assert better_k(np.array([12.0, 10.5, 10.1, 9.9]), None, 0.0, 0.03, observed) == (3, True)
    assert better_k(np.array([12.0, 10.1, 10.1, 9.9]), None, 0.0, 0.03, observed) == (1, True)
    assert observed_GN(np.array([[3.0, 0.5, 2.0]]), (0, 2, 3))[0].tolist() == [True, False, False]
    # the slowest live row sets the time; a finished row does not count
    mixed = np.stack([c[0], low[0]])
    assert better_k(finish_times_N(mixed, np.array([100, 100]), np.array([True, False]), cost, STEPS), 0, 0.0,
                    0.03) == (3, True)
    # the pool stands in for positions not observed in the call, and is capped
    pool = Pool(3, cap=32.0)
    pool.add(np.full((2, 3), 30.0), np.full((2, 3), 40.0))
    assert pool.trials.max() == pytest.approx(32.0) and pool.hits[0] == pytest.approx(24.0)
    pool.new_generation()
    assert pool.trials[0] == pytest.approx(16.0)


def test_stay_band_holds_the_acceptance_where_k_is_best():
    cost = np.array([c for _, c in COSTS])
    live, remaining = np.array([True]), np.array([100])
    none = (np.zeros(3), np.zeros(3), 0.7)  # an empty pool, the prior
    low, high, plain_high = stay_band(3, remaining, live, cost, STEPS, 0.0, 0.0, *none, 1000)
    assert 0.0 < low < high == pytest.approx(3.0)  # full acceptance keeps K = 3; little sends it to plain steps
    assert 0.0 <= plain_high < low  # from c = 0 up to plain_high the host leaves K = 3 for plain decoding
    lo1, hi1, plain1 = stay_band(1, remaining, live, np.array([1.0, 1.2, 1.6, 2.0]), STEPS, 0.0, 0.0, *none, 1000)
    assert 0.1 < lo1 < hi1 < 0.9 and 0.0 <= plain1 < lo1  # K = 1 is best only in a middle band, plain below it
    # a set without plain decoding: nothing leaves for it
    assert stay_band(3, remaining, live, cost[1:], STEPS[1:], 0.0, 0.0, *none, 1000)[2] == -np.inf
    assert stay_band(1, remaining, live, cost, STEPS, 0.0, 0.0, *none, 1000) == (-np.inf, np.inf, -np.inf)
    # a switch dearer than any saving: no acceptance leaves K
    assert stay_band(3, remaining, live, cost, STEPS, 1e6, 0.0, *none, 1000) == (-np.inf, np.inf, -np.inf)
    # the band is the host's choice: a few observations weigh against the prior, so it is wider
    assert stay_band(3, remaining, live, cost, STEPS, 0.0, 0.0, *none, 4)[0] < low
    with pytest.raises(ValueError, match="costs name"):
        PerCallPolicy(costs=((0, 1.0), (1, 1.0))).validate(3)
    with pytest.raises(ValueError, match="margin"):
        PerCallPolicy(margin=1.0).validate(3)
    with pytest.raises(ValueError, match="plain_tails"):
        PerCallPolicy(plain_tails=(4,)).validate(3)
    assert PerCallPolicy(steps=(1, 2), plain_tails=(1,)).resolve_tails(2) == ()  # no plain decoding to go on with
    assert PerCallPolicy(steps=(0, 2, 3), plain_tails=(1, 2)).compiled(3) == ((0, 2, 3), 32, (2,))


def test_where_a_call_is_cheap_a_loop_leaves_for_plain_decoding_on_a_full_windows_evidence():
    """The first test's band is priced for its few cycles against the pool and the prior; where one more call costs
    no more than a plain step its low edge rises to where a full window would send the host to plain decoding, and
    where a call is dear it stays as priced (a dip there costs more than a call's worth of steps)."""
    from jaxspec.adaptive_calls import RULE_LOW, call_outweighs_step
    from jaxspec.adaptive_calls_run import Calls, rule_inputs

    steps, costs = (0, 1, 2, 3, 4), np.array([10.97, 13.95, 17.34, 21.29, 25.00]) * 1e-3  # 61 layers, one H200
    policy = PerCallPolicy().validate(4)
    pool = Pool(4, float(policy.window))
    pool.add(np.array([[0.6, 0.09, 0.0, 0.0]]), np.array([[4.0, 0.6, 0.0, 0.0]]))  # 4 cycles of K = 2 at c ~ 0.15
    remaining, live = np.array([120]), np.array([True])
    band = functools.partial(stay_band, 1, remaining, live, costs, steps)
    first = band(4e-3, policy.margin, pool.hits, pool.trials, policy.prior, policy.min_cycles)
    full = band(4e-3, policy.margin, pool.hits, pool.trials, policy.prior, policy.window)
    assert first[0] < 0.15 < full[2]  # a window mean of 0.15 keeps K = 1 at the first test's band, not at a full one
    cheap = rule_inputs(Calls(steps, pool, costs, 4e-3), 1, remaining, live, policy, policy.min_cycles, 10**6)
    assert not call_outweighs_step(costs, steps, 4e-3)
    assert cheap[RULE_LOW] == pytest.approx(full[2], abs=1e-6) and cheap[RULE_LOW] > full[2]
    dear = rule_inputs(Calls(steps, pool, costs, 12e-3), 1, remaining, live, policy, policy.min_cycles, 10**6)
    assert call_outweighs_step(costs, steps, 12e-3)
    assert dear[RULE_LOW] == pytest.approx(band(12e-3, policy.margin, pool.hits, pool.trials, policy.prior,
                                                 policy.min_cycles)[0])


# --- engines ------------------------------------------------------------------------------------------------

def right_then_wrong_drafter(key, w, cfg, state, k, greedy, sp):
    """The target's continuation until 12 tokens are out, then never."""
    right = looped_oracle_drafts(w, cfg, state, k)
    wrong = (right + 1) % cfg.target.vocab_size
    import jax.numpy as jnp
    return jnp.where(state.generated[:, None] < 12, right, wrong), None, state.draft_cache


@pytest.fixture(scope="module")
def calls_engine(pair):
    cfg, w = pair
    return Engine(cfg, w, num_steps=3, drafter=right_then_wrong_drafter,
                  adaptive=PerCallPolicy(steps=STEPS, costs=COSTS, prior=1.0, min_cycles=2, window=4))


def test_calls_speculate_while_drafts_are_accepted_then_decode_plainly(calls_engine, baseline_tokens):
    res = calls_engine.generate(PROMPTS_3, MAX_NEW)
    assert res.tokens == baseline_tokens  # greedy: the same tokens whatever K ran
    ks = res.adaptive.k_per_cycle
    assert ks[0] == 3 and 0 in ks and all(k == 0 for k in ks[ks.index(0):])
    assert ks.index(0) <= 10  # 3 cycles of right drafts, then off once the window of 4 holds mostly wrong ones
    assert sum(res.adaptive.k_histogram.values()) == res.cycles == len(ks)
    for acc, toks in zip(res.accepted, res.tokens):
        assert len(acc) <= len(ks) and 1 + sum(a + 1 for a in acc) >= len(toks)
    # the streamed run makes the same choices from the tokens it reads
    events = list(calls_engine.stream(PROMPTS_3, MAX_NEW))
    streamed = events[-1]
    assert [sum((ev[i] for ev in events[:-1]), []) for i in range(3)] == streamed.tokens == baseline_tokens
    assert streamed.adaptive.k_per_cycle[0] == 3 and streamed.adaptive.k_per_cycle[-1] == 0


def test_the_loop_leaves_where_the_window_mean_first_leaves_the_band(calls_engine):
    """The loop's carried window against the mean recomputed from its own log: it runs its minimum, then stops
    after the first cycle whose last `window` cycles' mean is out of the band, and not before; its summary reads
    back as the state it returned."""
    import jax

    from jaxspec.adaptive_calls import read_summary, rule_array, spec_loop

    eng, greedy = calls_engine, SamplingParams()
    state = eng._prefill(PROMPTS_3, MAX_NEW, greedy, 0, True)[0]
    loop = jax.jit(lambda s, rule: spec_loop(eng.weights, s, {}, rule, cfg=eng.cfg, k=3, window=4, greedy=True,
                                             max_new_tokens=MAX_NEW, drafter=eng.drafter))
    out, summary = loop(state, rule_array(1.0, 3.0, 2, 1000))
    log, cycles = np.asarray(out.accepted_log), int(out.cycles)
    assert summary.sharding.memory_kind == "pinned_host"  # the program wrote it to the host's memory
    read = read_summary(summary, out)
    assert read.cycles == cycles and (read.done_B == np.asarray(out.done)).all()
    assert (read.generated_B == np.asarray(out.generated)).all() and (read.log_BC == log).all()
    assert (read.out_tokens_BN == np.asarray(out.out_tokens)).all()
    assert read.plain_steps == 0 and (read.plain_from_B == read.generated_B).all()  # no tail in this loop

    def outside(n):  # after n cycles of this call
        seen = log[:, max(0, n - 4):n]
        mean = seen[seen >= 0].mean()
        return n >= 2 and not 1.0 <= mean <= 3.0

    assert 2 < cycles < 10 and outside(cycles) and not any(outside(n) for n in range(1, cycles))


def test_a_loop_with_a_plain_tail_goes_on_plainly_where_its_test_leaves_for_plain_decoding(calls_engine,
                                                                                          baseline_tokens):
    """The same loop with its plain tail: where the window's mean left the band at or below the rule's plain_high,
    plain steps follow to the end in the same call (greedy: plain decoding's tokens), and the summary says how many
    and from which tokens; where the rule says plain decoding does not pay (plain_high -inf), the call ends as
    without a tail."""
    import jax

    from jaxspec.adaptive_calls import read_summary, rule_array, spec_loop

    eng, greedy = calls_engine, SamplingParams()
    loop = jax.jit(lambda s, rule: spec_loop(eng.weights, s, {}, rule, cfg=eng.cfg, k=3, window=4, greedy=True,
                                             max_new_tokens=MAX_NEW, drafter=eng.drafter, plain_tail=True))
    state = eng._prefill(PROMPTS_3, MAX_NEW, greedy, 0, True)[0]
    out, summary = loop(state, rule_array(1.0, 3.0, 2, 1000, 1.0))
    read = read_summary(summary, out)
    assert read.plain_steps > 0 and read.done_B.all()
    assert [row[:n].tolist() for row, n in zip(read.out_tokens_BN, read.generated_B)] == baseline_tokens
    assert (read.plain_from_B < read.generated_B).any() and read.cycles == int(out.cycles) < 10
    assert np.all(read.generated_B - read.plain_from_B <= read.plain_steps)  # one token a plain step a live row
    state = eng._prefill(PROMPTS_3, MAX_NEW, greedy, 0, True)[0]
    out, summary = loop(state, rule_array(1.0, 3.0, 2, 1000, -np.inf))
    read = read_summary(summary, out)
    assert read.plain_steps == 0 and not read.done_B.all() and (read.plain_from_B == read.generated_B).all()


def never_matching_drafter(key, w, cfg, state, k, greedy, sp):
    return (looped_oracle_drafts(w, cfg, state, k) + 1) % cfg.target.vocab_size, None, state.draft_cache


def test_a_plain_tail_spares_the_call_to_plain_decoding(pair, baseline_tokens):
    """A drafter that never matches under a policy whose first K may carry the plain tail, and a call dearer than a
    plain step: one call, its drafting cycles then plain steps to the end, plain decoding's tokens, and the report
    counts both. A call cheaper than a plain step builds no tail: plain decoding takes a call of its own."""
    cfg, w = pair
    policy = PerCallPolicy(steps=STEPS, costs=COSTS, switch_s=1.5, prior=0.9, min_cycles=3, plain_tails=(3,))
    assert policy.built_tails(3, [c for _, c in COSTS], 1.5) == (3,)
    assert policy.built_tails(3, [c for _, c in COSTS], 0.5) == ()
    res = Engine(cfg, w, num_steps=3, drafter=never_matching_drafter, adaptive=policy).generate(PROMPTS_3, MAX_NEW)
    assert res.tokens == baseline_tokens and res.adaptive.calls == 1
    ks = res.adaptive.k_per_cycle
    assert ks[:3] == [3, 3, 3] and set(ks[3:]) == {0} and res.cycles == len(ks)
    assert all(len(acc) == len(toks) - 1 for acc, toks in zip(res.accepted, res.tokens))  # 0 accepted a token
    cheap = dataclasses.replace(policy, switch_s=0.5)
    res = Engine(cfg, w, num_steps=3, drafter=never_matching_drafter, adaptive=cheap).generate(PROMPTS_3, MAX_NEW)
    assert res.tokens == baseline_tokens and res.adaptive.calls == 2 and res.adaptive.k_per_cycle == ks


def test_a_table_measured_after_the_build_adds_the_tails_it_asks_for(pair, baseline_tokens, monkeypatch):
    """No table known at the build: the set is built without tails; a measured table whose call is dearer than a
    plain step then builds the tailed loop before the first call, and a later generation, finding the table, builds
    nothing more."""
    from jaxspec import adaptive_costs

    cfg, w = pair
    monkeypatch.setattr(adaptive_costs, "_MEMORY", {})  # this table stays in this test
    monkeypatch.setattr(adaptive_costs, "measure", lambda *a, **k: adaptive_costs.Measured((1e-3, 1.6e-3, 1.8e-3,
                                                                                            2e-3), 1.5e-3))
    eng = Engine(cfg, w, num_steps=3, drafter=never_matching_drafter, adaptive=PerCallPolicy(
        steps=STEPS, prior=0.9, min_cycles=3, plain_tails=(3,)))
    first = eng.generate(PROMPTS_3, MAX_NEW)
    built = eng.compile_count
    assert first.adaptive.cost_source == "measured" and first.adaptive.calls == 1  # the tail ran, no second call
    assert first.tokens == baseline_tokens and set(first.adaptive.k_per_cycle[3:]) == {0}
    eng.acceptance_pools.clear()  # a fresh pool: the first call runs K = 3 again
    second = eng.generate(PROMPTS_3, MAX_NEW)
    assert second.adaptive.cost_source == "cached" and second.tokens == baseline_tokens
    assert second.adaptive.calls == 1 and eng.compile_count == built  # the set with the tail, found, not built again


def test_the_plain_loop_stops_at_its_limit_and_its_summary_reads_back_as_its_state(calls_engine):
    import jax

    from jaxspec.adaptive_calls import plain_loop, read_plain_summary, to_plain

    eng = calls_engine
    state = to_plain(eng._prefill(PROMPTS_3, MAX_NEW, SamplingParams(), 0, True)[0])
    loop = jax.jit(lambda s, limit: plain_loop(eng.weights, s, {}, limit, cfg=eng.cfg, greedy=True,
                                               max_new_tokens=MAX_NEW))
    out, summary = loop(state, np.int32(3))
    assert summary.sharding.memory_kind == "pinned_host"
    steps, generated, out_tokens = read_plain_summary(summary, len(PROMPTS_3))
    assert steps == int(out.steps) == 3
    assert (generated == np.asarray(out.generated)).all() and (out_tokens == np.asarray(out.out_tokens)).all()


def test_the_gpu_default_measures_its_costs_once_then_decides_during_the_prefill(pair, baseline_tokens):
    """No costs given, as on a GPU: the first generation times every K's loop, later ones find the table (and make
    their first choice while the device prefills); greedy output equals plain decoding's either way."""
    cfg, w = pair
    eng = Engine(cfg, w, num_steps=3, adaptive=PerCallPolicy(steps=STEPS))
    first = eng.generate(PROMPTS_3, MAX_NEW)
    second = eng.generate(PROMPTS_3, MAX_NEW)
    assert first.tokens == second.tokens == baseline_tokens
    assert first.adaptive.cost_source == "measured" and first.adaptive.measure_s > 0
    assert second.adaptive.cost_source == "cached" and second.adaptive.costs_s == first.adaptive.costs_s
    assert second.adaptive.calls >= 1 and sum(second.adaptive.k_histogram.values()) == second.cycles
    streamed = list(eng.stream(PROMPTS_3, MAX_NEW))[-1]  # its own table: single cycles called back to back
    assert streamed.tokens == baseline_tokens and streamed.adaptive.cost_source == "measured"


def test_a_drafter_that_never_matches_is_switched_off_and_said(pair, baseline_tokens):
    from jaxspec.speculation_verdict import speculation_verdict

    cfg, w = pair
    eng = Engine(cfg, w, num_steps=3, drafter=never_matching_drafter,
                 adaptive=PerCallPolicy(steps=STEPS, costs=COSTS, prior=0.9, min_cycles=3))
    res = eng.generate(PROMPTS_3, MAX_NEW)
    assert res.tokens == baseline_tokens
    ks = res.adaptive.k_per_cycle
    assert ks[:3] == [3, 3, 3] and set(ks[3:]) == {0}  # three drafting cycles, then plain to the end
    assert res.adaptive.calls == 2  # K = 3 carries no plain tail: plain decoding takes a call of its own
    verdict = speculation_verdict(res, 3)
    assert verdict.paid is False and verdict.reason.startswith("speculation off for")
    # the engine remembers: its next generation starts plain
    assert set(eng.generate(PROMPTS_3, MAX_NEW).adaptive.k_per_cycle) == {0}


def two_sample_chi_square(a: collections.Counter, b: collections.Counter, min_count: int = 5) -> tuple[float, int]:
    """(statistic, degrees of freedom) of two equal-size samples' counts, rare values pooled into one bin."""
    common = [k for k in set(a) | set(b) if a[k] + b[k] >= min_count]
    rest = (sum(a.values()) - sum(a[k] for k in common), sum(b.values()) - sum(b[k] for k in common))
    bins = [(a[k], b[k]) for k in common] + ([rest] if sum(rest) else [])
    return sum((x - y) ** 2 / (x + y) for x, y in bins), len(bins) - 1


def test_sampled_output_is_distributed_as_plain_sampling_while_k_changes(pair):
    """Two-sample chi-square of the second and the third sampled token of one prompt over many samples (rows of a
    batch draw independently): the EAGLE-3 draft is rejected, so the second token comes from a speculative cycle
    and the third from a plain step after the switch; each must be distributed as plain sampling's (at p = 0.001;
    the same test tells temperature 0.6 apart)."""
    from scipy.stats import chi2

    cfg, w = pair
    prompts, temp = [[5, 6, 7]] * 50, SamplingParams(temperature=1.0)
    plain = Engine(cfg, w, num_steps=3)
    got = [collections.Counter(), collections.Counter()]
    ref = [collections.Counter(), collections.Counter()]
    runs = collections.Counter()
    for seed in range(8):
        # a fresh engine each time: an engine's pooled counts would start its next generation plain
        eng = Engine(cfg, w, num_steps=3, adaptive=PerCallPolicy(steps=STEPS, costs=COSTS, prior=0.6, min_cycles=1,
                                                                 window=2, margin=0.0))
        res = eng.generate(prompts, 3, temp, seed=seed)
        runs[tuple(res.adaptive.k_per_cycle)] += 1
        base = plain.generate(prompts, 3, temp, seed=seed + 10_000, speculative=False)
        for row, base_row in zip(res.tokens, base.tokens):
            for i in (0, 1):
                got[i][row[1 + i]] += 1
                ref[i][base_row[1 + i]] += 1
    assert all(ks[0] > 0 and ks[-1] == 0 for ks in runs)  # speculation, then plain steps, in every generation
    for i in (0, 1):
        stat, dof = two_sample_chi_square(got[i], ref[i])
        assert dof >= 2 and stat < chi2.ppf(0.999, dof), (i, stat, dof)


def test_calls_on_a_mesh_answer_as_one_device():
    """The by-call loops and their rule array compiled over a 2 x 4 mesh of simulated devices: the same greedy tokens
    as plain decoding on one device, device loop and streamed, plain calls with probes included."""
    from model.sharding import make_mesh
    from tests.sharded_pair import sharded_pair

    cfg, w = sharded_pair()
    prompts = [[5, 6, 7, 8], [1, 2, 3]]
    one = Engine(cfg, w, num_steps=3).generate(prompts, 12, speculative=False).tokens
    eng = Engine(cfg, w, num_steps=3, mesh=make_mesh((2, 4)),
                 adaptive=PerCallPolicy(steps=STEPS, costs=COSTS, prior=0.9, min_cycles=2))
    res = eng.generate(prompts, 12)
    assert res.tokens == one and res.adaptive.k_per_cycle[0] == 3
    # the random draft is left for plain decoding: the plain loop that keeps the draft current, on the mesh too
    assert 0 in res.adaptive.k_per_cycle and res.adaptive.calls == 2
    streamed = list(eng.stream(prompts, 12))[-1]
    plain = streamed.adaptive.k_per_cycle.count(0)
    assert streamed.tokens == one and plain > 0 and streamed.adaptive.calls < plain  # blocks of plain steps a call
