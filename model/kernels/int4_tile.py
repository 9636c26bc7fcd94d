"""In-register INT4 dequantization used inside the Pallas kernels (also runs in interpret mode on CPU).

A packed word holds eight values of one row: element 8*w + j sits in bits [4j, 4j+4) of word w as q + 8.
The kernels never interleave the eight nibbles back into row order (a costly shuffle on the GPU); they
take nibble j of every word as a "part" and dot it with the inputs 8*w + j, which the wrapper lays out
in the same j-major order beforehand.

Nibble -> float in 1.5 integer instructions per value: four shifted copies of each word (w << 15, w << 7,
w >> 1, w >> 9) put every nibble at mantissa bits [15, 19) (even j) or [19, 23) (odd j); one and/or (one
LOP3, model.kernels.triton_ops.and_or) sets the exponent so the bits read as the float 256 + n or 16 + n exactly
(n = q + 8), i.e. q + nibble_offset(j). No int -> float conversion (a slow instruction on the GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.kernels.triton_ops import and_or

# nibble j of a word is moved to mantissa bits [15, 19) (even j) or [19, 23) (odd j) by one of these shifts
_SOURCE_SHIFT = (15, 15, 7, 7, -1, -1, -9, -9)
# (mask, exponent bits, offset): the float 256.0 / 16.0 with the nibble as its mantissa's unit digits
_EVEN = (0x00078000, 0x43800000, 264.0)
_ODD = (0x00780000, 0x41800000, 24.0)


def nibble_offset(j: int) -> float:
    return _ODD[2] if j % 2 else _EVEN[2]


def shifted_words(words: jax.Array) -> dict[int, jax.Array]:
    return {k: words << jnp.uint32(k) if k > 0 else words >> jnp.uint32(-k) for k in sorted(set(_SOURCE_SHIFT))}


def nibble_float(shifted: dict[int, jax.Array], j: int, ptx: bool = False) -> jax.Array:
    """float32 q_j + nibble_offset(j), exactly, from `shifted_words` of uint32 words."""
    mask, bits, _ = _ODD if j % 2 else _EVEN
    return jax.lax.bitcast_convert_type(and_or(shifted[_SOURCE_SHIFT[j]], mask, bits, ptx), jnp.float32)


def nibble_offsets_OTW(v_OTW: jax.Array) -> jax.Array:
    """sum_j nibble_offset(j) * v[j]: what the nibble floats add to a word's dot product, per (token, word).

    Plain XLA, before the kernels: computed inside them instead, x is read strided and the kernels ran slower.
    Written as a weighted sum, not an einsum, so XLA fuses it into one elementwise pass instead of calling a
    GEMM."""
    v = v_OTW.astype(jnp.float32)
    return sum(nibble_offset(j) * v[j] for j in range(v.shape[0]))


def repeat_last(x: jax.Array, times: int) -> jax.Array:
    """[.., n] -> [.., n * times], each element repeated `times` times in place (times a power of two).

    Built from pairwise stacks (Triton `join`), which keep the copies in the same thread's registers."""
    while times > 1:
        x = jnp.stack([x, x], axis=-1).reshape(*x.shape[:-1], x.shape[-1] * 2)
        times //= 2
    return x
