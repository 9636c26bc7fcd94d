"""The one-launch MoE with cross-program waits (model/kernels/moe_wgmma_chained.py) against `experts_gather`.

On CPU the kernel runs under Pallas' GPU interpreter, whose programs run one after another in grid order: there the
gate_up programs have finished before any down (or h) program reads their sums, so the semaphore waits are left out
and gu keeps one row per split (no TMA reductions there). What is held here: the grid's split into phases, every
index map, B built from gu in both column orders (in-order conversion; nibble pairs over gate / up rows stored in
the pairs' order), B streamed from the h programs, the error messages, and the lowering of both designs to Mosaic
GPU at Kimi K2 shapes (semaphores, TMA reduce-add). The GPU result is held to the reference by
bench/moe_wgmma_lab.py (variants c:..., bench/results/README.md run 20).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.kernels import moe_wgmma_chained as chained
from model.kernels.moe_wgmma import permute_K
from model.moe import ExpertWeights, experts_gather
from model.quant import Int4Weight
from tests.test_kernels_moe_wgmma import _int4, _rel_err

E, F, H, K = 6, 512, 512, 4  # two tiles of F, so F splits in two shares


@pytest.fixture(scope="module")
def experts():
    kg, ku, kd = jax.random.split(jax.random.PRNGKey(1), 3)
    return ExpertWeights(_int4(kg, E, F, H), _int4(ku, E, F, H), _int4(kd, E, H, F))


def _inputs(t: int):
    x = jax.random.normal(jax.random.PRNGKey(t), (t, H)).astype(jnp.bfloat16)
    rng = np.random.default_rng(t)
    ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32))
    return x, ids, jnp.asarray(rng.uniform(0.1, 1.0, size=(t, K)).astype(np.float32))


@pytest.mark.parametrize("t,options", [
    (1, dict(gate_up_splits=2, down_k_splits=2)),
    (1, dict(gate_up_splits=2, down_k_splits=2, gate_up_rows_permuted=True, h_programs=True)),
    (2, dict(gate_up_splits=1, down_k_splits=1, h_programs=True, stages=1, down_stages=2)),
])
def test_interpret_matches_reference(experts, t, options):
    x, ids, w = _inputs(t)
    weights = chained.permute_gate_up_rows(experts) if options.get("gate_up_rows_permuted") else experts
    out = jax.jit(functools.partial(chained.routed_experts_chained, interpret=True, **options))(x, weights, ids, w)
    ref = experts_gather(x.astype(jnp.float32), experts, ids, w)
    assert out.shape == (t, H) and out.dtype == jnp.bfloat16
    # x and h enter the wgmma as bf16: ~2.5e-3 of rounding, as moe_wgmma
    assert _rel_err(out, ref) < 1e-2


def test_permuted_rows_hold_row_order_m_at_m(experts):
    """Row m of each 32 holds row permute_K's m: the same experts only to a kernel that reads h in that order."""
    moved = chained.permute_gate_up_rows(experts)
    order = np.asarray(permute_K(jnp.arange(F)))
    for new, old in ((moved.gate, experts.gate), (moved.up, experts.up)):
        np.testing.assert_array_equal(np.asarray(new.packed), np.asarray(old.packed)[:, order])
        np.testing.assert_array_equal(np.asarray(new.scale), np.asarray(old.scale)[:, order])
    assert moved.down is experts.down
    x, ids, w = _inputs(1)
    wrong = experts_gather(x.astype(jnp.float32), moved, ids, w)  # the plain path reads F in its own order
    assert _rel_err(wrong, experts_gather(x.astype(jnp.float32), experts, ids, w)) > 0.5


def test_bad_splits_and_weights_are_refused(experts):
    x, ids, w = _inputs(1)
    with pytest.raises(ValueError, match="gate_up_splits=3"):
        chained.routed_experts_chained(x, experts, ids, w, gate_up_splits=3, interpret=True)
    with pytest.raises(ValueError, match="down_k_splits=4"):
        chained.routed_experts_chained(x, experts, ids, w, gate_up_splits=1, down_k_splits=4, interpret=True)
    bf16 = ExpertWeights(jnp.zeros((E, F, H), jnp.bfloat16), jnp.zeros((E, F, H), jnp.bfloat16),
                         jnp.zeros((E, H, F), jnp.bfloat16))
    with pytest.raises(ValueError, match="INT4 experts"):
        chained.routed_experts_chained(x, bf16, ids, w, interpret=True)


@pytest.mark.parametrize("t,options", [(1, {}), (1, dict(gate_up_rows_permuted=True, h_programs=True)),
                                       (4, dict(down_k_splits=1))])
def test_lowers_to_mosaic_gpu_at_kimi_shapes(t, options):
    e, f, h = 384, 2048, 7168
    sd = jax.ShapeDtypeStruct
    w = lambda o, i: Int4Weight(sd((e, o, i // 8), jnp.uint32), sd((e, o, i // 32), jnp.bfloat16))  # noqa: E731
    experts = ExpertWeights(w(f, h), w(f, h), w(h, f))
    fn = functools.partial(chained.routed_experts_chained, **options)
    text = jax.jit(fn).trace(sd((t, h), jnp.bfloat16), experts, sd((t, 8), jnp.int32),
                             sd((t, 8), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1 and "moe_wgmma_chained" in text
