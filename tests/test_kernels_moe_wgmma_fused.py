"""The one-kernel decode MoE (model/kernels/moe_wgmma_fused.py) against the plain reference `experts_gather`.

On CPU the kernel runs under Pallas' GPU interpreter (the same pipelines, index maps, fused-down layout, column
order and B built from h; a dot_general stands in for the register-operand wgmma, and each program's share of y
goes to its own row where the GPU reduce-adds it by TMA). The kernel is also lowered to Mosaic GPU at Kimi K2
shapes. The GPU result is held to the reference by bench/moe_wgmma_lab.py (variants f:..., bench/results/).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.kernels import moe_wgmma_fused as fused
from model.kernels.moe_wgmma import permute_K
from model.moe import ExpertWeights, experts_gather
from model.quant import Int4Weight
from tests.test_kernels_moe_wgmma import E, F, H, K, experts  # noqa: F401  (the same small INT4 experts: a fixture)


@pytest.fixture(scope="module")
def down_fused(experts):
    return jax.jit(fused.fused_down_layout)(experts.down)


def _nibbles(packed) -> np.ndarray:
    p = np.asarray(packed).astype(np.uint64)
    return ((p[..., None] >> (4 * np.arange(8, dtype=np.uint64))) & 0xF).reshape(*p.shape[:-1], -1)


@pytest.mark.parametrize("t,options", [(1, {}), (2, {"biased": True, "down_tiles": 1, "stages": 3, "down_stages": 2})])
def test_interpret_matches_reference(experts, down_fused, t, options):
    x = jax.random.normal(jax.random.PRNGKey(t), (t, H)).astype(jnp.bfloat16)
    rng = np.random.default_rng(t)
    ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32))
    w = jnp.asarray(rng.uniform(0.1, 1.0, size=(t, K)).astype(np.float32))
    out = jax.jit(functools.partial(fused.routed_experts_fused, interpret=True, **options))(x, experts, down_fused,
                                                                                           ids, w)
    ref = np.asarray(experts_gather(x.astype(jnp.float32), experts, ids, w), np.float64)
    out = np.asarray(out, np.float64)
    assert out.shape == (t, H) and np.isfinite(out).all()
    # x and h enter the wgmma as bf16: ~2.5e-3 of rounding, as moe_wgmma
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


def test_fused_down_layout_holds_each_value_once_in_its_place(experts, down_fused):
    """Row R of F block b, column 64j + s: down[e, 4R + j, 64b + p[s]] with p the inverse of permute_K's order;
    scale column 2j + c: H row 4R + j's scale of the block's half c."""
    src, dst = _nibbles(experts.down.packed), _nibbles(down_fused.packed)
    assert down_fused.packed.shape == (E, F // 64, H // 4, 32) and down_fused.scale.shape == (E, F // 64, H // 4, 8)
    order = np.asarray(permute_K(jnp.arange(64)))
    inverse = np.argsort(order)
    rng = np.random.default_rng(0)
    for _ in range(200):
        e, b, r, j, s = (rng.integers(n) for n in (E, F // 64, H // 4, 4, 64))
        assert dst[e, b, r, 64 * j + s] == src[e, 4 * r + j, 64 * b + inverse[s]]
        c = int(rng.integers(2))
        assert down_fused.scale[e, b, r, 2 * j + c] == experts.down.scale[e, 4 * r + j, 2 * b + c]
    # the wgmma sees stored column order[k] at column k: block value k, h's own order
    assert (inverse[order] == np.arange(64)).all()


def test_group_sums_match_the_bf16_input():
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 512)).astype(jnp.bfloat16)
    sums = np.asarray(fused._group_sums_x(x))
    want = fused.BIAS * np.asarray(x, np.float32).reshape(2, 2, 8, 32).sum(-1)
    np.testing.assert_allclose(sums, want, rtol=1e-6)


def test_bad_layouts_are_refused(experts):
    wrong = Int4Weight(experts.down.packed[:, :, :16], experts.down.scale[:, :, :4])  # F of 128: not the gate's 256
    x = jnp.zeros((1, H), jnp.bfloat16)
    ids, w = jnp.zeros((1, K), jnp.int32), jnp.ones((1, K), jnp.float32)
    with pytest.raises(ValueError, match="down_fused is"):
        fused.routed_experts_fused(x, experts, fused.fused_down_layout(wrong), ids, w, interpret=True)
    with pytest.raises(ValueError, match="multiple of 4"):
        fused.fused_down_layout(Int4Weight(jnp.zeros((1, 6, 32), jnp.uint32), jnp.zeros((1, 6, 8), jnp.bfloat16)))
    with pytest.raises(ValueError, match="down_tiles=3"):
        fused.routed_experts_fused(x, experts, fused.fused_down_layout(experts.down), ids, w, down_tiles=3,
                                   interpret=True)


@pytest.mark.parametrize("options", [{}, {"biased": True, "down_tiles": 1}, {"overlap": 2}])
def test_lowers_to_mosaic_gpu_at_kimi_shapes(options):
    e, f, h = 384, 2048, 7168
    sd = jax.ShapeDtypeStruct
    w = lambda o, i: Int4Weight(sd((e, o, i // 8), jnp.uint32), sd((e, o, i // 32), jnp.bfloat16))  # noqa: E731
    experts = ExpertWeights(w(f, h), w(f, h), w(h, f))
    down_fused = Int4Weight(sd((e, f // 64, h // 4, 32), jnp.uint32), sd((e, f // 64, h // 4, 8), jnp.bfloat16))
    fn = functools.partial(fused.routed_experts_fused, **options)
    lowered = jax.jit(fn).trace(sd((1, h), jnp.bfloat16), experts, down_fused, sd((1, 8), jnp.int32),
                                sd((1, 8), jnp.float32)).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_diagnostic_without_conversion_computes_weights_of_ones(experts, down_fused):
    ones = lambda w: Int4Weight(jnp.full_like(w.packed, 0x99999999), w.scale)  # noqa: E731  (int4 value 1 everywhere)
    experts_1 = ExpertWeights(ones(experts.gate), ones(experts.up), ones(experts.down))
    x = jax.random.normal(jax.random.PRNGKey(6), (1, H)).astype(jnp.bfloat16)
    ids, w = jnp.asarray([[0, 2, 3, 5]], jnp.int32), jnp.asarray([[0.4, 0.3, 0.2, 0.1]], jnp.float32)
    out = jax.jit(functools.partial(fused.routed_experts_fused, convert="none", interpret=True))(x, experts, down_fused,
                                                                                               ids, w)
    ref = np.asarray(experts_gather(x.astype(jnp.float32), experts_1, ids, w), np.float64)
    assert np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref) < 1e-2
    with pytest.raises(ValueError, match="convert must be"):
        fused.routed_experts_fused(x, experts, down_fused, ids, w, convert="mosaic", interpret=True)
