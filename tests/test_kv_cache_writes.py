"""Cache writes (model.kv_cache.write_slots): the batch-1 update against the scatter it replaces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.kv_cache import write_slots


def scattered(cache, new_BTX, positions_BT, slot_axis):
    """The plain reference: every (row, token) stored at its slot by a scatter that drops slots past the end."""
    batch_B1 = jnp.arange(cache.shape[0])[:, None]
    index = (batch_B1, *[slice(None)] * (slot_axis - 1), positions_BT)
    return cache.at[index].set(new_BTX.astype(cache.dtype), mode="drop")


@pytest.mark.parametrize("slot_axis, shape", [(1, (1, 24, 5)), (2, (1, 3, 24, 4))])
@pytest.mark.parametrize("t, start", [(1, 0), (1, 23), (4, 7), (4, 20)])
def test_batch_one_write_matches_the_scatter(slot_axis, shape, t, start):
    rng = np.random.default_rng(t * 100 + start)
    cache = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    x_shape = (1, t) + tuple(d for i, d in enumerate(shape) if i not in (0, slot_axis))
    new = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    positions = jnp.asarray([start + np.arange(t)], jnp.int32)
    got = jax.jit(write_slots, static_argnums=3)(cache, new, positions, slot_axis)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(scattered(cache, new, positions, slot_axis), np.float32))


def test_a_chunk_past_the_end_is_dropped_at_batch_one():
    """A padded prompt chunk longer than the cache (the server's admission) keeps the slots it can and drops the
    rest, as the scatter does."""
    cache = jnp.zeros((1, 8, 3), jnp.float32)
    new = jnp.arange(12 * 3, dtype=jnp.float32).reshape(1, 12, 3) + 1
    positions = jnp.arange(4, 16, dtype=jnp.int32)[None]
    got = np.asarray(write_slots(cache, new, positions))
    np.testing.assert_array_equal(got, np.asarray(scattered(cache, new, positions, 1)))
    assert not got[0, :4].any()


def test_larger_batches_drop_slots_past_the_end():
    cache = jnp.zeros((2, 8, 3), jnp.float32)
    new = jnp.ones((2, 2, 3), jnp.float32)
    positions = jnp.asarray([[6, 7], [7, 8]], jnp.int32)
    got = np.asarray(write_slots(cache, new, positions))
    assert got[0, 6:].all() and got[1, 7].all() and not got[1, :7].any()


def test_batch_one_write_reads_no_slot_back():
    """The point of the batch-1 path: XLA's optimized program updates the cache in place without first slicing out
    the slots it overwrites (a scatter's lowering does, to keep them where an index is out of range)."""
    cache = jnp.zeros((1, 64, 32), jnp.bfloat16)
    new = jnp.ones((1, 1, 32), jnp.bfloat16)
    pos = jnp.asarray([[5]], jnp.int32)
    ours = jax.jit(write_slots, donate_argnums=0).lower(cache, new, pos).compile().as_text()
    theirs = jax.jit(lambda c, n, p: scattered(c, n, p, 1), donate_argnums=0).lower(cache, new, pos).compile().as_text()
    assert "dynamic-slice(" in theirs  # the reference's read-back, so the check below can see one
    assert "dynamic-slice(" not in ours and "scatter(" not in ours
