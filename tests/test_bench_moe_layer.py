"""bench.moe_layer's timing harness: the chained calls, in a device loop or unrolled, each fed the last output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.moe_layer import _chained
from model.moe import ExpertWeights


@pytest.mark.parametrize("unrolled", [True, False])
def test_moe_layer_chain_feeds_each_call_the_last_output(unrolled):
    fn = lambda x, experts, ids, w: x * w + ids[:, :1].astype(x.dtype)  # noqa: E731

    x = jnp.ones((2, 3), jnp.float32)
    ids = jnp.ones((2, 1), jnp.int32)
    experts = ExpertWeights(*(jnp.zeros((4, 2, 3), jnp.float32) for _ in range(3)))  # 4 experts
    out = _chained(fn, 3, unrolled)(x, experts, ids, 2.0)
    want = x
    for _ in range(3):
        want = want + 1e-3 * (want * 2.0 + 1.0)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6)


@pytest.mark.parametrize("chain_ids", [True, False])
def test_moe_layer_chain_makes_ids_depend_on_the_output_only_when_asked(chain_ids):
    """The reference's chain keeps its weight gathers in the loop; the kernels' chain adds no op on the ids."""
    fn = lambda x, experts, ids, w: x * w + ids[:, :1].astype(x.dtype)  # noqa: E731
    x, ids = jnp.ones((2, 3), jnp.float32), jnp.ones((2, 1), jnp.int32)
    experts = ExpertWeights(*(jnp.zeros((4, 2, 3), jnp.float32) for _ in range(3)))
    jaxpr = str(jax.make_jaxpr(_chained(fn, 3, chain_ids=chain_ids))(x, experts, ids, 2.0))
    assert ("select_n" in jaxpr) == chain_ids
