"""Integer index arithmetic inside the Pallas (Triton) kernels.

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
