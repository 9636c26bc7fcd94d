"""Quantized weight containers (INT4 pack-quantized, FP8 block) and their plain dequantization.

Both keep Hugging Face's [out, in] layout, with any leading axes (experts stacked as [E, out, in]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

Weight = jax.Array  # a dense [.., out, in] matrix, or one of the containers below


@struct.dataclass
class Int4Weight:
    """compressed-tensors pack-quantized: eight signed nibbles (stored as q + 8) per uint32 word."""

    packed: jax.Array  # [.., out, in // 8] uint32; element c in bits [4*(c%8), 4*(c%8)+4) of word c//8
    scale: jax.Array  # [.., out, in // group] (bf16 / f32); no zero point

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 8)

    @property
    def group_size(self) -> int:
        return self.shape[-1] // self.scale.shape[-1]

    def __getitem__(self, idx) -> "Int4Weight":
        return Int4Weight(self.packed[idx], self.scale[idx])


@struct.dataclass
class Fp8Weight:
    """FP8 e4m3 with one float32 scale per [block_out, block_in] block (DeepSeek-V3 / K2-Instruct)."""

    weight: jax.Array  # [.., out, in] float8_e4m3fn
    scale_inv: jax.Array  # [.., ceil(out/bo), ceil(in/bi)] float32
    # stated, not derived from the scale grid: a partial last block makes ceil(out / rows) wrong
    block_size: tuple[int, int] = struct.field(pytree_node=False, default=(128, 128))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def __getitem__(self, idx) -> "Fp8Weight":
        return Fp8Weight(self.weight[idx], self.scale_inv[idx], self.block_size)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """[.., out, in/8] uint32 words -> [.., out, in] int8 values in [-8, 7]."""
    words = packed.astype(jnp.uint32)
    shifts = jnp.arange(8, dtype=jnp.uint32) * 4
    nibbles = (words[..., None] >> shifts) & jnp.uint32(0xF)
    q = nibbles.astype(jnp.int8) - jnp.int8(8)
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Inverse of `unpack_int4` for numpy int values in [-8, 7]: [.., out, in] -> [.., out, in/8] uint32."""
    q = np.asarray(q)
    if q.shape[-1] % 8:
        raise ValueError(f"int4 packing needs the input dim divisible by 8, got {q.shape}")
    if q.min(initial=0) < -8 or q.max(initial=0) > 7:
        raise ValueError("int4 values must lie in [-8, 7]")
    nib = (q.astype(np.int64) + 8).astype(np.uint32).reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    shifts = (np.arange(8, dtype=np.uint32) * 4)
    return np.bitwise_or.reduce(nib << shifts, axis=-1).astype(np.uint32)


def dequantize(w: Weight, dtype=jnp.bfloat16) -> jax.Array:
    """Any weight container -> dense [.., out, in] in `dtype` (plain XLA; the reference for kernels)."""
    if isinstance(w, Int4Weight):
        q = unpack_int4(w.packed).astype(jnp.float32)
        g = w.group_size
        q = q.reshape(*q.shape[:-1], q.shape[-1] // g, g)
        return (q * w.scale.astype(jnp.float32)[..., None]).reshape(w.shape).astype(dtype)
    if isinstance(w, Fp8Weight):
        out, inp = w.weight.shape[-2:]
        bo, bi = w.block_size
        s = jnp.repeat(jnp.repeat(w.scale_inv.astype(jnp.float32), bo, axis=-2), bi, axis=-1)
        return (w.weight.astype(jnp.float32) * s[..., :out, :inp]).astype(dtype)
    return w.astype(dtype)


def linear(x: jax.Array, w: Weight) -> jax.Array:
    """x[..., in] @ w[out, in].T in x's dtype."""
    return jnp.einsum("...i,oi->...o", x, dequantize(w, x.dtype))
