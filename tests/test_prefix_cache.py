"""The server's prefix cache (`SlotEngine(prefix_cache_tokens=...)`): a prompt that starts with cached pages has
them restored and prefills only the rest, and answers exactly as the same prompt prefilled from scratch, greedy
and sampled; pages are evicted under pressure and never while an admission holds them."""

import numpy as np
import pytest

from jaxspec.sampling import SamplingParams
from jaxspec.serving.prefix_pages import PAGE_TOKENS
from jaxspec.serving.slot_engine import SlotEngine
from tests.sharded_pair import NUM_STEPS, sharded_pair

CHUNK = 32
MAX_CONTEXT = 256
rng = np.random.default_rng(11)
SYSTEM = [int(t) for t in rng.integers(1, 60, size=140)]  # two whole pages and a part, shared by the prompts below
PROMPTS = [SYSTEM + [int(t) for t in rng.integers(1, 60, size=n)] for n in (9, 60, 1)]
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95)


def _engine(prefix_pages: int) -> SlotEngine:
    cfg, w = sharded_pair()
    engine = SlotEngine(cfg, w, num_steps=NUM_STEPS, max_batch=2, max_context=MAX_CONTEXT, cycles_per_step=2,
                        prefill_chunk=CHUNK, prefix_cache_tokens=prefix_pages * PAGE_TOKENS)
    engine.warm_up([16])
    return engine


@pytest.fixture(scope="module")
def cached():
    return _engine(prefix_pages=4)


@pytest.fixture(scope="module")
def plain():
    return _engine(prefix_pages=0)


def _answer(engine, tokens, sampling, seed=5, max_new=12) -> list[int]:
    engine.reset()
    first, done = engine.prefill(0, tokens, max_new, sampling, seed)
    out = [first]
    while not done and len(out) < max_new:
        result = engine.step(np.zeros((engine.max_batch,), bool), any_sampled=not sampling.greedy)
        out += result.tokens[0]
        done = bool(result.done[0])
    return out[:max_new]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_hit_answers_as_a_miss(cached, plain, sampling):
    cached.clear_prefix_cache()
    want = [_answer(plain, p, sampling) for p in PROMPTS]
    assert cached.cached_prefix_tokens(PROMPTS[0]) == 0
    got = [_answer(cached, PROMPTS[0], sampling)]  # a miss: its two whole pages are saved
    for p in PROMPTS[1:]:
        assert cached.cached_prefix_tokens(p) == 2 * PAGE_TOKENS
        got.append(_answer(cached, p, sampling))
    assert got == want
    stats = cached.prefix.stats()
    assert (stats["hits"], stats["misses"], stats["hit_tokens"]) == (2, 1, 4 * PAGE_TOKENS)
    # the second prompt is longer than three pages: its third page joined the cache, and a repeat of it hits three
    assert cached.cached_prefix_tokens(PROMPTS[1]) == 3 * PAGE_TOKENS
    assert _answer(cached, PROMPTS[1], sampling) == want[1]


def test_a_page_matches_only_with_everything_before_it(cached):
    cached.clear_prefix_cache()
    _answer(cached, PROMPTS[1], GREEDY)
    other_start = [SYSTEM[0] % 59 + 1] + SYSTEM[1:] + [7] * 20
    assert cached.cached_prefix_tokens(other_start) == 0
    # the token after a page is part of its key (the draft's entry at the page's last position reads it)
    changed_next = SYSTEM[:PAGE_TOKENS] + [SYSTEM[PAGE_TOKENS] % 59 + 1] + SYSTEM[PAGE_TOKENS + 1:]
    assert cached.cached_prefix_tokens(changed_next) == 0
    assert cached.cached_prefix_tokens(SYSTEM[:PAGE_TOKENS + 1]) == PAGE_TOKENS
    # the last prompt position is always prefilled: a prompt of exactly two pages reuses one
    assert cached.cached_prefix_tokens(SYSTEM[:2 * PAGE_TOKENS]) == PAGE_TOKENS


def test_eviction_under_pressure_keeps_answers_right(plain):
    small = _engine(prefix_pages=2)
    prompts = [[int(t) for t in np.random.default_rng(s).integers(1, 60, size=150)] for s in range(3)]
    want = [_answer(plain, p, GREEDY) for p in prompts]
    for p, w in zip(prompts, want):  # each prompt's two pages push out the last one's
        assert _answer(small, p, GREEDY) == w
    assert small.prefix.stats()["evictions"] == 4
    assert small.cached_prefix_tokens(prompts[0]) == 0 and small.cached_prefix_tokens(prompts[2]) == 2 * PAGE_TOKENS
    assert _answer(small, prompts[2], GREEDY) == want[2]
    assert small.prefix.stats()["hits"] == 1


def test_pages_held_by_an_admission_are_never_overwritten(plain):
    """An admission holds the pages it restored from until it ends: prompts admitted meanwhile that need room
    evict nothing it holds, and what it restored is what the cached prompt wrote."""
    small = _engine(prefix_pages=2)
    long = PROMPTS[1] + [int(t) for t in np.random.default_rng(3).integers(1, 60, size=40)]  # past one chunk
    want = _answer(plain, long, GREEDY)
    _answer(small, PROMPTS[1], GREEDY)  # caches SYSTEM's two pages
    small.reset()
    a = small.begin_admission(long, GREEDY, seed=5)
    assert a.cached_pages and a.start == 2 * PAGE_TOKENS and small.prefix.stats()["pages_referenced"] == 2
    others = [[int(t) for t in np.random.default_rng(20 + s).integers(1, 60, size=150)] for s in range(2)]
    for p in others:  # a full pool of held pages: these prompts are served and cache nothing
        first, _ = small.prefill(1, p, 4, GREEDY, 0)
        assert small.prefix.stats()["evictions"] == 0
    small.admit_chunk(a)
    while not a.prefilled:
        small.admit_chunk(a)
    first, done = small.finish_admission(0, a, 12)
    assert small.prefix.stats()["pages_referenced"] == 0
    assert _decoded_in_slot_0(small, first, done, 12) == want


def _decoded_in_slot_0(engine, first: int, done: bool, n: int) -> list[int]:
    """The first `n` tokens of an admission finished into slot 0 (its first token given), the other slot idle."""
    out = [first]
    while not done and len(out) < n:
        result = engine.step(np.array([False, True]), any_sampled=False)
        out += result.tokens[0]
        done = bool(result.done[0])
    return out[:n]


def test_a_cancelled_admission_gives_its_pages_back(cached):
    cached.clear_prefix_cache()
    _answer(cached, PROMPTS[1], GREEDY)
    a = cached.begin_admission(PROMPTS[0] + [3] * 40, GREEDY, seed=0)
    assert cached.prefix.stats()["pages_referenced"] == 2
    cached.release_admission(a)
    cached.release_admission(a)  # once only
    assert cached.prefix.stats()["pages_referenced"] == 0


def test_an_admission_outlives_a_prefix_cache_emptied_by_a_failed_save(plain):
    """A save that fails empties the prefix cache (its pool was given to the failed program). An admission that
    restored pages from the old cache still finishes, answers right and releases nothing in the new one (its
    holds went with the old index), so the engine thread that finishes or cancels it does not fail."""
    small = _engine(prefix_pages=4)
    long = PROMPTS[1] + [int(t) for t in np.random.default_rng(3).integers(1, 60, size=40)]  # past one chunk
    want = _answer(plain, long, GREEDY)
    _answer(small, PROMPTS[1], GREEDY)  # caches SYSTEM's two pages
    small.reset()
    admissions = [small.begin_admission(long, GREEDY, seed=5) for _ in range(2)]
    assert all(a.cached_pages for a in admissions)
    save = small._programs[("prefix_save",)]

    def failing_save(*args):
        raise RuntimeError("device out of memory")

    small._programs[("prefix_save",)] = failing_save
    with pytest.raises(RuntimeError, match="out of memory"):
        small.prefill(1, [int(t) for t in np.random.default_rng(9).integers(1, 60, size=150)], 4, GREEDY, 0)
    small._programs[("prefix_save",)] = save
    assert small.prefix.stats()["pages_cached"] == 0
    small.release_admission(admissions[1])  # cancelled
    a = admissions[0]
    while not a.prefilled:
        small.admit_chunk(a)
    first, done = small.finish_admission(0, a, 12)  # its whole pages are saved into the new cache
    small.prefix.check_invariants()
    assert small.prefix.stats()["pages_referenced"] == 0 and small.cached_prefix_tokens(long) == 3 * PAGE_TOKENS
    assert _decoded_in_slot_0(small, first, done, 12) == want


def test_metrics_report_the_prefix_cache(cached):
    from jaxspec.serving.metrics import Metrics

    cached.clear_prefix_cache()
    _answer(cached, PROMPTS[0], GREEDY)
    _answer(cached, PROMPTS[1], GREEDY)
    metrics = Metrics(2)
    metrics.prefix_cache(cached.prefix.stats())
    text = metrics.render()
    for line in ("jaxspec_prefix_cache_hits_total 1", "jaxspec_prefix_cache_misses_total 1",
                 f"jaxspec_prefix_cache_hit_tokens_total {2 * PAGE_TOKENS}", "jaxspec_prefix_cache_pages 4",
                 "jaxspec_prefix_cache_pages_in_use 3", "jaxspec_prefix_cache_evictions_total 0"):
        assert line in text.splitlines(), line


def test_without_a_draft_a_hit_answers_as_a_miss():
    """Plain decoding (K = 0): the pool holds the target's caches alone."""
    cfg, w = sharded_pair()
    kw = dict(num_steps=0, max_batch=2, max_context=MAX_CONTEXT, cycles_per_step=2, prefill_chunk=CHUNK)
    plain = SlotEngine(cfg, w, **kw)
    cached = SlotEngine(cfg, w, prefix_cache_tokens=4 * PAGE_TOKENS, **kw)
    assert len(cached.pages.arrays) == 2 * cfg.target.num_hidden_layers
    want = [_answer(plain, p, GREEDY) for p in PROMPTS[:2]]
    assert [_answer(cached, p, GREEDY) for p in PROMPTS[:2]] == want
    assert cached.prefix.stats()["hits"] == 1
