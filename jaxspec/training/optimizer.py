"""AdamW (optax) after global-norm clipping, with the learning rate injected per step.

The schedule (warm-up + cosine) is evaluated on the host and passed into the jitted step, so its length
can be fixed after timing the first steps. `AdamWSpec` is hashable: jitted steps take it as a static
argument and rebuild the same transformation, so a second run in one process reuses the compilation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from jaxspec.training.casting import weight_decay_mask


@dataclasses.dataclass(frozen=True)
class AdamWSpec:
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.1
    clip_norm: float = 1.0

    def build(self, params) -> optax.GradientTransformation:
        adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
            learning_rate=0.0, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay, mask=weight_decay_mask(params)
        )
        return optax.chain(optax.clip_by_global_norm(self.clip_norm), adamw)


def global_norm(tree) -> jax.Array:
    """L2 norm over all leaves (written out: optax renamed its helper across versions)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree_util.tree_leaves(tree)))


def with_learning_rate(opt_state, lr):
    """The chain's state with AdamW's injected learning rate set for this step."""
    opt_state[1].hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
    return opt_state
