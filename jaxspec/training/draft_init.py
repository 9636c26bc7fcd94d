"""Initial draft weights for training: model.init's layout in float32, the draft's lm_head started
from the target's lm_head rows of the draft vocabulary (the draft first predicts what the target would)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from model.decoder import KimiWeights
from model.eagle3 import DraftConfig, DraftWeights
from model.init import init_draft_weights


def init_draft_for_training(cfg: DraftConfig, target_w: KimiWeights, draft_ids: np.ndarray, key) -> DraftWeights:
    """d2t stays None while training (integers take no gradient); the target's embeddings are shared."""
    w = init_draft_weights(cfg, key, jnp.float32, d2t=np.zeros(len(draft_ids), np.int32))
    ones = lambda x: jnp.ones_like(x)  # noqa: E731
    return w.replace(
        input_norm=ones(w.input_norm),
        hidden_norm=ones(w.hidden_norm),
        post_attention_norm=ones(w.post_attention_norm),
        final_norm=ones(w.final_norm),
        o_proj=w.o_proj * 0.5 ** 0.5,
        mlp=w.mlp.replace(down=w.mlp.down * 0.5 ** 0.5),
        lm_head=jnp.asarray(target_w.lm_head, jnp.float32)[jnp.asarray(draft_ids)],
        d2t=None,
    )
