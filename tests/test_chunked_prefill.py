"""Chunked prefill: a prompt bucket longer than the chunk runs as a device loop over chunks and must leave the
same state (caches, first token, draft logits / hidden at each sequence's last position) as one pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine import Engine
from jaxspec.prefill import baseline_prefill, spec_prefill
from jaxspec.sampling import SamplingParams
from tests.numpy_pair import numpy_tiny_pair

# lengths 37, 50, 3 -> bucket 64: four chunks of 16, the sequences end in chunks 2, 3 and 0
PROMPTS = [list(range(3, 40)), [(7 * i) % 90 + 1 for i in range(50)], [5, 6, 7]]


@pytest.fixture(scope="module")
def pair():
    return numpy_tiny_pair(seed=0, logit_scale=3.0)


def _inputs(cfg):
    tokens = np.zeros((len(PROMPTS), 64), np.int32)
    for i, p in enumerate(PROMPTS):
        tokens[i, : len(p)] = p
    lengths = np.array([len(p) for p in PROMPTS], np.int32)
    return jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(3), SamplingParams(0.8, 0, 0.9).as_arrays()


@pytest.mark.parametrize("greedy", [True, False])
def test_chunked_spec_prefill_equals_one_pass(pair, greedy):
    cfg, w = pair
    args = (w, *_inputs(cfg))
    kw = dict(cfg=cfg, capacity=128, k=3, greedy=greedy, max_new_tokens=8, max_cycles=8)
    one = jax.jit(lambda *a: spec_prefill(*a, chunk=64, **kw))(*args)
    chunked = jax.jit(lambda *a: spec_prefill(*a, chunk=16, **kw))(*args)
    np.testing.assert_array_equal(np.asarray(chunked.pending), np.asarray(one.pending))
    np.testing.assert_array_equal(np.asarray(chunked.target_cache.lengths), [37, 50, 3])
    for a, b in zip(jax.tree_util.tree_leaves((chunked.target_cache, chunked.draft_cache, chunked.draft_logits,
                                               chunked.draft_hidden)),
                    jax.tree_util.tree_leaves((one.target_cache, one.draft_cache, one.draft_logits, one.draft_hidden))):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=1e-5)


def test_chunked_baseline_prefill_equals_one_pass(pair):
    cfg, w = pair
    args = (w, *_inputs(cfg))
    kw = dict(cfg=cfg, capacity=128, greedy=True, max_new_tokens=8)
    one = jax.jit(lambda *a: baseline_prefill(*a, chunk=512, **kw))(*args)
    chunked = jax.jit(lambda *a: baseline_prefill(*a, chunk=32, **kw))(*args)
    np.testing.assert_array_equal(np.asarray(chunked.pending), np.asarray(one.pending))
    for a, b in zip(jax.tree_util.tree_leaves(chunked.target_cache), jax.tree_util.tree_leaves(one.target_cache)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=1e-5)


def test_engine_generates_the_same_tokens_with_small_chunks(pair):
    cfg, w = pair
    ref = Engine(cfg, w, num_steps=3).generate(PROMPTS, 12)
    chunked = Engine(cfg, w, num_steps=3, prefill_chunk=16).generate(PROMPTS, 12)
    assert chunked.tokens == ref.tokens and chunked.prompt_tokens == [37, 50, 3]


@pytest.mark.parametrize("chunk", [8, 48, 0])
def test_prefill_chunk_must_be_a_power_of_two_of_at_least_16(pair, chunk):
    cfg, w = pair
    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine(cfg, w, num_steps=1, prefill_chunk=chunk)
