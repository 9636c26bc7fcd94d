"""The target + draft pair the engine runs: static configs beside traced weights."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from model.config import ConfigError, TextConfig
from model.decoder import KimiWeights
from model.eagle3 import DraftConfig, DraftWeights


@struct.dataclass
class SpecWeights:
    target: KimiWeights
    draft: DraftWeights | None


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    target: TextConfig
    draft: DraftConfig | None
    eos_ids: tuple[int, ...] = ()

    @property
    def draft_vocab(self) -> int:
        return self.draft.draft_vocab_size


def check_draft_fits(cfg: TextConfig, dcfg: DraftConfig, dw: DraftWeights | None = None) -> TextConfig:
    """Raise ConfigError naming what does not match; returns the target config with the draft's aux layers."""
    if dcfg.vocab_size != cfg.vocab_size:
        raise ConfigError(f"draft vocab_size {dcfg.vocab_size} != target vocab_size {cfg.vocab_size}")
    if (dcfg.target_hidden_size or dcfg.hidden_size) != cfg.hidden_size:
        raise ConfigError(f"draft hidden size {dcfg.target_hidden_size or dcfg.hidden_size} != target hidden_size {cfg.hidden_size}")
    aux = dcfg.aux_layer_ids if dcfg.aux_layer_ids is not None else cfg.eagle_aux_layers
    if len(set(aux)) != len(aux):  # the target emits one state per distinct layer; the drafter's fc expects them all
        raise ConfigError(f"draft aux layers {list(aux)} repeat a layer (need {dcfg.aux_count} distinct ids)")
    if len(aux) != dcfg.aux_count or not all(0 <= i < cfg.num_hidden_layers for i in aux):
        raise ConfigError(
            f"draft aux layers {list(aux)} do not fit a target of {cfg.num_hidden_layers} layers "
            f"(need {dcfg.aux_count} distinct ids in range)"
        )
    if dw is not None and dw.lm_head is None and dcfg.draft_vocab_size != cfg.vocab_size:
        raise ConfigError("draft has no lm_head but a reduced draft_vocab_size")
    return cfg.replace(aux_layer_ids=tuple(sorted(aux)))


def cast_floats(tree, dtype):
    """Cast floating arrays (not router / packed ints / fp8 / d2t) to the activation dtype."""
    def one(path, x):
        name = ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)
        if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize == 1:
            return x
        if name.endswith(("router", "router_bias", "scale", "scale_inv")):
            return x
        return x.astype(dtype)

    return jax.tree_util.tree_map_with_path(one, tree)
