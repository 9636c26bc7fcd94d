"""Mixed precision: float32 master weights, bf16 compute copies (routers stay float32, as the router does)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _keeps_float32(path) -> bool:
    # noaux_tc routes in float32 and its correction bias is float32 on disk
    return "router" in jax.tree_util.keystr(path)


def compute_copy(tree, dtype=jnp.bfloat16):
    """Floating leaves cast to `dtype`, except router weights and biases; integer leaves untouched."""

    def cast(path, x):
        if not jnp.issubdtype(x.dtype, jnp.floating) or _keeps_float32(path):
            return x
        return x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, tree)


def weight_decay_mask(tree):
    """Decay matrices only: no norms, no router bias (which no gradient ever reaches)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.ndim >= 2 and "router_bias" not in jax.tree_util.keystr(path), tree
    )
