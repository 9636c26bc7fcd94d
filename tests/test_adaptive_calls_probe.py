"""Plain calls that keep the draft current (jaxspec.adaptive_calls.probe_loop): the draft after a plain call is what a
prefill over the same tokens leaves, the call's test leaves where the host would, the host takes speculation back
where the text turns predictable (the embedded pair; in the device loop and streamed), and plain decoding runs to
the end where nothing could pay."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.adaptive_calls import (BAND_GRID, PROBE_TABLES, PerCallPolicy, ProbeSummary, Pool, plain_leave_remaining,
                                    plain_to_the_end, probe_array, probe_loop, probe_observations)
from jaxspec.adaptive_calls_run import Calls, probe_inputs
from jaxspec.engine import Engine
from jaxspec.sampling import SamplingParams
from tests.speculative_cases import MAX_NEW, PROMPTS_3, pair  # noqa: F401 (fixture)

STEPS = (0, 1, 2, 3)
COSTS = ((0, 1.0), (1, 1.6), (2, 1.8), (3, 2.0))  # speculation pays only with high acceptance


def never(min_steps: int = 0, limit: int = 1000) -> np.ndarray:
    return probe_array(np.full(BAND_GRID, np.inf), min_steps, limit, 4)


@pytest.fixture(scope="module")
def probe_run(pair):
    cfg, w = pair
    eng = Engine(cfg, w, num_steps=3)
    loop = jax.jit(lambda s, probe_F: probe_loop(w, s, {}, probe_F, cfg=cfg, greedy=True, max_new_tokens=MAX_NEW,
                                                 width=4))
    return eng, loop, lambda: eng._prefill(PROMPTS_3, MAX_NEW, SamplingParams(), 0, True)[0]


def test_after_a_plain_call_the_draft_is_what_a_prefill_over_its_tokens_leaves(pair, probe_run):
    """Six plain steps in blocks of 4 and 2 (the catch-up's width), each caught up: the pending token, the target's
    length and the draft's prediction at the last position equal those of a prefill over the prompt and the tokens
    emitted before the pending one (a stale draft cache would predict from the prompt's positions only)."""
    eng, loop, prefilled = probe_run
    out, summary = loop(prefilled(), never(limit=6))
    read = ProbeSummary(summary, len(PROMPTS_3))
    assert summary.sharding.memory_kind == "pinned_host"
    assert read.plain_steps == 6 and read.cycles == int(out.cycles) == 6 and not read.all_done
    generated, out_tokens = read.tokens()
    assert (generated == np.asarray(out.generated)).all() and (out_tokens == np.asarray(out.out_tokens)).all()
    assert (read.done_B == np.asarray(out.done)).all() and (generated == 7).all()
    # the last block's observations: its 2 entries a row, each a draft prediction against the emitted token
    assert read.c1_trials_B.tolist() == [2.0] * 3 and ((0 <= read.c1_hits_B) & (read.c1_hits_B <= 2)).all()
    # plain steps are cycles that accepted nothing
    assert (np.asarray(out.accepted_log)[:, :6] == 0).all() and (np.asarray(out.accepted_log)[:, 6:] == -1).all()

    longer = [p + out_tokens[i, :generated[i] - 1].tolist() for i, p in enumerate(PROMPTS_3)]
    ref = eng._prefill(longer, MAX_NEW, SamplingParams(), 0, True)[0]
    assert (np.asarray(ref.pending) == np.asarray(out.pending)).all()
    assert (np.asarray(ref.target_cache.lengths) == np.asarray(out.target_cache.lengths)).all()
    np.testing.assert_allclose(np.asarray(out.draft_logits), np.asarray(ref.draft_logits), rtol=1e-3, atol=1e-3)
    stale = eng._prefill(PROMPTS_3, MAX_NEW, SamplingParams(), 0, True)[0]
    assert not np.allclose(np.asarray(stale.draft_logits), np.asarray(ref.draft_logits), atol=1e-3)


def test_a_plain_call_leaves_after_a_block_whose_c1_pays_the_switch(probe_run):
    """The test reads, after each block's catch-up, the tokens the slowest live row needs at the block's c_1: a
    table of zeros leaves after the first block, its minimum of steps holds it for whole blocks, and an all-inf
    table runs to the end of the batch."""
    _, loop, prefilled = probe_run
    leave = probe_array(np.zeros(BAND_GRID), 0, 1000, 4)
    assert ProbeSummary(loop(prefilled(), leave)[1], 3).plain_steps == 4
    leave_late = probe_array(np.zeros(BAND_GRID), 6, 1000, 4)
    assert ProbeSummary(loop(prefilled(), leave_late)[1], 3).plain_steps == 8  # the second block reaches 6
    # a table the slowest row's wants never reach: to the end
    out, summary = loop(prefilled(), probe_array(np.full(BAND_GRID, MAX_NEW + 1.0), 0, 1000, 4))
    read = ProbeSummary(summary, 3)
    assert read.all_done and read.plain_steps == MAX_NEW - 1 and (np.asarray(out.generated) == MAX_NEW).all()
    # plain decoding to the end (or the limit): one block, never a test before it
    assert ProbeSummary(loop(prefilled(), plain_to_the_end(9))[1], 3).plain_steps == 9


def test_a_plain_calls_blocks_double_from_the_first_up_to_the_width(pair, probe_run):
    """Width 8, a first block of 2: blocks of 2, 4, 8, 8 steps; a test after the minimum of 5 steps leaves after
    the second block (6 steps), one after 7 after the third (14), and the last block's counts are its own."""
    cfg, w = pair
    _, _, prefilled = probe_run
    loop = jax.jit(lambda s, probe_F: probe_loop(w, s, {}, probe_F, cfg=cfg, greedy=True, max_new_tokens=MAX_NEW,
                                                 width=8))
    for min_steps, steps, last_block in ((5, 6, 4), (7, 14, 8), (15, 22, 8)):
        read = ProbeSummary(loop(prefilled(), probe_array(np.zeros(BAND_GRID), min_steps, 1000, 2))[1], 3)
        assert read.plain_steps == steps and read.c1_trials_B.tolist() == [last_block] * 3
    # each block reads its own table (the last one every block after it): a first table no c_1 passes holds the
    # call past its first block, and a call whose tables all hold it past the third runs to the end
    hold_first = np.stack([np.full(BAND_GRID, np.inf)] + [np.zeros(BAND_GRID)] * (PROBE_TABLES - 1))
    assert ProbeSummary(loop(prefilled(), probe_array(hold_first, 0, 1000, 2))[1], 3).plain_steps == 6
    only_late = np.stack([np.full(BAND_GRID, np.inf)] * (PROBE_TABLES - 1) + [np.zeros(BAND_GRID)])
    assert ProbeSummary(loop(prefilled(), probe_array(only_late, 0, 1000, 2))[1], 3).plain_steps == 14


def test_the_plain_calls_table_follows_the_hosts_choice():
    """`plain_leave_remaining`: no c_1 near 0 leaves plain decoding, full acceptance does, and the higher c_1 the
    fewer tokens left suffice; with no switch price one token is enough. `probe_inputs` runs plain decoding to
    the end where not even full acceptance pays (a cost table where a cycle of K costs K + 1 plain steps, or a
    switch dearer than what the tokens left could save)."""
    cost = np.array([c for _, c in COSTS])
    none = (np.zeros(3), np.zeros(3), 0.7)
    need = plain_leave_remaining(cost, STEPS, 2.0, 0.03, *none, 32)
    assert np.isinf(need[0]) and np.isfinite(need[-1]) and need[-1] > 1.0
    finite = need[np.isfinite(need)]
    assert (np.diff(finite) <= 1e-6).all() and len(finite) < BAND_GRID // 2  # only high acceptance pays
    assert plain_leave_remaining(cost, STEPS, 0.0, 0.03, *none, 32)[-1] == 1.0

    def run(costs, switch):
        return Calls(STEPS, Pool(3, 32.0), np.asarray(costs, float), switch)

    policy, live = PerCallPolicy(steps=STEPS), np.array([True, True])
    assert probe_inputs(run(cost, 0.0), np.array([20, 3]), live, policy, 0) is not None
    assert probe_inputs(run([1.0, 2.0, 3.0, 4.0], 0.0), np.array([20, 3]), live, policy, 0) is None
    assert probe_inputs(run(cost, 100.0), np.array([20, 3]), live, policy, 0) is None
    got = probe_inputs(run(cost, 2.0), np.array([200, 3]), live, policy, 16)
    assert got.shape == (PROBE_TABLES * BAND_GRID + 3,) and got[PROBE_TABLES * BAND_GRID] == 16
    assert got[-1] == 8  # the first block


def test_each_blocks_table_leaves_where_the_host_then_leaves():
    """The leaving table of each block is priced for that block's observations (8, 16, 32 a row), so that where a
    block's test leaves, the host, weighing the same counts against a pool of failed cycles, chooses a K; and where
    the host would stay, the test does not leave (a first block priced as a whole one left where the host stayed,
    and the next plain call's minimum then held plain decoding for 56 more steps)."""
    cost = np.array([c for _, c in COSTS])
    policy, remaining, live = PerCallPolicy(steps=STEPS), np.array([120]), np.array([True])
    calls = Calls(STEPS, Pool(3, 32.0), cost, 2.0)
    calls.pool.add(np.zeros((1, 3)), np.array([[4.0, 0.0, 0.0]]))  # four cycles that accepted nothing
    tables = probe_inputs(calls, remaining, live, policy, 0)[:PROBE_TABLES * BAND_GRID].reshape(PROBE_TABLES, -1)
    grid = np.linspace(0.0, 1.0, BAND_GRID)
    checked = set()
    for table, observed in zip(tables, probe_observations(policy.probe_every)):
        for g in range(0, BAND_GRID, 5):
            hits = np.array([[grid[g] * observed, 0.0, 0.0]])
            k, _ = calls.choose(hits, np.array([[observed, 0.0, 0.0]]), remaining, live, policy.prior,
                                policy.margin, 0)
            if abs(table[g] - remaining[0]) > 0.05 * remaining[0]:  # away from the boundary: the same answer
                assert (table[g] <= remaining[0]) == (k != 0), (observed, grid[g], table[g], k)
                checked.add(k != 0)
    assert checked == {True, False}
    # more observations at the same c_1 take the host back sooner
    assert (tables[0] >= tables[-1]).all() and (tables[0] > tables[-1]).any()


def test_a_drafter_plug_or_no_probes_keep_plain_decoding_to_the_end(pair):
    """The probe observes the EAGLE-3 draft: with a drafter plug (or `probe_every=0`) no plain call is probed, and
    a drafter that never matches is switched off in one plain call as before; with the EAGLE-3 draft of the tiny
    pair (random, never right) plain decoding takes one call too, its steps in the acceptance log."""
    from tests.test_adaptive_calls import never_matching_drafter

    cfg, w = pair
    plain = Engine(cfg, w, num_steps=3).generate(PROMPTS_3, MAX_NEW, speculative=False).tokens
    policy = PerCallPolicy(steps=STEPS, costs=COSTS, prior=0.9, min_cycles=3)
    for eng in (Engine(cfg, w, num_steps=3, drafter=never_matching_drafter, adaptive=policy),
                Engine(cfg, w, num_steps=3, adaptive=PerCallPolicy(steps=STEPS, costs=COSTS, prior=0.9,
                                                                   min_cycles=3, probe_every=0)),
                Engine(cfg, w, num_steps=3, adaptive=policy)):
        res = eng.generate(PROMPTS_3, MAX_NEW)
        ks = res.adaptive.k_per_cycle
        assert res.tokens == plain and ks[:3] == [3, 3, 3] and set(ks[3:]) == {0} and res.adaptive.calls == 2
        assert res.cycles == len(ks) and all(len(a) == len(t) - 1 for a, t in zip(res.accepted, res.tokens))


def test_speculation_comes_back_where_the_text_turns_predictable():
    """The embedded pair on a random-looking prompt whose continuation turns repetitive: a fresh engine's first
    cycles accept nothing and the host leaves for plain decoding; the plain call's probes see the draft right
    again and the host speculates for the rest, its cycles accepting as a current draft does (a stale one would
    accept next to nothing). Greedy float32: plain decoding's tokens. Without probes the same run stays plain, and
    so does the engine's next generation (its pool says the draft fails)."""
    from bench.adaptive_prompts import PROMPTS, encode, load_pair

    cfg, w, tok = load_pair(jnp.float32)
    prompt, n = encode(tok, PROMPTS[2][1]), 96
    plain = Engine(cfg, w, num_steps=4).generate([prompt], n, speculative=False).tokens
    costs = tuple(zip(range(5), (1.0, 1.42, 1.57, 1.63, 1.89)))  # a GPU's table for this pair, in plain steps

    def engine(probe_every):
        return Engine(cfg, w, num_steps=4, adaptive=PerCallPolicy(costs=costs, switch_s=9.5,
                                                                  probe_every=probe_every))

    res = engine(32).generate([prompt], n)
    ks = res.adaptive.k_per_cycle
    assert res.tokens == plain and res.adaptive.calls == 3
    first_plain = ks.index(0)
    back = first_plain + ks[first_plain:].index(next(k for k in ks[first_plain:] if k > 0))
    # blocks of 8, 16, 32 steps: the call leaves after the block that sees the draft right again
    assert 0 < first_plain <= 8 and set(ks[first_plain:back]) == {0} and back - first_plain in (8, 24)
    after = res.accepted[0][back:]
    assert set(ks[back:]) == {ks[back]} and np.mean(after) >= 2.0
    assert len(res.accepted[0]) == len(ks) == res.cycles and res.stats.cycles == len(ks) - (back - first_plain)
    # streamed: plain decoding a block of 8 steps a call, the same way back
    events = list(engine(32).stream([prompt], n))
    streamed = events[-1]
    ks = streamed.adaptive.k_per_cycle
    assert [sum((ev[0] for ev in events[:-1]), [])] == streamed.tokens == plain
    first_plain = ks.index(0)
    back = first_plain + ks[first_plain:].index(next(k for k in ks[first_plain:] if k > 0))
    assert 0 < first_plain <= 8 and (back - first_plain) % 8 == 0 and back - first_plain <= 32
    assert np.mean(streamed.accepted[0][back:]) >= 2.0 and len(streamed.accepted[0]) == len(ks) == streamed.cycles

    off = engine(0)
    stays = off.generate([prompt], n)
    assert stays.tokens == plain and set(stays.adaptive.k_per_cycle[first_plain:]) == {0}
    assert set(off.generate([prompt], n).adaptive.k_per_cycle) == {0}
