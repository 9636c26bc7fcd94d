"""Initial target weights for training: model.init's layout in float32, rescaled for a stable start."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.config import TextConfig
from model.decoder import KimiWeights
from model.init import init_kimi_weights
from model.mlp import MLPWeights
from model.moe import MoEWeights


def _scale_down(mlp: MLPWeights, s: float) -> MLPWeights:
    return mlp.replace(down=mlp.down * s)


def init_target_for_training(cfg: TextConfig, key) -> KimiWeights:
    """Norm weights 1, router biases 0, and every projection that writes into the residual stream scaled
    by 1/sqrt(2 * layers) (GPT-2's rule) so the stream does not grow with depth at initialization."""
    w = init_kimi_weights(cfg, key, jnp.float32, experts="bf16")
    s = (2.0 * cfg.num_hidden_layers) ** -0.5
    ones = lambda x: jnp.ones_like(x)  # noqa: E731
    layers = []
    for lw in w.layers:
        attn = lw.attn.replace(o_proj=lw.attn.o_proj * s, q_a_norm=ones(lw.attn.q_a_norm), kv_a_norm=ones(lw.attn.kv_a_norm))
        if isinstance(lw.mlp, MoEWeights):
            m = lw.mlp
            mlp = m.replace(
                router_bias=jnp.zeros_like(m.router_bias),
                experts=m.experts.replace(down=m.experts.down * s),
                shared=None if m.shared is None else _scale_down(m.shared, s),
            )
        else:
            mlp = _scale_down(lw.mlp, s)
        layers.append(lw.replace(input_norm=ones(lw.input_norm), post_attention_norm=ones(lw.post_attention_norm),
                                 attn=attn, mlp=mlp))
    return w.replace(layers=tuple(layers), final_norm=ones(w.final_norm))


def count_params(tree) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(tree))
