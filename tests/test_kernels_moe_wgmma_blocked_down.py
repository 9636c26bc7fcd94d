"""moe_wgmma with its down kernel over F-blocked tiles (model/kernels/moe_wgmma_blocked_down.py) against the plain
reference `experts_gather`: under Pallas' GPU interpreter on CPU, and lowered to Mosaic GPU at Kimi K2 shapes. The
GPU result is held to the reference by bench/moe_wgmma_lab.py (variants d:..., bench/results/README.md run 19)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.kernels import moe_wgmma_blocked_down as blocked
from model.kernels.moe_wgmma_fused import fused_down_layout
from model.moe import ExpertWeights, experts_gather
from model.quant import Int4Weight
from tests.test_kernels_moe_wgmma import E, H, K, experts  # noqa: F401  (the same small INT4 experts: a fixture)


def test_interpret_matches_reference(experts):
    x = jax.random.normal(jax.random.PRNGKey(2), (2, H)).astype(jnp.bfloat16)
    rng = np.random.default_rng(2)
    ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(2)]).astype(np.int32))
    w = jnp.asarray(rng.uniform(0.1, 1.0, size=(2, K)).astype(np.float32))
    fn = jax.jit(functools.partial(blocked.routed_experts_blocked_down, gate_up_splits=2, down_splits=2,
                                   down_k_splits=2, interpret=True))
    out = np.asarray(fn(x, experts, jax.jit(fused_down_layout)(experts.down), ids, w), np.float64)
    ref = np.asarray(experts_gather(x.astype(jnp.float32), experts, ids, w), np.float64)
    assert out.shape == (2, H) and np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    with pytest.raises(ValueError, match="down_k_splits=3"):
        blocked.routed_experts_blocked_down(x, experts, fused_down_layout(experts.down), ids, w, down_k_splits=3,
                                            interpret=True)
    with pytest.raises(ValueError, match="down_fused is"):
        blocked.routed_experts_blocked_down(x, experts, experts.down, ids, w, interpret=True)


def test_lowers_to_mosaic_gpu_at_kimi_shapes():
    e, f, h = 384, 2048, 7168
    sd = jax.ShapeDtypeStruct
    w = lambda o, i: Int4Weight(sd((e, o, i // 8), jnp.uint32), sd((e, o, i // 32), jnp.bfloat16))  # noqa: E731
    experts = ExpertWeights(w(f, h), w(f, h), w(h, f))
    down_fused = Int4Weight(sd((e, f // 64, h // 4, 32), jnp.uint32), sd((e, f // 64, h // 4, 8), jnp.bfloat16))
    lowered = jax.jit(blocked.routed_experts_blocked_down).trace(
        sd((1, h), jnp.bfloat16), experts, down_fused, sd((1, 8), jnp.int32), sd((1, 8), jnp.float32)
    ).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("mosaic_gpu") >= 2
