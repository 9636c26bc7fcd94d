"""Sharded execution on 8 simulated CPU devices equals one device: meshes 8x1, 1x8 and 2x4.

The programs under test are the engine's own step functions (speculative_cycle, baseline_step), compiled
by jaxspec.sharded.compile_program exactly as Engine(mesh=...) compiles them; the reference is the same
function compiled for one device. Greedy tokens must match exactly, logits within 1e-4 (float32).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxspec.engine import Engine
from jaxspec.sampling import SamplingParams
from jaxspec.sharded import compile_program
from model.kernels.moe_gather import routed_experts_pallas
from model.kernels.moe_tiles import MoEKernelConfig
from model.moe import moe
from model.moe_parallel import UNROLLED_SLOTS, local_choices, routed_experts_parallel
from model.sharding import make_mesh, mesh_context, shardings_for
from tests.sharded_pair import NUM_STEPS, PROGRAMS, run_steps, sharded_pair, single_device_run

MESH_SHAPES = [(8, 1), (1, 8), (2, 4)]
ATOL = 1e-4


@pytest.fixture(scope="module")
def pair():
    return sharded_pair()


@pytest.mark.parametrize("shape", MESH_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_sharded_program_equals_one_device(pair, shape, name):
    cfg, w = pair
    mesh = make_mesh(shape)
    state0, ref_logits, ref_tokens = single_device_run(name)
    sp = SamplingParams().as_arrays()
    program = compile_program(PROGRAMS[name][1](cfg), (w, state0, sp), mesh=mesh)
    logits, tokens, state = run_steps(program, w, state0, sp)

    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits) > 1
    for got, want in zip(logits, ref_logits):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    # the state stays laid out by STATE_RULES from step to step: caches' batch over "data"
    latent = state.target_cache.latent[0]
    assert latent.sharding.spec == P("data", None, None) and latent.sharding.mesh.shape == mesh.shape


def test_engine_places_weights_by_the_rules(pair):
    """Engine(mesh=...) lays weights out as the partition rules say (tests/test_multihost.py generates with
    it on a 2x4 mesh and compares tokens with one device)."""
    cfg, w = pair
    eng = Engine(cfg, w, num_steps=NUM_STEPS, mesh=make_mesh((2, 4)))
    experts = eng.weights.target.layers[1].mlp.experts.gate
    assert experts.sharding.spec == P(("data", "model"), None, None)
    assert {s.data.shape[0] for s in experts.addressable_shards} == {cfg.target.n_routed_experts // 8}
    assert eng.weights.target.layers[0].attn.o_proj.sharding.spec == P(None, "model", None)
    assert eng.weights.target.lm_head.sharding.spec == P("model", None)
    assert eng.weights.target.layers[0].mlp.gate.sharding.spec == P("model", None)
    assert eng.weights.draft.fc.sharding.is_fully_replicated
    again = Engine(cfg, eng.weights, num_steps=NUM_STEPS, mesh=eng.mesh)  # already placed: not copied
    assert again.weights.target.lm_head is eng.weights.target.lm_head


def test_an_output_the_program_writes_to_host_memory_stays_there_on_a_mesh():
    """`on_host` outputs (the progress and summaries the host reads after a call) keep host memory under the mesh
    program's explicit output shardings; the rest stays on the devices."""
    from jaxspec.state import on_host

    def fn(x):
        return x + 1, on_host(jnp.concatenate([x.sum(keepdims=True), x[:3]]))

    x = jnp.arange(16.0)
    out, read = compile_program(fn, (x,), (), make_mesh((2, 4)))(x)
    assert read.sharding.memory_kind == "pinned_host" and out.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(read), [120.0, 0.0, 1.0, 2.0])
    np.testing.assert_array_equal(np.asarray(out), np.arange(16.0) + 1)


@pytest.mark.parametrize("tokens", [3, 40], ids=["gather", "dense"])
def test_expert_parallel_moe_equals_reference_int4(tokens):
    """INT4 experts, few tokens (gather path) and many (dense path): the psum of local experts is the sum."""
    spec_cfg, weights = sharded_pair(seed=3, experts="int4")
    cfg, w = spec_cfg.target, weights.target.layers[1].mlp
    x_BTH = jax.random.normal(jax.random.key(4), (1, tokens, cfg.hidden_size), jnp.float32)
    want = jax.jit(moe, static_argnums=2)(x_BTH, w, cfg)
    mesh = make_mesh((2, 4))
    w_sharded = jax.device_put(w, shardings_for(w, mesh, ((r"^experts\.", ("experts", None, None)),)))
    with mesh_context(mesh):
        assert "shard_map" in str(jax.make_jaxpr(moe, static_argnums=2)(x_BTH, w_sharded, cfg))
        got = jax.jit(moe, static_argnums=2)(x_BTH, w_sharded, cfg)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))  # the same experts chosen


def test_pallas_kernel_runs_as_the_per_device_expert_computation():
    """With the fused Pallas MoE (interpret mode on CPU) as the per-device computation, each device runs the kernel
    over its 2 local experts and the psum equals the reference."""
    import model.moe as moe_module

    e, f, h, k, t = 16, 16, 32, 4, 3
    keys = jax.random.split(jax.random.key(5), 4)
    matrix = lambda key, out, inp: jax.random.normal(key, (e, out, inp), jnp.float32) * inp**-0.5  # noqa: E731
    experts = moe_module.ExpertWeights(matrix(keys[0], f, h), matrix(keys[1], f, h), matrix(keys[2], h, f))
    x_TH = jax.random.normal(keys[3], (t, h), jnp.float32)
    rng = np.random.default_rng(0)
    ids_TK = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32))
    weights_TK = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)).astype(np.float32))
    want = moe_module.experts_gather(x_TH, experts, ids_TK, weights_TK)

    pallas = functools.partial(routed_experts_pallas, cfg=MoEKernelConfig(block_f=16, block_h=16, block_k=16),
                               interpret=True)

    def kernel(x_TH, local, ids_TK, weights_TK, first_expert):  # the global choices, as a device is given them
        return pallas(x_TH, local, *local_choices(ids_TK, weights_TK, first_expert, local.num_experts))

    mesh = make_mesh((2, 4))
    sharded = jax.device_put(experts, shardings_for(experts, mesh, ((r".", ("experts", None, None)),)))
    with mesh_context(mesh):
        got = jax.jit(functools.partial(routed_experts_parallel, per_device_experts=kernel))(
            x_TH, sharded, ids_TK, weights_TK)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def _local_choices_reference(ids_TK, weights_TK, first, n):
    """The choices restricted to experts [first, first + n) in local ids, the others at weight 0 and pointed at the
    first local choice over all slots (row-major), or 0 where there is none."""
    ids, w = np.asarray(ids_TK), np.asarray(weights_TK)
    mine = (ids >= first) & (ids < first + n)
    filler = (ids[mine][0] - first) if mine.any() else 0
    return np.where(mine, ids - first, filler), np.where(mine, w, 0.0)


@pytest.mark.parametrize("tokens", [1, 4, 16])  # 8, 32 slots: found slot by slot; 128: by the reduction
def test_local_choices_point_other_devices_slots_at_a_local_choice(tokens):
    rng = np.random.default_rng(tokens)
    assert (tokens * 8 <= UNROLLED_SLOTS) == (tokens < 16)
    for first in (0, 48, 336):
        for trial in range(6):
            ids = rng.choice(384, size=(tokens, 8), replace=False) if trial else np.full((tokens, 8), 200)
            w = rng.random((tokens, 8)).astype(np.float32)
            got_ids, got_w = jax.jit(local_choices, static_argnums=3)(jnp.asarray(ids, jnp.int32), jnp.asarray(w),
                                                                      jnp.int32(first), 48)
            want_ids, want_w = _local_choices_reference(ids, w, first, 48)
            np.testing.assert_array_equal(np.asarray(got_ids), want_ids)
            np.testing.assert_array_equal(np.asarray(got_w), want_w)
