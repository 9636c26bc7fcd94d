"""The paged latent cache (model.kv_cache, `pages_BM`): sequences whose positions live in pages of a shared pool,
read back as each sequence's contiguous cache, answer exactly as contiguous caches do; the server's slots on a
paged cache (`SlotEngine(cache_pages=...)`) answer as unpaged ones, take pages for a prompt and its first device
loop when it is admitted and more as it grows, give them back when it ends, a request waits in the queue while the
pool is short, and a running one is preempted and resumed (answering as if it never was) when its neighbours'
growth leaves no room."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.sampling import SamplingParams
from jaxspec.serving.slot_engine import SlotEngine
from model.decoder import forward
from model.kv_cache import init_latent_cache, init_paged_latent_cache
from tests.sharded_pair import NUM_STEPS, sharded_pair

P = 64


def test_a_paged_forward_equals_a_contiguous_one():
    cfg, w = sharded_pair()
    tcfg, tw = cfg.target, w.target
    contiguous = init_latent_cache(tcfg, 2, 2 * P, jnp.float32)
    paged = init_paged_latent_cache(tcfg, 2, 2 * P, 5, P, jnp.float32)
    paged = paged.replace(pages_BM=jnp.array([[3, 1], [0, 5]], jnp.int32))  # sequence 1 holds one page
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, 60, size=(2, 70)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(70, dtype=jnp.int32), (2, 70))
    positions = positions.at[1].set(jnp.minimum(positions[1], 40))  # sequence 1 stays within its page
    want, got = forward(tw, tcfg, tokens, positions, contiguous), forward(tw, tcfg, tokens, positions, paged)
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    for _ in range(3):  # decode steps reading what the steps before wrote
        nxt = jnp.argmax(want.logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
        positions = positions[:, -1:] + 1
        want = forward(tw, tcfg, nxt, positions, want.cache)
        got = forward(tw, tcfg, nxt, positions, got.cache)
        np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    # pages no sequence holds were never written
    for pool in got.cache.latent:
        assert not np.asarray(pool[jnp.array([2, 4])]).any()


def _answer(engine, slot, tokens, max_new=10):
    first, done = engine.prefill(slot, tokens, max_new, SamplingParams(), seed=1)
    out = [first]
    while not done and len(out) < max_new:
        result = engine.step(np.zeros((engine.max_batch,), bool), any_sampled=False)
        out += result.tokens[slot]
        done = bool(result.done[slot])
    return out[:max_new]


@pytest.fixture(scope="module")
def pair():
    return sharded_pair()


def test_slots_on_a_paged_cache_answer_as_unpaged_ones_and_give_pages_back(pair):
    cfg, w = pair
    kw = dict(num_steps=NUM_STEPS, max_batch=2, max_context=192, cycles_per_step=2, prefill_chunk=32)
    # the second prompt's answer crosses from its first page into its second during a device step
    prompts = [[int(t) for t in np.random.default_rng(s).integers(1, 60, size=n)] for s, n in ((1, 70), (2, 60))]
    plain = SlotEngine(cfg, w, **kw)
    want = [_answer(plain, 0, p) for p in prompts]
    paged = SlotEngine(cfg, w, cache_pages=3, **kw)
    assert paged.pages_for(70, 10) == 2 and paged.pages_for(50, 10) == 1  # budget + the verify window, in pages
    got = [_answer(paged, 0, prompts[0])]
    assert paged.cache_pages_free == 1
    assert not paged.has_room(60, 10) and paged.has_room(50, 10)
    paged.free_slots([0])
    assert paged.cache_pages_free == 3
    got.append(_answer(paged, 1, prompts[1]))
    assert got == want
    # a long prompt admitted a chunk at a time takes its pages when it begins and hands them to its slot
    paged.free_slots([1])
    a = paged.begin_admission(prompts[0], SamplingParams(), seed=1, max_new=10)
    assert paged.cache_pages_free == 1 and not paged.has_room(70, 10)
    paged.release_admission(a)  # cancelled: the pages come back
    assert paged.cache_pages_free == 3
    with pytest.raises(ValueError, match="cannot hold one request"):
        SlotEngine(cfg, w, cache_pages=2, **kw)


def test_a_sequence_takes_pages_as_it_grows_across_a_page_boundary(pair):
    cfg, w = pair
    kw = dict(num_steps=NUM_STEPS, max_batch=2, max_context=192, cycles_per_step=2, prefill_chunk=32)
    prompt = [int(t) for t in np.random.default_rng(4).integers(1, 60, size=50)]
    want = _answer(SlotEngine(cfg, w, **kw), 0, prompt, max_new=40)
    paged = SlotEngine(cfg, w, cache_pages=3, **kw)
    window = 2 * (NUM_STEPS + 1)  # a device loop's cycles x the verify window
    assert paged.pages_for(50, 40) == 1 and paged.pages_for(50, None) == 1  # the prompt and its first loop only
    first, done = paged.prefill(0, prompt, 40, SamplingParams(), seed=1)
    out, held = [first], []
    while not done and len(out) < 40:
        tokens = len(prompt) + len(out)
        result = paged.step(np.zeros((2,), bool), any_sampled=False)  # takes what this loop may write first
        held.append(3 - paged.cache_pages_free)
        assert held[-1] == -(-min(50 + 40 + NUM_STEPS + 1, tokens + window) // P)  # what it holds, no more
        out += result.tokens[0]
        done = bool(result.done[0])
    assert out[:40] == want
    assert held[0] == 1 and held[-1] == 2  # the second page was taken mid-answer
    assert paged.cache_tokens_held == len(prompt) + len(out)
    paged.free_slots([0])
    assert paged.cache_pages_free == 3 and paged.cache_tokens_held == 0


def test_a_request_preempted_for_pages_resumes_and_answers_as_if_it_never_was(pair):
    from jaxspec.serving.metrics import Metrics
    from jaxspec.serving.scheduler import Failed, Finished, Request, Scheduler, Tokens

    cfg, w = pair
    kw = dict(num_steps=NUM_STEPS, max_batch=2, max_context=192, cycles_per_step=2, prefill_chunk=32)
    prompts = [[int(t) for t in np.random.default_rng(s).integers(1, 60, size=50)] for s in (5, 6)]
    want = [_answer(SlotEngine(cfg, w, **kw), 0, p, max_new=60) for p in prompts]
    engine = SlotEngine(cfg, w, cache_pages=3, **kw)  # both start in one page each; both cannot hold two
    got, ended = {0: [], 1: []}, threading.Barrier(3)

    def deliver(i):
        def on(event):
            if isinstance(event, Tokens):
                got[i].extend(event.ids)
            elif isinstance(event, (Finished, Failed)):
                got[i].append(event)
                threading.Thread(target=ended.wait, daemon=True).start()
        return on

    scheduler = Scheduler(engine, Metrics(2), max_queue=4)
    for i, p in enumerate(prompts):
        scheduler.submit(Request(p, 60, SamplingParams(), 1, deliver(i)))
    scheduler.start()
    ended.wait(120)
    scheduler.stop(10)
    assert [got[0][-1], got[1][-1]] == [Finished("length")] * 2
    assert [got[0][:-1], got[1][:-1]] == want
    assert scheduler.metrics.preemptions >= 1
    assert engine.cache_pages_free == 3
    assert "jaxspec_preemptions_total" in scheduler.metrics.render()


def test_a_prompt_being_admitted_gives_way_to_a_running_request_that_grows(pair):
    from jaxspec.serving.metrics import Metrics
    from jaxspec.serving.scheduler import Failed, Finished, Request, Scheduler, Tokens

    cfg, w = pair
    kw = dict(num_steps=NUM_STEPS, max_batch=2, max_context=256, cycles_per_step=2, prefill_chunk=64)
    running = [int(t) for t in np.random.default_rng(7).integers(1, 60, size=56)]  # one page, prefilled at once
    long = [int(t) for t in np.random.default_rng(8).integers(1, 60, size=180)]  # three pages, three chunks
    want = [_answer(SlotEngine(cfg, w, **kw), 0, running, max_new=60), _answer(SlotEngine(cfg, w, **kw), 0, long)]
    engine = SlotEngine(cfg, w, cache_pages=4, **kw)
    got, ended = {0: [], 1: []}, threading.Barrier(3)

    def deliver(i):
        def on(event):
            got[i].append(event.ids if isinstance(event, Tokens) else event)
            if isinstance(event, (Finished, Failed)):
                threading.Thread(target=ended.wait, daemon=True).start()
        return on

    scheduler = Scheduler(engine, Metrics(2), max_queue=4)
    scheduler.submit(Request(running, 60, SamplingParams(), 1, deliver(0)))
    scheduler.submit(Request(long, 10, SamplingParams(), 1, deliver(1)))
    scheduler.start()  # the long prompt's three pages leave none for the running request's second page
    ended.wait(120)
    scheduler.stop(10)
    answers = [[t for ids in got[i][:-1] for t in ids] for i in (0, 1)]
    assert answers == want and [got[0][-1], got[1][-1]] == [Finished("length")] * 2
    assert scheduler.metrics.preemptions >= 1 and engine.cache_pages_free == 4


def test_a_request_waits_while_the_pool_is_short_and_runs_once_pages_come_back(pair):
    from jaxspec.serving.metrics import Metrics
    from jaxspec.serving.scheduler import Failed, Finished, Request, Scheduler, Tokens

    cfg, w = pair
    engine = SlotEngine(cfg, w, num_steps=NUM_STEPS, max_batch=2, max_context=192, cycles_per_step=2,
                        prefill_chunk=32, cache_pages=3)
    prompts = [[int(t) for t in np.random.default_rng(s).integers(1, 60, size=70)] for s in (1, 3)]
    want = [_answer(SlotEngine(cfg, w, num_steps=NUM_STEPS, max_batch=2, max_context=192, cycles_per_step=2,
                               prefill_chunk=32), 0, p) for p in prompts]
    engine.reset()
    got, finished, order = {0: [], 1: []}, threading.Event(), []

    def deliver(i):
        def on(event):
            if isinstance(event, Tokens):
                if not got[i]:
                    order.append(i)
                got[i].extend(event.ids)
            elif isinstance(event, (Finished, Failed)):
                order.append(("end", i))
                if len([o for o in order if isinstance(o, tuple)]) == 2:
                    finished.set()
        return on

    scheduler = Scheduler(engine, Metrics(2), max_queue=4)
    for i, p in enumerate(prompts):  # two free slots, but pages for one request at a time
        scheduler.submit(Request(p, 10, SamplingParams(), 1, deliver(i)))
    scheduler.start()
    assert finished.wait(120)
    scheduler.stop(10)
    assert [got[0][:10], got[1][:10]] == want
    assert order.index(1) > order.index(("end", 0))  # the second began only once the first gave its pages back
    assert engine.cache_pages_free == 3
    text = scheduler.metrics.render()
    assert "jaxspec_cache_pages_in_use 0" in text and "jaxspec_cache_pages 3" in text


def test_serve_takes_cache_pages():
    from jaxspec.cli_common import UsageError
    from jaxspec.serve import _check, build_parser, build_service

    a = build_parser().parse_args(["--dtype", "float32", "--max-context", "128", "--max-batch", "2", "--cache-pages",
                                   "1", "--warmup-buckets", "16"])
    with pytest.raises(UsageError, match="--cache-pages 1: cache_pages 1 cannot hold one request"):
        build_service(a, *_check(a), log=lambda m: None)
    with pytest.raises(UsageError, match="--cache-pages must be >= 1"):
        _check(build_parser().parse_args(["--cache-pages", "0"]))
