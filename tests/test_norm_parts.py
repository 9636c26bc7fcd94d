"""One reduction for several norms' sums of squares (model.norms.sums_of_squares_of_parts), as MLA's q_a and kv_a
norms take it from their one GEMM's output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.norms import rms_norm, sums_of_squares_of_parts


@pytest.mark.parametrize("widths, extra", [((1536, 512), 64), ((12, 8), 4), ((16, 16), 0), ((6, 9, 3), 5)])
def test_parts_sum_what_each_part_sums(widths, extra):
    x = jnp.asarray(np.random.default_rng(sum(widths)).standard_normal((2, 3, sum(widths) + extra)), jnp.bfloat16)
    got = jax.jit(sums_of_squares_of_parts, static_argnums=1)(x, widths)
    start = 0
    for width, part in zip(widths, got):
        x32 = np.asarray(x[..., start:start + width], np.float32)
        np.testing.assert_allclose(np.asarray(part), (x32 * x32).sum(-1, keepdims=True), rtol=1e-5)
        start += width


def test_norm_from_a_given_sum_equals_the_norm():
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, 48)), jnp.float32)
    weight = jnp.asarray(np.random.default_rng(4).standard_normal(48), jnp.float32)
    (sums,) = sums_of_squares_of_parts(x, (48,))
    np.testing.assert_allclose(rms_norm(x, weight, 1e-6, sums), rms_norm(x, weight, 1e-6), rtol=1e-6)


def test_one_reduction_serves_the_parts():
    """Two parts, one reduce in the optimized program (each would be its own kernel on a GPU)."""
    x = jnp.ones((1, 1, 2112), jnp.bfloat16)
    hlo = jax.jit(lambda v: sums_of_squares_of_parts(v, (1536, 512))).lower(x).compile().as_text()
    assert hlo.count(" reduce(") == 1
