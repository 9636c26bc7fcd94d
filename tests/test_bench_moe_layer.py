"""bench.moe_layer's timing harness: the chained calls, in a device loop or unrolled, each fed the last output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.moe_layer import _chained
from model.moe import ExpertWeights


@pytest.mark.parametrize("unrolled,per_iteration", [(True, 1), (False, 1), (False, 2)])
def test_moe_layer_chain_feeds_each_call_the_last_output(unrolled, per_iteration):
    fn = lambda x, experts, ids, w: x * w + ids[:, :1].astype(x.dtype)  # noqa: E731

    x = jnp.ones((2, 3), jnp.float32)
    ids = jnp.ones((2, 1), jnp.int32)
    experts = ExpertWeights(*(jnp.zeros((4, 2, 3), jnp.float32) for _ in range(3)))  # 4 experts
    out = _chained(fn, 4, unrolled, calls_per_iteration=per_iteration)(x, experts, ids, 2.0)
    want = x
    for _ in range(4):
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


def test_moe_layer_chain_rejects_a_grouping_that_does_not_divide_the_calls():
    with pytest.raises(ValueError, match="calls_per_iteration=3 must divide reps=4"):
        _chained(lambda x, *_: x, 4, calls_per_iteration=3)


def test_per_call_ms_is_the_difference_of_the_two_chains(monkeypatch):
    """A call's time excludes the chain's fixed cost: (long - short) / (LONG_REPS - REPS)."""
    import bench.moe_layer as moe_layer

    fixed, per_call = 0.3, 0.07  # ms
    runs = {"short": moe_layer.REPS, "long": moe_layer.LONG_REPS}

    def fake_median_ms(run, warmup, iters):
        n = runs[run()]
        return {"median_ms": fixed + n * per_call, "min_ms": fixed + n * per_call - 0.01,
                "max_ms": fixed + n * per_call + 0.03}

    monkeypatch.setattr(moe_layer, "median_ms", fake_median_ms)
    timing = moe_layer.per_call_ms((lambda: "short", lambda: "long"), ())
    assert timing["ms"] == pytest.approx(per_call)
    assert timing["chained_ms"] == pytest.approx(per_call + fixed / moe_layer.REPS)
    assert timing["spread_ms"] == pytest.approx(0.04 / moe_layer.REPS)


def test_moe_block_is_the_decoder_layers_moe_and_counts_its_bytes():
    """The whole-block row: `_moe_block` is `model.moe.moe` on [T, H] (routing inside it), and its floor's bytes are
    router + shared expert + the unique routed experts + x in and out."""
    import functools

    from bench.bytes_floor import nbytes
    from bench.moe_layer import _moe_block, moe_block_bytes, time_moe_block
    from bench.step import random_model
    from model.moe import MoEWeights, moe

    cfg, w = random_model(3, tiny=True)
    layer = next(lw.mlp for lw in w.layers if isinstance(lw.mlp, MoEWeights))
    x = jax.random.normal(jax.random.PRNGKey(0), (2, cfg.hidden_size)).astype(jnp.bfloat16)
    ids = jnp.zeros((2, cfg.num_experts_per_tok), jnp.int32)  # unused: the block routes x itself
    out = jax.jit(functools.partial(_moe_block, cfg=cfg))(x, layer, ids, jnp.ones(ids.shape, jnp.float32))
    want = jax.jit(lambda x, layer: moe(x[None], layer, cfg)[0][0])(x, layer)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    per_expert = nbytes(layer.experts) // layer.experts.num_experts
    assert moe_block_bytes(layer, 5, x) == (nbytes(layer.router) + nbytes(layer.router_bias) + nbytes(layer.shared)
                                            + 5 * per_expert + 2 * x.nbytes)
    assert np.isfinite(time_moe_block(layer, cfg, x, ids, jnp.ones(ids.shape, jnp.float32), iters=1)["ms"])
