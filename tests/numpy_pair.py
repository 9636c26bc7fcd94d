"""tests.tiny_models.tiny_pair's configs with weights filled by `tests.sharded_pair.numpy_like` (generic draws of
each leaf's shape and dtype). tiny_pair itself now draws with numpy through model.init, so both build in
milliseconds with nothing to compile; they differ only in the values drawn, and the tests written against this
one's values keep them (moving them to tiny_pair would change every case's data at once)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import SpecConfig, SpecWeights
from model.init import init_draft_weights, init_kimi_weights
from tests.sharded_pair import numpy_like
from tests.tiny_models import tiny_draft_config, tiny_target_config


def numpy_target(cfg, seed: int, logit_scale: float = 1.0):
    """Random float32 target weights for `cfg` (lm_head scaled by `logit_scale`)."""
    abstract = jax.eval_shape(lambda key: init_kimi_weights(cfg, key, jnp.float32), jax.random.key(0))
    return numpy_like(abstract, seed, logit_scale)


def numpy_draft(dcfg, seed: int, d2t=None):
    """Random float32 draft weights for `dcfg` (`d2t`: a reduced vocabulary's offsets, as init_draft_weights)."""
    abstract = jax.eval_shape(lambda key: init_draft_weights(dcfg, key, jnp.float32, d2t=d2t), jax.random.key(0))
    draft = numpy_like(abstract, seed, logit_scale=1.0)
    return draft if d2t is None else draft.replace(d2t=jnp.asarray(d2t, jnp.int32))


def numpy_tiny_pair(seed: int = 0, vocab: int = 64, draft_vocab: int | None = None, eos=(), logit_scale: float = 1.0,
                    **target_kw):
    """tiny_pair's signature (float32 only): a random target and a random draft; a reduced draft vocabulary maps to
    `draft_vocab` target ids chosen by the seed."""
    cfg = tiny_target_config(vocab, eos_token_id=tuple(eos), **target_kw)
    dcfg = tiny_draft_config(cfg, draft_vocab)
    d2t = None
    if draft_vocab:
        chosen = np.sort(np.random.default_rng(seed).choice(vocab, draft_vocab, replace=False))
        d2t = chosen - np.arange(draft_vocab)
    return SpecConfig(cfg, dcfg, tuple(eos)), SpecWeights(numpy_target(cfg, seed, logit_scale),
                                                          numpy_draft(dcfg, seed + 1, d2t))
