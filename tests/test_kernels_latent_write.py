"""The latent caches' write of a few tokens with their norm and rope (model/kernels/latent_write.py) against its
plain reference (project_latent, then write_slots), in interpret mode, and lowered for CUDA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import Kernels
from model.kernels.dispatch import latent_write_applies
from model.kernels.latent_write import latent_write, latent_write_reference
from model.kernels.target import compiling_for

C, R, S, Q = 512, 64, 96, 1536  # Kimi-K2.5's latent and rope-key widths, q_a's columns before them


def _inputs(dtype=jnp.bfloat16, seed=0, b=1, t=1):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    kv = (2 * jax.random.normal(k[0], (b, t, Q + C + R))).astype(dtype)
    norm = (1 + 0.1 * jax.random.normal(k[1], (C,))).astype(dtype)
    angles = 6 * jax.random.uniform(k[2], (b, t, R // 2))
    latent = jax.random.normal(k[3], (b, S, C)).astype(dtype)
    k_rope = jax.random.normal(k[4], (b, S, R)).astype(dtype)
    return kv, norm, jnp.cos(angles), jnp.sin(angles), latent, k_rope


@pytest.mark.parametrize("position", [0, 40, S - 1, S + 7])  # past the capacity: the last slot, as write_slots
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_equals_norm_rope_and_write(position, dtype):
    kv, norm, cos, sin, latent, k_rope = _inputs(dtype)
    pos = jnp.asarray([[position]], jnp.int32)
    got = latent_write(kv, norm, cos, sin, latent, k_rope, pos, 1e-6, offset=Q, interpret=True)
    want = latent_write_reference(kv, norm, cos, sin, latent, k_rope, pos, 1e-6, offset=Q)
    for g, w, old in zip(got, want, (latent, k_rope)):
        assert g.shape == old.shape and g.dtype == old.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    slot = min(position, S - 1)
    untouched = np.ones(S, bool)
    untouched[slot] = False
    np.testing.assert_array_equal(np.asarray(got[0])[0, untouched], np.asarray(latent)[0, untouched])


@pytest.mark.parametrize("b, t, positions", [
    (1, 4, [[10, 11, 12, 13]]),  # a verify
    (1, 4, [[S - 2, S - 1, S, S + 1]]),  # a verify past the capacity: those slots dropped, as the scatter does
    (2, 1, [[5], [60]]),  # a batch's decode
    (2, 3, [[0, 1, 2], [40, 41, 42]]),
])
def test_several_tokens_as_write_slots_writes_them(b, t, positions):
    kv, norm, cos, sin, latent, k_rope = _inputs(jnp.bfloat16, seed=3, b=b, t=t)
    pos = jnp.asarray(positions, jnp.int32)
    got = latent_write(kv, norm, cos, sin, latent, k_rope, pos, 1e-6, offset=Q, interpret=True)
    want = latent_write_reference(kv, norm, cos, sin, latent, k_rope, pos, 1e-6, offset=Q)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_kv_alone_and_bad_input():
    kv, norm, cos, sin, latent, k_rope = _inputs(jnp.float32, seed=1)
    pos = jnp.asarray([[3]], jnp.int32)
    alone = kv[..., Q:]
    np.testing.assert_array_equal(
        np.asarray(latent_write(alone, norm, cos, sin, latent, k_rope, pos, 1e-6, interpret=True)[0]),
        np.asarray(latent_write(kv, norm, cos, sin, latent, k_rope, pos, 1e-6, offset=Q, interpret=True)[0]))
    with pytest.raises(ValueError, match="1 to 8 tokens"):
        latent_write(kv, norm, cos, sin, jnp.concatenate([latent, latent]), k_rope, pos, 1e-6, interpret=True)
    with pytest.raises(ValueError, match="disagree"):
        latent_write(kv, norm, cos, sin, latent, k_rope, pos, 1e-6, offset=Q + 1, interpret=True)
    with pytest.raises(TypeError, match="eps"):
        latent_write(alone, norm, cos, sin, latent, k_rope, pos, jnp.float32(1e-6), interpret=True)


def test_dispatch_takes_it_for_a_few_tokens_when_asked():
    on = Kernels(norms="on")
    assert not latent_write_applies(Kernels(), 1, 1, paged=False)
    assert latent_write_applies(on, 1, 1, paged=False)
    assert latent_write_applies(on, 2, 1, paged=False) and latent_write_applies(on, 1, 4, paged=False)
    assert not latent_write_applies(on, 1, 9, paged=False) and not latent_write_applies(on, 1, 1, paged=True)


def test_lowers_to_one_triton_kernel_writing_the_caches_in_place():
    """For CUDA: one Triton call whose outputs alias the two caches, and no XLA update of them."""
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    args = (sds((1, 1, Q + C + R), bf), sds((C,), bf), sds((1, 1, R // 2), jnp.float32),
            sds((1, 1, R // 2), jnp.float32),
            sds((1, 1088, C), bf), sds((1, 1088, R), bf), sds((1, 1), jnp.int32))
    with compiling_for("gpu", "9.0"):
        text = jax.jit(functools.partial(latent_write, eps=1e-6, offset=Q), donate_argnums=(4, 5)).trace(
            *args).lower(lowering_platforms=("cuda",)).as_text()
    jax.clear_caches()
    assert "latent_write" in text and "triton" in text
    assert "output_operand_aliases" in text and "dynamic_update_slice" not in text
