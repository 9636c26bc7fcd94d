"""The routing weights of the chosen experts: shared by the XLA router and the top-k kernel's gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def chosen_weights(scores_TE: jax.Array, ids_TK: jax.Array, norm_topk_prob: bool, scaling: float) -> jax.Array:
    """The unbiased routing weights of the chosen experts (normalised, scaled): [T, K] float32."""
    weights_TK = jnp.take_along_axis(scores_TE, ids_TK, axis=1)
    if norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(-1, keepdims=True) + 1e-20)
    return weights_TK * scaling
