"""Integer index arithmetic for the Pallas (Triton) kernels.

lax.div / lax.rem truncate, which equals floor division for the non-negative indices the kernels use; jnp's
floor division emits sign fix-ups that Triton's lowering rejects.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def div(a, b: int):
    return jax.lax.div(a, jnp.int32(b))


def rem(a, b: int):
    return jax.lax.rem(a, jnp.int32(b))


def even_splits(n: int, requested: int) -> tuple[int, int]:
    """n items (slots, cache blocks) shared by at most `requested` programs -> (programs, items per program)."""
    splits = max(1, min(requested, n))
    return splits, -(-n // splits)
