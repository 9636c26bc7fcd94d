"""bench.labs.l2_prefetch (o_proj's rows read into L2 ahead of it; a lab since it did not pay): its kernel computes
what its plain reference does (Pallas interpret mode), refuses what it cannot tile, and the lab's layer with the
read-ahead gives bit for bit the layer without it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.labs import l2_prefetch as lab


@pytest.mark.parametrize("rows,cols", [(16, 16), (64, 1024), (48, 3072), (32, 96)])
def test_kernel_equals_its_reference(rows, cols):
    w = jax.random.normal(jax.random.key(rows + cols), (rows + 16, cols), jnp.float32).astype(jnp.bfloat16)
    dep = jnp.arange(32, dtype=jnp.float32).reshape(1, 32)
    got = lab.l2_prefetch_tiles(dep, w, rows, interpret=True)
    want = lab.l2_prefetch_reference(dep, w, rows)
    assert got.shape == want.shape == (rows // lab.BLOCK_ROWS * (cols // lab.block_cols(cols)), lab.DEP)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(lab.l2_prefetch(dep, w, rows, interpret=True)), np.asarray(want[0, :1]))


def test_kernel_refuses_what_it_cannot_tile():
    w = jnp.zeros((64, 1024), jnp.bfloat16)
    dep = jnp.zeros((1, 32), jnp.float32)
    for rows in (0, 8, 24, 80):  # none, not whole tiles, more than the weight has
        with pytest.raises(ValueError, match="l2_prefetch"):
            lab.l2_prefetch(dep, w, rows, interpret=True)
    with pytest.raises(ValueError, match="dep"):
        lab.l2_prefetch(jnp.zeros((1, 8)), w, 16, interpret=True)
    assert lab.block_cols(7) is None and lab.block_cols(8192) == 1024 and lab.block_cols(96) == 32


def test_the_lab_layer_with_the_read_ahead_is_the_layer_without(monkeypatch):
    for name, size in dict(HIDDEN=512, BIG=1024, HEADS=4, NOPE=16, LATENT=32, V_DIM=16, CONTEXT=64,
                           Q_LORA=128).items():  # the lab's layer at small dims: the same program, a CPU's pace
        monkeypatch.setattr(lab, name, size)
    layers = lab.make_layers(2, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, lab.HIDDEN), jnp.float32).astype(jnp.bfloat16)
    plain = lab.stack_loop(layers, x, 2, rows=0)
    read_ahead = lab.stack_loop(layers, x, 2, rows=2 * lab.BLOCK_ROWS, interpret=True)
    np.testing.assert_array_equal(np.asarray(read_ahead), np.asarray(plain))
