"""Initial target weights for training, in model.init's exact pytree layout (float32, numpy RNG).

model.init.init_kimi_weights gives the layout (through `jax.eval_shape`, nothing is computed); the values
are drawn here with numpy, which takes milliseconds where compiling the jax.random calls takes seconds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from model.config import TextConfig
from model.decoder import KimiWeights
from model.init import init_kimi_weights


def _fan_in(name: str, shape) -> int:
    if name.endswith(".attn.o_proj"):  # [H, N, Dv]: contracts over heads and head dim
        return int(np.prod(shape[1:]))
    return int(shape[-1])  # [.., out, in]


def _writes_residual(name: str) -> bool:
    return name.endswith((".attn.o_proj", ".down"))


def init_target_for_training(cfg: TextConfig, seed: int) -> KimiWeights:
    """Norm weights 1, router biases 0, embeddings N(0, 1), other matrices N(0, 1/fan_in); every projection
    that writes into the residual stream is further scaled by 1/sqrt(2 * layers) (GPT-2's rule)."""
    layout = jax.eval_shape(lambda: init_kimi_weights(cfg, jax.random.PRNGKey(0), jnp.float32, experts="bf16"))
    rng = np.random.default_rng(seed)
    depth_scale = (2.0 * cfg.num_hidden_layers) ** -0.5

    def one(path, leaf):
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        if name.endswith("router_bias"):
            return jnp.zeros(leaf.shape, leaf.dtype)
        if len(leaf.shape) == 1:
            return jnp.ones(leaf.shape, leaf.dtype)
        std = 1.0 if name == "embed" else _fan_in(name, leaf.shape) ** -0.5
        if _writes_residual(name):
            std *= depth_scale
        return jnp.asarray(rng.standard_normal(leaf.shape, np.float32) * std, leaf.dtype)

    return jax.tree_util.tree_map_with_path(one, layout)


def count_params(tree) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(tree))
