"""Rotary position embeddings: YaRN inverse frequencies, interleaved (DeepSeek) and NeoX (Llama) rotation."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from model.config import TextConfig, YarnRope, yarn_mscale


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_correction_range(y: YarnRope, dim: int, base: float) -> tuple[float, float]:
    """Frequency indices [low, high] between which YaRN ramps from extrapolation to interpolation."""
    low = math.floor(_yarn_correction_dim(y.beta_fast, dim, base, y.original_max_position_embeddings))
    high = math.ceil(_yarn_correction_dim(y.beta_slow, dim, base, y.original_max_position_embeddings))
    return max(low, 0), min(high, dim - 1)


def inv_frequencies(dim: int, base: float, yarn: YarnRope | None) -> np.ndarray:
    """Inverse frequencies [dim/2] (float32), YaRN-blended when `yarn` is set."""
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_extra = 1.0 / pos_freqs
    if yarn is None:
        return inv_extra.astype(np.float32)
    inv_inter = inv_extra / yarn.factor
    low, high = yarn_correction_range(yarn, dim, base)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extra_mask = 1.0 - ramp
    return (inv_inter * (1.0 - extra_mask) + inv_extra * extra_mask).astype(np.float32)


def cos_sin_multiplier(yarn: YarnRope | None) -> float:
    """YaRN's factor on cos/sin (1.0 for Kimi, whose mscale == mscale_all_dim)."""
    if yarn is None:
        return 1.0
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return yarn_mscale(yarn.factor)


def target_rope_tables(cfg: TextConfig) -> tuple[np.ndarray, float]:
    return inv_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling), cos_sin_multiplier(cfg.rope_scaling)


def cos_sin(positions_BT: jnp.ndarray, inv_freq_F: np.ndarray, multiplier: float = 1.0):
    """cos, sin [B, T, F] in float32 for integer positions."""
    angles_BTF = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_F)
    return jnp.cos(angles_BTF) * multiplier, jnp.sin(angles_BTF) * multiplier


def apply_interleaved(x_BTNR: jnp.ndarray, cos_BTF: jnp.ndarray, sin_BTF: jnp.ndarray) -> jnp.ndarray:
    """Rotate pairs (x[2i], x[2i+1]) by angle i (DeepSeek / Kimi layout); output keeps the pair layout."""
    dtype = x_BTNR.dtype
    x = x_BTNR.astype(jnp.float32)
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos_BTF[:, :, None, :], sin_BTF[:, :, None, :]
    rot_even = x_even * cos - x_odd * sin
    rot_odd = x_odd * cos + x_even * sin
    return jnp.stack([rot_even, rot_odd], axis=-1).reshape(x.shape).astype(dtype)


def apply_neox(x_BTND: jnp.ndarray, cos_BTF: jnp.ndarray, sin_BTF: jnp.ndarray) -> jnp.ndarray:
    """Llama / NeoX rope: rotate (x[i], x[i + D/2]) by angle i."""
    dtype = x_BTND.dtype
    x = x_BTND.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos_BTF[:, :, None, :], sin_BTF[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(dtype)
