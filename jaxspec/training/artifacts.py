"""A trained model on disk as training writes it: `config.json` (HF) + flat .npz shards of the weights.

This is the form that travels back from a device run; `jaxspec.training.export` turns it into the
engine's checkpoint format (convert/checkpoint.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.training.flat_io import load_flat, save_flat
from model.config import TextConfig, text_config_from_dict
from model.decoder import KimiWeights
from model.eagle3 import DraftConfig, DraftWeights, draft_config_from_dict
from model.init import init_draft_weights, init_kimi_weights

WEIGHTS = "weights"


def save_model_dir(directory: str | Path, config: dict, weights) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_flat(directory, WEIGHTS, jax.device_get(weights))
    # config.json last: it marks a finished directory (the loaders read it first, train_default_pair.sh tests for it),
    # so a save cut short leaves weights without one rather than a config that passes for a model
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def read_config(directory: str | Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


def target_template(cfg: TextConfig, dtype=jnp.bfloat16) -> KimiWeights:
    experts = "int4" if cfg.quant is not None and cfg.quant.method == "int4" else "bf16"
    return jax.eval_shape(lambda: init_kimi_weights(cfg, jax.random.PRNGKey(0), dtype, experts=experts))


def draft_template(cfg: DraftConfig, dtype=jnp.bfloat16) -> DraftWeights:
    d2t = np.zeros(cfg.draft_vocab_size, np.int32) if cfg.draft_vocab_size != cfg.vocab_size else None
    return jax.eval_shape(lambda: init_draft_weights(cfg, jax.random.PRNGKey(0), dtype, d2t=d2t))


def load_target_dir(directory: str | Path) -> tuple[TextConfig, KimiWeights]:
    cfg = text_config_from_dict(read_config(directory), str(directory))
    return cfg, load_flat(directory, WEIGHTS, target_template(cfg))


def load_draft_dir(directory: str | Path) -> tuple[DraftConfig, DraftWeights]:
    cfg = draft_config_from_dict(read_config(directory), str(directory))
    return cfg, load_flat(directory, WEIGHTS, draft_template(cfg))
