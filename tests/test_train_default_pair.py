"""The shipped default pair (jaxspec/default_model) through the real engine on CPU.

Greedy speculative decoding must emit exactly the baseline's tokens (float32, so no bf16 near-tie can
flip an argmax between the verify and decode shapes), and its mean acceptance length at K=4 must stay
above a floor. The floor: bench/results/default_model.md measures 3.35 (float32, 64 held-out prompts x
128 tokens) and 3.44 with this test's 8 prompts; 4-prompt x 48-token subsets gave 2.78-3.82; an untrained draft
gives ~1.1. 2.5 sits under every subset seen and far above a broken draft.
"""

from pathlib import Path

import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec.engine import Engine
from jaxspec.training.corpus import read_sources, split_sources
from jaxspec.training.engine_eval import load_pair
from jaxspec.training.tokenizer import encode_file_list
from jaxspec.training.windows import file_prompts

MODEL = Path(jaxspec.__file__).parent / "default_model"
ACCEPTANCE_FLOOR = 2.5


def test_default_pair_is_lossless_and_accepts_drafts():
    cfg, weights, tok = load_pair(MODEL, jnp.float32)
    _, held_out, _ = split_sources(read_sources(), held_out_percent=5.0)
    prompts = file_prompts(encode_file_list(tok, held_out), 8, 64, np.random.default_rng(0)).tolist()
    engine = Engine(cfg, weights, num_steps=4)
    spec = engine.generate(prompts, 48)
    base = engine.generate(prompts, 48, speculative=False)
    assert spec.tokens == base.tokens
    assert spec.stats.mean_acceptance_length >= ACCEPTANCE_FLOOR, spec.stats.mean_acceptance_length
