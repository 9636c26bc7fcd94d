"""bench/labs/moe_grouped_tokens.py (group kernels with one wgmma per token) against the plain reference in Pallas'
GPU interpreter, and lowered to Mosaic GPU at Kimi K2 shapes (Mosaic's layout and lowering checks)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.labs import moe_grouped_tokens as lab
from model.moe import experts_gather
from tests.test_kernels_moe_grouped import lowered_at_kimi_shapes
from tests.test_kernels_moe_wgmma import H, _rel_err, experts  # noqa: F401  (the module's fixture)


def test_interpret_matches_reference(experts):  # noqa: F811
    """Three tokens, four choices of six experts: two experts shared by tokens 0 and 1 (groups), one by all three,
    the rest alone (slots)."""
    ids = jnp.asarray([[0, 1, 2, 3], [0, 1, 4, 2], [2, 5, 3, 4]], jnp.int32)
    w = jnp.asarray(np.random.default_rng(3).uniform(0.1, 1.0, (3, 4)), jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(3), (3, H)).astype(jnp.bfloat16)
    fn = jax.jit(functools.partial(lab.routed_experts_grouped_tokens, down_splits=2, interpret=True))
    out = fn(x, experts, ids, w)
    ref = experts_gather(x.astype(jnp.float32), experts, ids, w)
    assert out.shape == (3, H)
    assert _rel_err(out, ref) < 1e-2


def test_lowers_to_mosaic_gpu_at_kimi_shapes():
    # the slot kernels and the group kernels
    assert lowered_at_kimi_shapes(lab.routed_experts_grouped_tokens).count("mosaic_gpu") >= 4
