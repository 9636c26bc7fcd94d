"""bench.labs.engine_call_timeline replays each engine's decode: its fixed, by-call and split-call paths make the
tokens `Engine.generate` makes, in one call at K, and their phases add up to the time they report."""

import pytest

from bench.labs.engine_call_timeline import calls_decode, fixed_decode, parts_decode
from jaxspec.adaptive_calls import PerCallPolicy
from jaxspec.engine import Engine
from tests.speculative_cases import MAX_NEW, PROMPTS_3, pair  # noqa: F401 (fixtures)


def test_the_replayed_decodes_make_the_engines_tokens_and_their_phases_add_up(pair):  # noqa: F811
    cfg, w = pair
    fixed = Engine(cfg, w, num_steps=3)
    calls = Engine(cfg, w, num_steps=3, adaptive=PerCallPolicy(steps=(3,)))
    prompt = PROMPTS_3[0]
    want = fixed.generate([prompt], MAX_NEW).tokens[0]
    assert calls.generate([prompt], MAX_NEW).tokens[0] == want  # also measures the by-call cost table
    runs = [fixed_decode(fixed, prompt, MAX_NEW, wait) for wait in (False, True)]
    runs += [calls_decode(calls, prompt, MAX_NEW, wait) for wait in (False, True)]
    runs += [parts_decode(fixed, prompt, MAX_NEW, False), parts_decode(calls, prompt, MAX_NEW, True)]
    for got in runs:
        assert got["tokens"] == want
        assert got["dispatch"] + got["device"] + got["after"] == pytest.approx(got["total"], abs=1e-9)
        assert min(got[k] for k in ("dispatch", "device", "after")) >= 0.0
    for got in runs[-2:]:
        assert got["read"] + got["tests"] + got["drop"] == pytest.approx(got["after"], abs=1e-9)
