"""Sampled generation on 8 simulated CPU devices equals one device, token for token: the processed distributions,
draws and acceptance tests of a batch run by rows, each device its share (`jaxspec.sampling.processed_probs_by_rows`;
JAX's partitionable random bits give each row what one device draws for it), and no program step gathers a
vocabulary-wide array."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from bench.labs.sharded_census import collectives
from jaxspec.adaptive import AdaptivePolicy
from jaxspec.baseline_step import baseline_step
from jaxspec.engine import Engine
from jaxspec.prefill import baseline_prefill, spec_prefill
from jaxspec.sampling import SamplingParams
from jaxspec.sharded import lower_program
from jaxspec.spec_step import speculative_cycle
from model.sharding import make_mesh
from tests.sharded_pair import MAX_NEW, NUM_STEPS, PROMPTS_8, sharded_pair

SAMPLING = SamplingParams(0.9, 0, 0.8)
COSTS = ((0, 2e-3), (1, 3e-3), (2, 4e-3))  # given, so nothing is timed; the schedule runs plain steps and cycles
RUNS = {
    "plain": dict(speculative=False),
    "speculative": dict(speculative=True),
    "adaptive": dict(speculative=True, adaptive=AdaptivePolicy(costs=COSTS, schedule=(0, 0, 2, 1), backlog=2)),
}


@pytest.fixture(scope="module")
def pair():
    return sharded_pair()


def _generate(pair, mesh, run):
    cfg, w = pair
    kw = dict(RUNS[run])
    speculative = kw.pop("speculative")
    engine = Engine(cfg, w, num_steps=NUM_STEPS, mesh=mesh, **kw)
    return engine.generate(PROMPTS_8, MAX_NEW, SAMPLING, seed=5, speculative=speculative).tokens


@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("shape", [(1, 8), (2, 4)])
def test_sampled_generation_on_a_mesh_equals_one_device(pair, shape, run):
    want = _generate(pair, None, run)
    assert [len(t) for t in want] == [MAX_NEW] * len(PROMPTS_8)
    assert _generate(pair, make_mesh(shape), run) == want


@pytest.mark.parametrize("program", ["plain step", "cycle"])
def test_a_sampled_step_gathers_no_vocabulary_row(pair, program):
    """A batch of 8 on a 1 x 8 mesh: the baseline's sampled step and the sampled K = 2 cycle (its draft reading the
    target's lm_head, so its logits too arrive split over the vocabulary) move no array as wide as the vocabulary
    through a collective, except the draft's logits the step leaves in its state."""
    cfg, w = pair
    assert w.draft.lm_head is None
    b, v = len(PROMPTS_8), cfg.target.vocab_size
    sp = SAMPLING.as_arrays()
    prompt = (jax.ShapeDtypeStruct((b, 16), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32), jax.random.key(0), sp)
    kw = dict(cfg=cfg, capacity=64, greedy=False, max_new_tokens=MAX_NEW)
    if program == "cycle":
        state = jax.eval_shape(functools.partial(spec_prefill, **kw, k=NUM_STEPS, max_cycles=MAX_NEW), w, *prompt)
        fn = functools.partial(speculative_cycle, cfg=cfg, k=NUM_STEPS, greedy=False, max_new_tokens=MAX_NEW)
    else:
        state = jax.eval_shape(functools.partial(baseline_prefill, **kw), w, *prompt)
        fn = functools.partial(baseline_step, cfg=cfg, greedy=False, max_new_tokens=MAX_NEW)
    lowered, _ = lower_program(fn, (w, state, sp), (1,), make_mesh((1, 8)))
    wide = [c["shape"] for c in collectives(lowered.compile().as_text()) if re.search(rf"\[[\d,]*\b{v}\]", c["shape"])]
    assert wide == ([f"f32[{b},{v}]{{0,1}}"] if program == "cycle" else []), wide


def test_the_sampled_loop_keeps_the_forward_whole_batch(pair):
    """The engine's device loop of sampled K = 2 cycles on a 1 x 8 mesh: the rows split for sampling stay inside
    the cycle (its state is held to STATE_RULES as it returns, `held_to_table`), so no collective of the loop
    gathers hidden states, as one would if GSPMD had carried the split into the next cycle's forward."""
    cfg, w = pair
    b, h = len(PROMPTS_8), cfg.target.hidden_size
    sp = SAMPLING.as_arrays()
    prompt = (jax.ShapeDtypeStruct((b, 16), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32), jax.random.key(0), sp)
    kw = dict(cfg=cfg, capacity=64, greedy=False, max_new_tokens=MAX_NEW)
    state = jax.eval_shape(functools.partial(spec_prefill, **kw, k=NUM_STEPS, max_cycles=MAX_NEW), w, *prompt)
    cycle = functools.partial(speculative_cycle, cfg=cfg, k=NUM_STEPS, greedy=False, max_new_tokens=MAX_NEW)

    def loop(w, s, sp):
        return jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: cycle(w, s, sp), s)

    lowered, _ = lower_program(loop, (w, state, sp), (1,), make_mesh((1, 8)))
    found = [c for c in collectives(lowered.compile().as_text()) if c["in_loop"]]
    assert [c for c in found if c["op"] == "all-to-all"]  # the verify's logits, to their rows
    assert not [c["shape"] for c in found if c["op"] == "all-gather" and re.search(rf",{h}\]", c["shape"])]
