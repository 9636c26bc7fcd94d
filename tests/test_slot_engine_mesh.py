"""The server's device side (`jaxspec.serving.slot_engine.SlotEngine`) over 8 simulated CPU devices: its warm-up
compiles every program it serves with (side by side, `jaxspec.sharded.compile_programs`), greedy and sampled
requests answer on a mesh exactly as on one device, and the sampled loop gathers no vocabulary rows."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.sampling import SamplingParams
from jaxspec.serving.slot_engine import SlotEngine
from model.sharding import make_mesh
from tests.sharded_pair import NUM_STEPS, sharded_pair

PROMPTS = [[3, 9, 4, 1, 7], [5, 5, 2, 8, 1, 6, 2, 9, 4, 4, 3]]
MAX_NEW = 12


def _serve(engine: SlotEngine, prompts=PROMPTS, params=(SamplingParams(),), seed0: int = 0) -> list[list[int]]:
    """Each prompt in its slot (sampling values `params` in turn, seeds from `seed0`), stepped until all are done."""
    out = []
    for slot, prompt in enumerate(prompts):
        first, done = engine.prefill(slot, prompt, MAX_NEW, params[slot % len(params)], seed=seed0 + slot)
        out.append([first])
        assert not done
    busy = set(range(len(prompts)))
    any_sampled = any(not p.greedy for p in params)
    for _ in range(64):
        result = engine.step(np.zeros((engine.max_batch,), bool), any_sampled=any_sampled)
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


def _serve_sampled(engine: SlotEngine) -> list[list[int]]:
    """Every slot busy, each with its own sampling values and seed (one greedy among them)."""
    params = (SamplingParams(0.9, 0, 0.8), SamplingParams(1.0, 5, 1.0), SamplingParams(), SamplingParams(0.7, 3, 0.9))
    prompts = [[(3 * s + j) % 50 + 1 for j in range(4 + s)] for s in range(engine.max_batch)]
    return _serve(engine, prompts, params, seed0=100)


@pytest.mark.parametrize("shape, slots", [((1, 8), 8), ((2, 4), 8), ((2, 4), 4)])
def test_sampled_slots_answer_on_a_mesh_as_on_one_device(pair, shape, slots):
    """Sampled slots (their processing, draws and acceptance split by slot over the devices, model.shard_local's
    per_device_rows; with fewer slots than devices, left to GSPMD) emit on a mesh what they emit on one device,
    token for token."""
    cfg, w = pair
    kw = dict(num_steps=NUM_STEPS, max_batch=slots, max_context=64, cycles_per_step=2)
    want = _serve_sampled(SlotEngine(cfg, w, **kw))
    assert [len(t) for t in want] == [MAX_NEW] * slots
    assert _serve_sampled(SlotEngine(cfg, w, mesh=make_mesh(shape), **kw)) == want


def test_the_sampled_loop_moves_no_vocabulary_row_between_devices(pair):
    """The server's sampled loop on a 1 x 8 mesh (the draft reading the target's lm_head, so both its logits and
    the target's arrive split over the vocabulary): no collective of a cycle gathers rows of the vocabulary. Each
    device processes, samples and accepts its own slots' rows, whole, after an all-to-all hands them to it.
    Before, GSPMD gathered the draft's [B, V] and the target's [B, K + 1, V] probabilities every cycle."""
    from jaxspec.serving.slot_cycle import run_cycles
    from jaxspec.serving.slots import init_slots
    from jaxspec.sharded import lower_program

    from bench.labs.sharded_census import collectives

    cfg, w = pair
    assert w.draft.lm_head is None
    b, v = 8, cfg.target.vocab_size
    slots = jax.eval_shape(lambda w: init_slots(cfg, w, b, 64, jnp.float32, True), w)
    fn = functools.partial(run_cycles, cfg=cfg, k=NUM_STEPS, sampled=True, cycles=2)
    lowered, _ = lower_program(fn, (w, slots, jax.ShapeDtypeStruct((b,), jnp.bool_)), (1,), make_mesh((1, 8)))
    found = [c for c in collectives(lowered.compile().as_text()) if c["in_loop"]]
    assert found  # the forward's all-reduces at least
    assert not [c for c in found if re.search(rf"\[[\d,]*\b{v}\]", c["shape"])]
