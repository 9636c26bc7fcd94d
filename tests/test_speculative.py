"""The fused speculative cycle, greedy: lossless for every drafter and K, acceptance, batching, streaming (EOS,
max_new_tokens, compilation: test_speculative_limits.py; sampling: test_sampling_losslessness.py and
test_sampling_broken_rules.py)."""

import pytest

from jaxspec.engine import Engine
from tests.numpy_pair import numpy_tiny_pair
from tests.oracle_drafters import drafts_right_for
from tests.speculative_cases import MAX_NEW, PROMPTS_3, baseline_tokens  # noqa: F401 (fixture)
from tests.switched_drafter import SwitchedDrafter


@pytest.fixture(scope="module")
def pair():
    """tests.speculative_cases' pair, its weights drawn by numpy (nothing to compile)."""
    return numpy_tiny_pair(seed=0, logit_scale=3.0)


SWITCHED = SwitchedDrafter()
PARTIAL_K = 4  # K + 1 prime: every row's accepted count runs through several values of 0..K


def _switched_generate(cfg, w, k, name):
    SWITCHED.name = name
    try:
        return Engine(cfg, w, num_steps=k, drafter=SWITCHED).generate(PROMPTS_3, MAX_NEW)
    finally:
        SWITCHED.name = "oracle"


# the random (EAGLE-3) drafter at the K the other tests use; the oracles at the partial test's K instead of 3
@pytest.mark.parametrize("k, drafter_name", [(k, "random") for k in (1, 3, 5)] +
                         [(k, name) for k in (1, PARTIAL_K, 5) for name in ("oracle", "wrong")])
def test_greedy_speculation_equals_baseline(pair, baseline_tokens, k, drafter_name):
    cfg, w = pair
    if drafter_name == "random":
        res = Engine(cfg, w, num_steps=k).generate(PROMPTS_3, MAX_NEW)
    else:
        res = _switched_generate(cfg, w, k, drafter_name)
    assert res.tokens == baseline_tokens
    assert all(len(t) == MAX_NEW for t in res.tokens)
    flat = res.stats.accepted_per_cycle
    if drafter_name == "oracle":
        assert flat and all(a == k for a in flat)  # acceptance length K+1 every cycle
        assert res.stats.mean_acceptance_length == k + 1
    elif drafter_name == "wrong":
        assert flat and all(a == 0 for a in flat)  # acceptance length exactly 1
    # every cycle's tokens are accounted for: first token from prefill, then accepted + 1 per cycle
    for row, toks in zip(res.accepted, res.tokens):
        assert 1 + sum(a + 1 for a in row) >= len(toks) > sum(a + 1 for a in row[:-1])


def test_greedy_partial_acceptance_is_exact(pair, baseline_tokens):
    """A drafter right for exactly the first m drafts (m from 0 to K, per row and per cycle): every cycle accepts
    exactly m, and the tokens are the baseline's (accepting one draft too many would emit a wrong token)."""
    cfg, w = pair
    k = PARTIAL_K
    res = _switched_generate(cfg, w, k, "partial")
    assert res.tokens == baseline_tokens
    for row, log in enumerate(res.accepted):
        assert log == [drafts_right_for(k, row, cycle) for cycle in range(len(log))]
    assert {a for log in res.accepted for a in log} == set(range(k + 1))
    assert all(len(set(log)) >= 3 for log in res.accepted)


def test_batch_one_equals_batch_three(pair, baseline_tokens):
    cfg, w = pair
    eng = Engine(cfg, w, num_steps=3)
    for i, p in enumerate(PROMPTS_3):
        assert eng.generate([p], MAX_NEW).tokens[0] == baseline_tokens[i]


def test_streaming_yields_the_same_tokens(pair, baseline_tokens):
    cfg, w = pair
    events = list(Engine(cfg, w, num_steps=3).stream(PROMPTS_3, MAX_NEW))
    result = events[-1]
    streamed = [sum((ev[i] for ev in events[:-1]), []) for i in range(3)]
    assert streamed == baseline_tokens == result.tokens


@pytest.mark.parametrize("speculative", [True, False])
def test_pipelined_stream_reports_what_generate_reports(pair, speculative):
    """Pipelined streaming queues one cycle past the end: that cycle must leave the tokens, the cycle count and
    the acceptance log as the on-device loop (which stops exactly at the end) leaves them; the per-cycle
    events are the same as one round trip per cycle gives."""
    cfg, w = pair
    eng = Engine(cfg, w, num_steps=3)
    on_device = eng.generate(PROMPTS_3, MAX_NEW, speculative=speculative)
    events = list(eng.stream(PROMPTS_3, MAX_NEW, speculative=speculative))
    streamed = events[-1]
    assert streamed.tokens == on_device.tokens
    assert streamed.cycles == on_device.cycles > 1
    assert streamed.accepted == on_device.accepted
    one_by_one = list(eng.stream(PROMPTS_3, MAX_NEW, speculative=speculative, pipelined=False))
    assert one_by_one[:-1] == events[:-1] and one_by_one[-1].cycles == streamed.cycles
