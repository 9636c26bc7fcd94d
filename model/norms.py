"""RMSNorm, computed in float32 and cast back (as HF DeepseekV3 / Llama do)."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def add_rms_norm(x_XI: jax.Array, addend_XI: jax.Array | None, weight_W: jax.Array, eps: float):
    """(x + addend in x's dtype, or None without an addend; the RMSNorm of its first W columns): a residual add
    and the norm after it, the plain form of model/kernels/rms_norm.py."""
    total_XI = x_XI if addend_XI is None else x_XI + addend_XI.astype(x_XI.dtype)
    normed_XW = rms_norm(total_XI[..., : weight_W.shape[0]], weight_W, eps)
    return (None if addend_XI is None else total_XI), normed_XW
