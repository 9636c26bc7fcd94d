"""moe_wgmma's kernels with persistent programs (model/kernels/moe_wgmma_persistent.py) against the plain reference
`experts_gather` under Pallas' GPU interpreter on CPU, and lowered to Mosaic GPU at Kimi K2 shapes. The GPU result is
held to moe_wgmma's by bench/moe_wgmma_lab.py (variants P:...) and bench/tma_stream_lab.py (pg / pd; bench/results/
README.md run 22)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.kernels import moe_wgmma_persistent as persistent
from model.moe import ExpertWeights, experts_gather
from model.quant import Int4Weight
from tests.test_kernels_moe_wgmma import E, H, K, experts  # noqa: F401  (the same small INT4 experts: a fixture)


def _routing(t):
    rng = np.random.default_rng(t)
    ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32))
    return ids, jnp.asarray(rng.uniform(0.1, 1.0, size=(t, K)).astype(np.float32))


def test_interpret_matches_reference_with_runs_clamped(experts):
    """Programs that do not divide the items: the last program's run is clamped to the last item (computed twice,
    stored the same), runs cross item boundaries (accumulators restart there) and split H."""
    x = jax.random.normal(jax.random.PRNGKey(2), (2, H)).astype(jnp.bfloat16)
    ids, w = _routing(2)
    fn = jax.jit(functools.partial(persistent.routed_experts_persistent, programs=5, stages=3, down_programs=3,
                                   gate_up_splits=2, down_splits=2, interpret=True))
    out = np.asarray(fn(x, experts, ids, w), np.float64)
    ref = np.asarray(experts_gather(x.astype(jnp.float32), experts, ids, w), np.float64)
    assert out.shape == (2, H) and np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


def test_bad_options_are_refused(experts):
    x = jnp.zeros((1, H), jnp.bfloat16)
    ids, w = _routing(1)
    with pytest.raises(ValueError, match="programs=0"):
        persistent.routed_experts_persistent(x, experts, ids, w, programs=0, interpret=True)
    with pytest.raises(ValueError, match="down_splits=3"):
        persistent.routed_experts_persistent(x, experts, ids, w, down_splits=3, interpret=True)


def test_lowers_to_mosaic_gpu_at_kimi_shapes():
    e, f, h = 384, 2048, 7168
    sd = jax.ShapeDtypeStruct
    w = lambda o, i: Int4Weight(sd((e, o, i // 8), jnp.uint32), sd((e, o, i // 32), jnp.bfloat16))  # noqa: E731
    experts = ExpertWeights(w(f, h), w(f, h), w(h, f))
    fn = functools.partial(persistent.routed_experts_persistent, programs=132, stages=8, down_programs=264,
                           down_stages=4, down_splits=8, down_k_splits=2)
    lowered = jax.jit(fn).trace(sd((1, h), jnp.bfloat16), experts, sd((1, 8), jnp.int32),
                                sd((1, 8), jnp.float32)).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("mosaic_gpu") >= 2
