"""The tiny pair, batch, sampling settings, baseline and statistics shared by test_sampling_losslessness.py and
test_sampling_broken_rules.py (two files so that `--dist loadfile` runs them on different workers; with the run's
persistent compilation cache the second build of the baseline programs is cheap)."""

import jax
import numpy as np
import pytest

from jaxspec.engine import Engine
from jaxspec.sampling import SamplingParams
from tests.sampling_stats import homogeneity, log10_p_value
from tests.numpy_pair import numpy_tiny_pair

VOCAB = 8
# two dense layers: the statistics need many rows, not a deep model; compile time is what the suite pays for
PAIR_KW = dict(vocab=VOCAB, logit_scale=2.0, num_hidden_layers=2, first_k_dense_replace=2, aux_layer_ids=(0, 1),
               hidden_size=16, intermediate_size=16)
PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 1, 2, 3, 4, 5, 6]]
ROWS_PER_PROMPT = 300  # the weakest broken-rule rejection is still far past the threshold
BATCH = [p for p in PROMPTS for _ in range(ROWS_PER_PROMPT)]
MAX_NEW = 2 * 4 + 2  # the baseline covers the longest run (K = 4)
LOG10_FAMILY_ALPHA = -3
SAMPLINGS = {"t1": SamplingParams(1.0), "t0.7_p0.9": SamplingParams(0.7, top_p=0.9),
             "top_k5": SamplingParams(1.0, top_k=5)}


def log10_p_values(spec_BN: np.ndarray, base_BN: np.ndarray) -> dict[str, float]:
    """log10 p per position and per adjacent pair over the first N tokens, strata = prompts."""
    n = spec_BN.shape[1]
    strata = [slice(i * ROWS_PER_PROMPT, (i + 1) * ROWS_PER_PROMPT) for i in range(len(PROMPTS))]
    out = {}
    counts = lambda ids, cells: np.bincount(ids, minlength=cells)  # noqa: E731
    for j in range(n):
        out[f"token {j}"] = log10_p_value(
            [homogeneity(counts(spec_BN[s, j], VOCAB), counts(base_BN[s, j], VOCAB)) for s in strata])
    for j in range(n - 1):
        pair_id = lambda t: t[:, j] * VOCAB + t[:, j + 1]  # noqa: E731
        out[f"tokens {j},{j + 1}"] = log10_p_value(
            [homogeneity(counts(pair_id(spec_BN[s]), VOCAB**2), counts(pair_id(base_BN[s]), VOCAB**2)) for s in strata])
    return out


def bonferroni_threshold(checks: int) -> float:
    return LOG10_FAMILY_ALPHA - np.log10(checks)


def tokens_of(res) -> np.ndarray:
    assert all(len(t) == len(res.tokens[0]) for t in res.tokens)
    return np.asarray(res.tokens, np.int64)


@pytest.fixture(scope="module")
def pair():
    """A tiny pair whose weights numpy draws (their values do not matter here, and nothing compiles to draw them)."""
    return numpy_tiny_pair(seed=3, **PAIR_KW)


@pytest.fixture(scope="module")
def reduced_vocab_pair(pair):
    cfg, w = numpy_tiny_pair(seed=3, draft_vocab=5, **PAIR_KW)
    # the same target as `pair` (numpy_tiny_pair derives it from the seed alone), so `pair`'s baseline serves both
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(w.target), jax.tree.leaves(pair[1].target)))
    return cfg, w


@pytest.fixture(scope="module")
def baseline(pair):
    cfg, w = pair
    eng = Engine(cfg, w, num_steps=1)
    return {name: tokens_of(eng.generate(BATCH, MAX_NEW, sampling=s, seed=100, speculative=False))
            for name, s in SAMPLINGS.items()}
