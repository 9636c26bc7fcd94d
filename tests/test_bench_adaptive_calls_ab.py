"""bench.labs.adaptive_calls_ab's candidate leaving tests held to the engine's `spec_loop`: the one that reads its
window's columns beside the cycle leaves where `spec_loop` does, the stale one a cycle later, from a call's start
and from a state a call has already advanced."""

import jax
import numpy as np

from bench.labs.adaptive_calls_ab import spec_loop_fresh, spec_loop_stale
from jaxspec.adaptive_calls import rule_array, spec_loop
from jaxspec.engine import Engine
from jaxspec.sampling import SamplingParams
from tests.speculative_cases import MAX_NEW, PROMPTS_3, pair  # noqa: F401 (fixtures)
from tests.test_adaptive_calls import right_then_wrong_drafter


def test_candidate_tests_leave_where_the_engine_loop_does(pair):  # noqa: F811
    cfg, w = pair
    eng = Engine(cfg, w, num_steps=3, drafter=right_then_wrong_drafter)
    state = eng._prefill(PROMPTS_3, MAX_NEW, SamplingParams(), 0, True)[0]
    kw = dict(cfg=eng.cfg, k=3, window=4, greedy=True, max_new_tokens=MAX_NEW, drafter=eng.drafter)
    loops = {name: jax.jit(lambda s, rule, fn=fn: fn(eng.weights, s, {}, rule, **kw))
             for name, fn in (("engine", spec_loop), ("fresh", spec_loop_fresh), ("stale", spec_loop_stale))}
    advanced = loops["engine"](state, rule_array(-np.inf, np.inf, 0, 3))[0]  # a call of 3 cycles before
    assert int(advanced.cycles) == 3
    for start in (state, advanced):
        rule = rule_array(1.0, 3.0, 2, 1000)
        ends = {name: loop(start, rule)[0] for name, loop in loops.items()}
        cycles = {name: int(s.cycles) for name, s in ends.items()}
        assert cycles["engine"] < int(ends["engine"].accepted_log.shape[1])  # it left before the end
        assert not np.asarray(ends["engine"].done).all()
        assert cycles["fresh"] == cycles["engine"] and cycles["stale"] == cycles["engine"] + 1
        log = np.asarray(ends["engine"].accepted_log)
        assert (np.asarray(ends["fresh"].accepted_log) == log).all()
        assert (np.asarray(ends["stale"].accepted_log)[:, :cycles["engine"]] == log[:, :cycles["engine"]]).all()
