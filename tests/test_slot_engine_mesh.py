"""The server's device side (`jaxspec.serving.slot_engine.SlotEngine`) over 8 simulated CPU devices: its warm-up
compiles every program it serves with (side by side, `jaxspec.sharded.compile_programs`), and greedy requests
answer on a mesh exactly as on one device."""

import numpy as np
import pytest

from jaxspec.sampling import SamplingParams
from jaxspec.serving.slot_engine import SlotEngine
from model.sharding import make_mesh
from tests.sharded_pair import NUM_STEPS, sharded_pair

PROMPTS = [[3, 9, 4, 1, 7], [5, 5, 2, 8, 1, 6, 2, 9, 4, 4, 3]]
MAX_NEW = 12


def _serve(engine: SlotEngine) -> list[list[int]]:
    out = []
    for slot, prompt in enumerate(PROMPTS):
        first, done = engine.prefill(slot, prompt, MAX_NEW, SamplingParams(), seed=slot)
        out.append([first])
        assert not done
    busy = set(range(len(PROMPTS)))
    for _ in range(64):
        result = engine.step(np.zeros((engine.max_batch,), bool), any_sampled=False)
        for slot in busy:
            out[slot] += result.tokens[slot]
        busy = {s for s in busy if not result.done[s]}
        if not busy:
            return out
    raise AssertionError(f"slots {busy} never finished")


@pytest.fixture(scope="module")
def pair():
    return sharded_pair()


def test_warm_up_compiles_every_program_and_a_mesh_answers_as_one_device(pair):
    cfg, w = pair
    kw = dict(num_steps=NUM_STEPS, max_batch=8, max_context=64, cycles_per_step=2)
    one = SlotEngine(cfg, w, **kw)
    one.warm_up([])  # no bucket fits (a --max-context below them all): the loops and the insert
    assert sorted(map(str, one._programs)) == sorted(map(str, [("loop", NUM_STEPS, False), ("loop", NUM_STEPS, True),
                                                                ("insert",)]))
    one.warm_up([16])  # only what is missing
    assert sorted(map(str, one._programs)) == sorted(map(str, [("loop", NUM_STEPS, False), ("loop", NUM_STEPS, True),
                                                                ("prefill", 16, True), ("prefill", 16, False),
                                                                ("insert",)]))
    compiled = dict(one._programs)
    want = _serve(one)
    assert dict(one._programs) == compiled  # serving needed no program the warm-up had not compiled
    assert [len(t) for t in want] == [MAX_NEW] * len(PROMPTS)
    sharded = SlotEngine(cfg, w, mesh=make_mesh((2, 4)), **kw)
    sharded.warm_up([16])
    assert _serve(sharded) == want


def test_the_prefix_cache_on_a_mesh_answers_as_one_device(pair):
    """A prompt prefilled whole (a miss, its page saved) and again from its cached page (a hit) on a 2 x 4 mesh,
    the slots' cache paged, answers as on one device unpaged."""
    cfg, w = pair
    kw = dict(num_steps=NUM_STEPS, max_batch=8, max_context=192, cycles_per_step=2, prefill_chunk=32,
              prefix_cache_tokens=128)
    prompt = [int(t) for t in np.random.default_rng(4).integers(1, 60, size=100)]

    def answer(engine):
        engine.reset()
        first, done = engine.prefill(0, prompt, MAX_NEW, SamplingParams(), seed=0)
        out = [first]
        while not done and len(out) < MAX_NEW:
            result = engine.step(np.zeros((engine.max_batch,), bool), any_sampled=False)
            out += result.tokens[0]
            done = bool(result.done[0])
        return out

    want = answer(SlotEngine(cfg, w, **kw))
    sharded = SlotEngine(cfg, w, mesh=make_mesh((2, 4)), cache_pages=6, **kw)  # and its target cache paged
    assert answer(sharded) == want
    assert sharded.cached_prefix_tokens(prompt) == 64
    sharded.free_slots([0])
    assert answer(sharded) == want
    assert sharded.prefix.stats()["hits"] == 1
