"""In-register INT4 dequantization used inside the Pallas kernels (also runs in interpret mode on CPU).

A packed word holds eight values of one row: element 8*w + j sits in bits [4j, 4j+4) of word w as q + 8.
The kernels never interleave the eight nibbles back into row order (a costly shuffle on the GPU); they
take nibble j of every word as a "part" and dot it with the inputs 8*w + j, which the wrapper lays out
in the same j-major order beforehand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# 2**23 as float32 bits: OR-ing a nibble into the mantissa gives the float 2**23 + nibble exactly, which
# avoids an int -> float conversion per element (a slow instruction on the GPU).
_MAGIC_BITS = 0x4B000000
_MAGIC_MINUS_ZERO_POINT = 8388608.0 + 8.0


def nibble_values(words: jax.Array, j: int) -> jax.Array:
    """uint32 words [..] -> float32 (q - 8) of nibble j, exactly."""
    nibble = (words >> jnp.uint32(4 * j)) & jnp.uint32(0xF)
    as_float = jax.lax.bitcast_convert_type(nibble | jnp.uint32(_MAGIC_BITS), jnp.float32)
    return as_float - jnp.float32(_MAGIC_MINUS_ZERO_POINT)


def repeat_last(x: jax.Array, times: int) -> jax.Array:
    """[.., n] -> [.., n * times], each element repeated `times` times in place (times a power of two).

    Built from pairwise stacks (Triton `join`), which keep the copies in the same thread's registers."""
    while times > 1:
        x = jnp.stack([x, x], axis=-1).reshape(*x.shape[:-1], x.shape[-1] * 2)
        times //= 2
    return x


def dequant_part(words_RW: jax.Array, scale_words_RW: jax.Array, j: int, dtype) -> jax.Array:
    """Nibble j of each word times its group scale (both [R, W]) -> [R, W] in `dtype`."""
    return (nibble_values(words_RW, j) * scale_words_RW.astype(jnp.float32)).astype(dtype)
