"""A tiny target + draft whose dimensions divide an 8-device mesh (test helper for the sharding tests).

8 heads, 16 experts, FFN widths and vocab divisible by 8 (expert FFN 32: one INT4 group), batch 8: on the
meshes 8x1, 1x8 and 2x4 every rule of model/sharding.py really splits something. Weights come from numpy
(milliseconds, no compile) into the exact pytree `init_kimi_weights` builds, so several processes of a
multi-host test build the same model independently.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.baseline_step import baseline_step
from jaxspec.models import SpecConfig, SpecWeights
from jaxspec.prefill import baseline_prefill, spec_prefill
from jaxspec.sampling import SamplingParams
from jaxspec.sharded import compile_program
from jaxspec.spec_step import speculative_cycle
from model.decoder import forward
from model.init import init_draft_weights, init_kimi_weights
from model.sharding import path_str
from tests.tiny_models import tiny_draft_config, tiny_target_config

PROMPTS_8 = [[5, 6, 7, 8, 9], [1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [3], [9, 9, 9], [10, 11],
             [20, 21, 22, 23], [60, 61, 62]]
MAX_NEW = 10
NUM_STEPS = 2
CAPACITY = 64


def sharded_config(**kw):
    base = dict(num_hidden_layers=3, num_attention_heads=8, n_routed_experts=16, num_experts_per_tok=4,
                intermediate_size=48, moe_intermediate_size=32, aux_layer_ids=(0, 1, 2))
    base.update(kw)
    return tiny_target_config(64, **base)


def _random_leaf(rng: np.random.Generator, path: str, a: jax.ShapeDtypeStruct, logit_scale: float):
    shape = a.shape
    if a.dtype == jnp.uint32:  # packed int4 words
        return rng.integers(0, 2**32, shape, dtype=np.uint32)
    if path.endswith("scale"):  # int4 group scales
        return np.full(shape, 0.05, np.float32).astype(a.dtype)
    if a.dtype == jnp.int32:  # d2t
        return np.zeros(shape, np.int32)
    if path.endswith("norm"):
        value = 1.0 + 0.1 * rng.standard_normal(shape)
    elif path.endswith("router_bias"):
        value = 0.01 * rng.standard_normal(shape)
    elif path.endswith("embed"):
        value = rng.standard_normal(shape)
    else:  # matrices: unit variance over the contracted (last) dim
        value = rng.standard_normal(shape) * shape[-1] ** -0.5
        if path.endswith("lm_head"):
            value = value * logit_scale
    return np.asarray(value, np.float32).astype(a.dtype)


def numpy_like(abstract, seed: int, logit_scale: float = 3.0):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda p, a: jnp.asarray(_random_leaf(rng, path_str(p), a, logit_scale)), abstract
    )


def sharded_pair(seed: int = 0, dtype=jnp.float32, experts: str = "bf16"):
    """(SpecConfig, SpecWeights) on the default device, sharp enough (lm_head x3) for stable greedy tokens."""
    cfg = sharded_config()
    dcfg = tiny_draft_config(cfg)
    target = jax.eval_shape(lambda k: init_kimi_weights(cfg, k, dtype, experts=experts), jax.random.key(0))
    draft = jax.eval_shape(lambda k: init_draft_weights(dcfg, k, dtype), jax.random.key(0))
    return SpecConfig(cfg, dcfg, ()), SpecWeights(numpy_like(target, seed), numpy_like(draft, seed + 1))



def prompt_arrays():
    """PROMPTS_8 right-padded to the engine's bucket (16) with their lengths."""
    tokens = np.zeros((len(PROMPTS_8), 16), np.int32)
    for i, p in enumerate(PROMPTS_8):
        tokens[i, : len(p)] = p
    return jnp.asarray(tokens), jnp.asarray([len(p) for p in PROMPTS_8], jnp.int32)


def decode_with_logits(w, state, sp, *, cfg):
    """One baseline decode step, plus the target logits it chose its token from."""
    lengths_B = state.target_cache.lengths
    out = forward(w.target, cfg.target, state.pending[:, None], lengths_B[:, None], state.target_cache)
    logits_BV = out.logits[:, 0]
    return baseline_step(w, state, sp, cfg=cfg, greedy=True, max_new_tokens=MAX_NEW), logits_BV


def cycle_and_draft_logits(w, state, sp, *, cfg):
    """One speculative cycle, plus the draft logits it leaves for the next one (computed from the verify's
    aux states, so they carry the target's numerics too)."""
    state = speculative_cycle(w, state, sp, cfg=cfg, k=NUM_STEPS, greedy=True, max_new_tokens=MAX_NEW)
    return state, state.draft_logits


# The engine's shapes for PROMPTS_8 and MAX_NEW: bucket 16, capacity 64.
PROGRAMS = {
    "cycle": (
        lambda cfg: functools.partial(spec_prefill, cfg=cfg, capacity=CAPACITY, k=NUM_STEPS, greedy=True,
                                      max_new_tokens=MAX_NEW, max_cycles=MAX_NEW),
        lambda cfg: functools.partial(cycle_and_draft_logits, cfg=cfg),
    ),
    "decode": (
        lambda cfg: functools.partial(baseline_prefill, cfg=cfg, capacity=CAPACITY, greedy=True,
                                      max_new_tokens=MAX_NEW),
        lambda cfg: functools.partial(decode_with_logits, cfg=cfg),
    ),
}


def run_steps(program, w, state, sp):
    """Step until every sequence is done: (logits of every step, tokens emitted, final state)."""
    logits = []
    while not bool(jax.device_get(state.done).all()):
        state, logits_BV = program(w, state, sp)
        logits.append(np.asarray(jax.device_get(logits_BV)))
    generated, out_tokens = jax.device_get((state.generated, state.out_tokens))
    return logits, [out_tokens[i, : generated[i]].tolist() for i in range(len(generated))], state


@functools.cache
def single_device_run(name: str):
    """(prefilled state, logits per step, tokens) of program `name` compiled for one device; cached, since
    several test files compare to it."""
    cfg, w = sharded_pair()
    prefill, step = PROGRAMS[name]
    sp = SamplingParams().as_arrays()
    tokens, lengths = prompt_arrays()
    args = (w, tokens, lengths, jax.random.key(0), sp)
    state = compile_program(prefill(cfg), args)(*args)
    logits, toks, _ = run_steps(compile_program(step(cfg), (w, state, sp)), w, state, sp)
    return state, logits, toks
