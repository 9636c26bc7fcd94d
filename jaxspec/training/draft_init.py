"""Initial draft weights for training, in model.init's layout (float32, numpy RNG): norms 1, matrices
N(0, 1/fan_in), the projections into the residual stream scaled by 1/sqrt(2), and the lm_head started
from the target's lm_head rows of the draft vocabulary (so the draft first predicts what the target would)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from model.decoder import KimiWeights
from model.eagle3 import DraftConfig, DraftWeights
from model.init import init_draft_weights


def init_draft_for_training(cfg: DraftConfig, target_w: KimiWeights, draft_ids: np.ndarray, seed: int) -> DraftWeights:
    """d2t stays None while training (integers take no gradient); the target's embeddings are shared."""
    layout = jax.eval_shape(
        lambda: init_draft_weights(cfg, jax.random.PRNGKey(0), jnp.float32, d2t=np.zeros(len(draft_ids), np.int32))
    ).replace(d2t=None)
    rng = np.random.default_rng(seed)

    def one(path, leaf):
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        if len(leaf.shape) == 1:
            return jnp.ones(leaf.shape, leaf.dtype)
        std = leaf.shape[-1] ** -0.5 * (0.5**0.5 if name in ("o_proj", "mlp.down") else 1.0)
        return jnp.asarray(rng.standard_normal(leaf.shape, np.float32) * std)

    w = jax.tree_util.tree_map_with_path(one, layout)
    return w.replace(lm_head=jnp.asarray(np.asarray(target_w.lm_head, np.float32)[draft_ids]))
