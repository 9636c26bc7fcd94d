"""The tiny pair, prompts and greedy baseline of test_speculative.py and test_speculative_limits.py (two files so
that `--dist loadfile` can run them on different workers; with the run's persistent compilation cache the second
build of the pair and the baseline is cheap). Both modules import the fixtures; each module builds its own."""

import pytest

from jaxspec.engine import Engine
from tests.tiny_models import tiny_pair

PROMPTS_3 = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56]]
MAX_NEW = 24


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=0, logit_scale=3.0)


@pytest.fixture(scope="module")
def baseline_tokens(pair):
    cfg, w = pair
    return Engine(cfg, w, num_steps=1).generate(PROMPTS_3, MAX_NEW, speculative=False).tokens
