"""The MLA flash-decoding kernel (model/kernels/mla_decode.py) against XLA's absorbed attention, in interpret mode.

The kernel has not run on a GPU yet; here it is checked for the numbers on CPU and for lowering to Triton IR
at Kimi K2.5's shapes (64 heads, latent 512, rope 64).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.kernels.mla_decode import MLAKernelConfig, combine_splits, mla_decode_context
from model.kv_cache import visible_slots

B, S, N, C, R = 2, 96, 4, 32, 16
SMALL = MLAKernelConfig(block_q=16, block_s=16, splits=3, num_warps=4)


def _reference_context(q_lat, q_rope, latent, k_rope, positions, scale):
    """The context half of model.attention_mla.attend_absorbed, in float32."""
    s = jnp.einsum("btnc,bsc->bnts", q_lat, latent, preferred_element_type=jnp.float32)
    s += jnp.einsum("btnr,bsr->bnts", q_rope, k_rope, preferred_element_type=jnp.float32)
    s = jnp.where(visible_slots(positions, latent.shape[1])[:, None], s * scale, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bnts,bsc->btnc", p, latent.astype(jnp.float32))


def _inputs(t, positions, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q_lat = jax.random.normal(ks[0], (B, t, N, C), jnp.float32).astype(dtype)
    q_rope = jax.random.normal(ks[1], (B, t, N, R), jnp.float32).astype(dtype)
    latent = jax.random.normal(ks[2], (B, S, C), jnp.float32).astype(dtype)
    k_rope = jax.random.normal(ks[3], (B, S, R), jnp.float32).astype(dtype)
    return q_lat, q_rope, latent, k_rope, jnp.asarray(positions, jnp.int32)


@pytest.mark.parametrize("t, positions", [
    (1, [[40], [95]]),  # decode; the second row sees the whole cache
    (3, [[5, 6, 7], [70, 71, 72]]),  # verify: causal within the new tokens, rows padded to the block
    (2, [[0, 1], [16, 17]]),  # the first slot only / a block boundary
])
def test_kernel_matches_absorbed_attention_float32(t, positions):
    args = _inputs(t, positions, jnp.float32)
    kernel = jax.jit(functools.partial(mla_decode_context, scale=0.2, cfg=SMALL, interpret=True))
    out = np.asarray(kernel(*args))
    ref = np.asarray(_reference_context(*args, 0.2))
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


def test_kernel_bf16_within_rounding():
    args = _inputs(2, [[30, 31], [90, 91]], jnp.bfloat16, seed=1)
    out = mla_decode_context(*args, scale=0.15, cfg=MLAKernelConfig(block_q=16, block_s=32, splits=2), interpret=True)
    assert out.dtype == jnp.bfloat16
    ref = np.asarray(_reference_context(*args, 0.15))
    err = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
    assert err < 1e-2


def test_attention_path_with_kernel_matches_absorbed():
    """model.attention_mla's "absorbed_kernel" path (k_nope absorbed into q, v out of the context) equals
    "absorbed" (float32); the decoder selects it by name (JAXSPEC_MLA_KERNEL=1 on a GPU)."""
    from model.attention_mla import ATTENTION_PATHS, MLAWeights
    from model.configs import known_config

    dn, dv, t = 8, 12, 3
    cfg = known_config("kimi-k2.5").replace(num_attention_heads=N, kv_lora_rank=C, qk_rope_head_dim=R,
                                            qk_nope_head_dim=dn, v_head_dim=dv)
    ks = jax.random.split(jax.random.PRNGKey(5), 4)
    w = MLAWeights(None, None, None, None, None, jax.random.normal(ks[0], (N, dn, C)),
                   jax.random.normal(ks[1], (N, dv, C)), None)
    q_nope = jax.random.normal(ks[2], (B, t, N, dn))
    _, q_rope, latent, k_rope, positions = _inputs(t, [[20, 21, 22], [60, 61, 62]], jnp.float32)
    args = (q_nope, q_rope, latent, k_rope, positions, w, cfg)
    np.testing.assert_allclose(np.asarray(ATTENTION_PATHS["absorbed_kernel"](*args)),
                               np.asarray(ATTENTION_PATHS["absorbed"](*args)), rtol=1e-4, atol=1e-4)


def test_combine_splits_ignores_empty_splits():
    """A split past every row's position keeps max -1e30 and sum 0 and must not change the result."""
    o = jnp.asarray([[[[2.0, 4.0]], [[0.0, 0.0]]]])  # [B=1, X=2, R=1, C=2]
    m = jnp.asarray([[[0.5], [-1e30]]])
    l = jnp.asarray([[[2.0], [0.0]]])
    np.testing.assert_allclose(np.asarray(combine_splits(o, m, l)), [[[1.0, 2.0]]])


def test_capacity_must_divide_into_blocks():
    args = _inputs(1, [[3], [4]], jnp.float32)
    with pytest.raises(ValueError, match="block_s"):
        mla_decode_context(*args, scale=0.1, cfg=MLAKernelConfig(block_s=64), interpret=True)


@pytest.mark.parametrize("t", [1, 4])
def test_lowers_to_triton_at_k25_shapes(t):
    from tests.test_kernels_moe import _pretend_h200

    sds = jax.ShapeDtypeStruct
    b, s, n, c, r = 1, 4096, 64, 512, 64
    restore = _pretend_h200()
    try:
        lowered = jax.jit(functools.partial(mla_decode_context, scale=0.1)).trace(
            sds((b, t, n, c), jnp.bfloat16), sds((b, t, n, r), jnp.bfloat16), sds((b, s, c), jnp.bfloat16),
            sds((b, s, r), jnp.bfloat16), sds((b, t), jnp.int32)).lower(lowering_platforms=("cuda",))
    finally:
        restore()
    assert "mla_decode" in lowered.as_text()
