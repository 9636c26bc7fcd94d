"""The fused speculative cycle: a reduced draft vocabulary, compilation, EOS, max_new_tokens (greedy losslessness:
test_speculative.py)."""

import jax
import pytest

from jaxspec.engine import Engine
from jaxspec.sampling import SamplingParams
from tests.numpy_pair import numpy_tiny_pair
from tests.speculative_cases import MAX_NEW, PROMPTS_3, baseline_tokens  # noqa: F401 (fixture)
from tests.switched_drafter import looped_oracle_drafter


@pytest.fixture(scope="module")
def pair():
    """tests.speculative_cases' pair, its weights drawn by numpy (nothing to compile)."""
    return numpy_tiny_pair(seed=0, logit_scale=3.0)


def test_reduced_draft_vocab_is_lossless():
    cfg, w = numpy_tiny_pair(seed=1, draft_vocab=24, logit_scale=3.0)
    eng = Engine(cfg, w, num_steps=3)
    assert eng.generate(PROMPTS_3, 16).tokens == eng.generate(PROMPTS_3, 16, speculative=False).tokens


def _compile_events():
    """Every XLA compilation the process asks for: compiled by the backend, or served by the persistent compilation
    cache (tests/conftest.py turns it on; a cache hit fires no backend-compile event)."""
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **k: events.append(name) if "backend_compile" in name else None
    )
    jax.monitoring.register_event_listener(
        lambda name, *a, **k: events.append(name) if name == "/jax/compilation_cache/cache_hits" else None
    )
    return events


def test_one_compilation_per_static_shape(pair, monkeypatch):
    import jaxspec.engine

    traced = []  # the prefill traced for its output shapes (tens of ms a request where it is not kept)
    real = jaxspec.engine.output_shapes
    monkeypatch.setattr(jaxspec.engine, "output_shapes", lambda *a: traced.append(1) or real(*a))
    cfg, w = pair
    eng = Engine(cfg, w, num_steps=3)
    events = _compile_events()
    first = eng.generate([[3, 4, 5, 6, 7]], 60)
    list(eng.stream([[11, 12, 13]], 60))  # streaming: one compiled cycle dispatched per cycle
    assert first.cycles >= 20
    count, n_events, n_traced = eng.compile_count, len(events), len(traced)
    assert n_events >= count > 0  # the listeners see the compilations (fresh or from the persistent cache)
    # same bucket (16), other tokens and lengths: nothing compiles, neither on device nor while streaming
    second = eng.generate([[9, 8, 7, 6, 5, 4, 3, 2, 1]], 60)
    streamed = list(eng.stream([[14, 15, 16, 17]], 60))
    assert second.cycles >= 20 and streamed[-1].cycles >= 20
    assert eng.compile_count == count
    assert len(events) == n_events and len(traced) == n_traced
    # a new engine over the same configs reuses the programs too
    assert Engine(cfg, w, num_steps=3).generate([[1, 2]], 60).tokens and len(events) == n_events


def test_greedy_and_sampling_programs_are_distinct(pair, baseline_tokens):
    """Same shapes, different baked-in rule: the sampled program must not be served for a greedy call."""
    cfg, w = pair
    eng = Engine(cfg, w, num_steps=3)
    eng.generate(PROMPTS_3, MAX_NEW, sampling=SamplingParams(1.0), seed=3)
    assert eng.generate(PROMPTS_3, MAX_NEW).tokens == baseline_tokens


def test_eos_stops_generation(pair, baseline_tokens):
    cfg, w = pair
    base = baseline_tokens[0]
    eos = base[9]
    first = base.index(eos)
    cfg_eos = cfg.__class__(cfg.target, cfg.draft, (eos,))
    for k, speculative in [(3, True), (3, False), (5, True)]:
        res = Engine(cfg_eos, w, num_steps=k).generate(PROMPTS_3[:1], MAX_NEW, speculative=speculative)
        assert res.tokens[0] == base[: first + 1]  # ends with EOS, nothing after it


@pytest.mark.parametrize("max_new", [1, 7])
def test_max_new_tokens_is_exact(pair, baseline_tokens, max_new):
    cfg, w = pair
    res = Engine(cfg, w, num_steps=5, drafter=looped_oracle_drafter).generate(PROMPTS_3, max_new)
    assert res.tokens == [t[:max_new] for t in baseline_tokens]
