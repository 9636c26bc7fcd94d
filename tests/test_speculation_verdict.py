"""The speculation verdict (jaxspec.speculation_verdict): one line, with the run's figures, where speculation did not
pay. Through `python -m jaxspec.generate`: a drafter that never matches is switched off by the adaptive rule after its
first run of K (the cycles a choice runs before the rule may leave it) and the line says so, in the text and in
--json; a drafter that always matches gets no such line. The verdict's own cases on made-up runs."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from convert.checkpoint import save_draft, save_target
from jaxspec.adaptive import AdaptivePolicy, expected_tokens
from jaxspec.adaptive_calls import PerCallPolicy
from jaxspec.defaults import default_adaptive_kind
from jaxspec.engine import AdaptiveReport, Engine
from jaxspec.generate import JSON_SCHEMA, _print_stats
from jaxspec.generate import main as generate_main
from jaxspec.speculation_verdict import (adaptive_verdict, expected_tokens_per_cycle, fixed_verdict, position_counts,
                                         speculation_verdict)
from tests.kimi_tokenizer_fixture import write_kimi_tokenizer
from tests.numpy_pair import numpy_tiny_pair
from tests.switched_drafter import looped_oracle_drafter

# K = 2 first (at the prior 0.7 it expects 2.19 tokens for 1.5 plain steps), plain steps once the first draft's
# estimate falls below 0.3: K = 1 would then yield less than its 1.3 steps, and K = 2 less than its 1.5
COSTS_MS = {"0": 1.0, "1": 1.3, "2": 1.5}
MAX_NEW = 24
# the cycles `generate`'s first choice runs before the rule may leave it, for the adaptive kind it runs on a CPU
STRETCH = PerCallPolicy().min_cycles if default_adaptive_kind("cpu") == "per_call" else AdaptivePolicy().stretch
NEVER = 0  # the token the never-matching drafter always proposes


@pytest.fixture(scope="module")
def never_matching(tmp_path_factory):
    """A tiny random target that never emits token 0 (its lm_head row is zero: a logit of 0 against random ones,
    the largest of which is positive) beside an EAGLE-3 drafter whose final norm is zero: all its logits are 0, so
    its argmax, its every draft, is token 0."""
    root = tmp_path_factory.mktemp("verdict")
    vocab = write_kimi_tokenizer(root / "tok")
    cfg, w = numpy_tiny_pair(seed=4, vocab=vocab, logit_scale=3.0)
    save_target(root / "model", w.target.replace(lm_head=w.target.lm_head.at[NEVER].set(0.0)), cfg.target,
                tokenizer_dir=root / "tok")
    save_draft(root / "model" / "draft", w.draft.replace(final_norm=jnp.zeros_like(w.draft.final_norm)), cfg.draft)
    return root / "model"


def generate_json(capsys, model, *args) -> dict:
    capsys.readouterr()
    code = generate_main(["--model", str(model), "--prompt", "def the thing", "--max-new-tokens", str(MAX_NEW),
                          "--json", *map(str, args)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_adaptive_switches_a_never_matching_drafter_off_and_says_why(never_matching, capsys):
    doc = generate_json(capsys, never_matching, "--speculative-num-steps", 2, "--speculative-adaptive-costs",
                        json.dumps(COSTS_MS))
    assert NEVER not in doc["results"][0]["tokens"]  # so no draft can be accepted
    ks = doc["adaptive"]["k_per_cycle"]
    off = ks.index(0)
    assert off == STRETCH and ks[:off] == [2] * STRETCH and set(ks[off:]) == {0}  # off after the first run
    v = doc["speculation"]
    assert v["paid"] is False
    f = v["figures"]
    assert (f["cycles"], f["plain_cycles"], f["first_drafts"], f["first_drafts_accepted"]) == (
        len(ks), len(ks) - STRETCH, STRETCH, 0)
    assert f["per_position_acceptance"] == [0.0, None]  # rejected at the first draft: the second never observed
    assert f["cost_in_plain_steps"] == pytest.approx({"0": 1.0, "1": 1.3, "2": 1.5})
    c1 = f["estimate"][0]
    assert 0.0 < c1 < 0.3  # shrunk towards the prior, the rejections outweighing it
    assert f["expected_tokens_per_cycle"]["1"] == pytest.approx(1 + c1)
    assert v["reason"] == (
        f"speculation off for {len(ks) - STRETCH} of {len(ks)} cycles: the drafter's first draft was accepted 0 of "
        f"the {STRETCH} times it was drafted (0%; per-position acceptance 0.00; the rule's estimate at the end "
        f"c_1..c_2 = {c1:.2f} {f['estimate'][1]:.2f}); a K=1 cycle costs 1.30 plain steps for {1 + c1:.2f} expected "
        f"tokens (K=0, 1, 2: cost in plain steps 1.00 1.30 1.50, expected tokens per cycle 1.00 {1 + c1:.2f} "
        f"{f['expected_tokens_per_cycle']['2']:.2f}): speculating would not pay")
    assert set(v) == set(JSON_SCHEMA["speculation"])
    _print_stats(doc, 2)  # the text report prints the same line with the other statistics
    assert v["reason"] in capsys.readouterr().err.splitlines()


def test_a_never_matching_drafter_is_never_said_to_pay(never_matching, capsys):
    """A K = 1 cycle at 1.05 plain steps: whether the rule keeps drafting (its estimate of c_1, shrunk towards the
    prior, keeps E[tokens | 1] above 1.05) or switches off after all, the verdict goes by what the drafted cycles
    accepted and never says speculation paid."""
    costs = {"0": 1.0, "1": 1.05, "2": 1.10}  # data in the state: the first test's program runs
    doc = generate_json(capsys, never_matching, "--speculative-num-steps", 2, "--speculative-adaptive-costs",
                        json.dumps(costs))
    v, ks = doc["speculation"], doc["adaptive"]["k_per_cycle"]
    assert v["paid"] is False and v["figures"]["first_drafts_accepted"] == 0
    if ks[-1] == 0:  # a rule that switches it off after all
        assert v["reason"].startswith("speculation off for ")
    else:
        assert v["reason"].startswith(f"speculation did not pay: the drafter's first draft was accepted 0 of the "
                                      f"{len(ks) - ks.count(0)} times it was drafted")
        assert "a K=1 cycle that costs 1.05 plain steps" in v["reason"]


def test_fixed_k_says_no_draft_was_accepted(never_matching, capsys):
    doc = generate_json(capsys, never_matching, "--speculative-num-steps", 1, "--no-speculative-adaptive")
    cycles = doc["timings"]["cycles"]
    assert doc["acceptance"]["mean_acceptance_length"] == 1.0 and cycles == MAX_NEW - 1
    assert doc["speculation"]["paid"] is False
    assert doc["speculation"]["reason"].startswith(
        f"speculation did not pay: no draft was accepted in {cycles} cycles (mean acceptance length 1.00 at K=1)")


def test_an_always_matching_drafter_gets_no_off_verdict():
    cfg, w = numpy_tiny_pair(seed=4, logit_scale=3.0)
    policy = AdaptivePolicy(costs=tuple((int(k), ms / 1000) for k, ms in COSTS_MS.items()), probe=False)
    eng = Engine(cfg, w, num_steps=2, drafter=looped_oracle_drafter, adaptive=policy)
    res = eng.generate([[5, 6, 7]], MAX_NEW)
    assert set(res.adaptive.k_per_cycle) == {2} and res.stats.mean_acceptance_length > 2.5
    v = speculation_verdict(res, 2)
    assert v.paid is True and v.reason is None
    assert v.figures["expected_tokens_per_cycle"]["2"] > v.figures["cost_in_plain_steps"]["2"]


# --- the verdict on made-up runs ----------------------------------------------------------------------------

def report(ks, estimate, costs=(1.0, 1.3, 1.5), source="given", steps=(0, 1, 2)):
    return AdaptiveReport(steps, costs, source, 0.0, ks, 0.0, 0.0, acceptance_estimate=estimate)


def test_position_counts_are_conditional_on_the_drafts_before():
    # K = 2 accepting 2, 1, 0; K = 1 accepting 1; a plain step
    hits, trials = position_counts([[2, 1, 0, 1, 0]], [2, 2, 2, 1, 0])
    assert (hits, trials) == ([3, 1], [4, 2])
    assert position_counts([[3, 0], [1]], 3) == ([2, 1, 1], [3, 2, 1])


def test_expected_tokens_per_cycle_is_the_rules():
    c = [0.9, 0.5, 0.25]
    rule = np.asarray(expected_tokens(jnp.asarray([c]), (0, 1, 2, 3)))[0]
    assert [expected_tokens_per_cycle(c, k) for k in range(4)] == pytest.approx(rule.tolist())
    assert expected_tokens_per_cycle(c, 3) == pytest.approx(1 + 0.9 + 0.45 + 0.1125)


def test_adaptive_verdicts():
    low, high = [[0.1, 0.1]], [[0.9, 0.9]]
    off = adaptive_verdict(report([2, 2, 0, 0, 0], low), [[0, 0, 0, 0, 0]])
    assert off.paid is False and off.reason.startswith("speculation off for 3 of 5 cycles")
    assert "a K=1 cycle costs 1.30 plain steps for 1.10 expected tokens" in off.reason
    never = adaptive_verdict(report([0, 0, 0], low), [[0, 0, 0]])  # the cost table alone kept it plain
    assert never.paid is False and "no cycle drafted" in never.reason
    on = adaptive_verdict(report([0, 2, 2], high), [[0, 2, 2]])
    assert on.paid is True and on.reason is None
    # the run's end and the figures disagree: no verdict either way
    assert adaptive_verdict(report([2, 2, 2], low), [[0, 0, 0]]).paid is None
    assert adaptive_verdict(report([0, 0, 0], high), [[0, 0, 0]]).paid is None
    # no measured cost table (nothing was left to generate), or no plain step to compare with
    assert adaptive_verdict(report([0], low, source="none"), [[0]]).paid is None
    assert adaptive_verdict(report([1], low, costs=(1.0, 1.2), steps=(1, 2)), [[0]]).paid is None
    # a batch's throughput is its rows' sum: the mean row decides
    mixed = adaptive_verdict(report([2, 2], [[0.0, 0.0], [1.0, 1.0]]), [[0, 0], [2, 2]])
    assert mixed.figures["expected_tokens_per_cycle"]["2"] == pytest.approx(2.0) and mixed.paid is True
    # the rule kept drafting (its estimate stays above 0) though no draft was accepted
    kept = adaptive_verdict(report([1] * 8, [[0.08, 0.08]], costs=(1.0, 1.05, 1.1)), [[0] * 8])
    assert kept.paid is False and kept.reason.startswith(
        "speculation did not pay: the drafter's first draft was accepted 0 of the 8 times it was drafted")
    assert "expects 1.08 tokens from a K=1 cycle that costs 1.05 plain steps" in kept.reason
    # figures say it pays, --baseline measured it slower
    slower = adaptive_verdict(report([0, 2, 2], high), [[0, 2, 2]], baseline(0.8))
    assert slower.paid is False and slower.reason.startswith("speculation ran slower than plain decoding: "
                                                             "speedup 0.80x (0.70-0.90x over 3 rounds)")


def baseline(speedup, steps=20, decode_s=0.010, cycles=20, spec_s=0.025):
    return {"speedup": speedup, "speedup_min": speedup - 0.1, "speedup_max": speedup + 0.1, "rounds": 3,
            "decode_tokens_per_s": steps / decode_s, "decode_s": decode_s, "steps": steps,
            "speculative_cycles": cycles, "speculative_decode_s": spec_s}


def test_fixed_k_verdicts():
    zeros = [[0] * 20]
    slower = fixed_verdict(4, zeros, 20, baseline(0.4))
    assert slower.paid is False
    assert slower.reason == (
        "speculation ran slower than plain decoding: speedup 0.40x (0.30-0.50x over 3 rounds) at mean acceptance "
        "length 1.00; a K=4 cycle took 2.50 plain steps (1.250 ms per cycle against 0.500 ms per plain step, medians "
        "of the rounds): adaptive speculation (the default; drop --no-speculative-adaptive) chooses K and falls back to "
        "plain decoding where speculation does not pay")
    assert slower.figures["cycle_cost_in_plain_steps"] == pytest.approx(2.5)
    faster = fixed_verdict(4, [[3] * 20], 20, baseline(1.6))
    assert faster.paid is True and faster.reason is None and faster.figures["mean_acceptance_length"] == 4.0
    assert fixed_verdict(4, zeros, 20).paid is False  # nothing accepted in 20 cycles: no timing needed
    assert fixed_verdict(4, [[0] * 7], 7).paid is None  # too few cycles to say
    assert fixed_verdict(4, [[0] * 19 + [1]], 20).paid is None  # some accepted: only a baseline can tell
    assert fixed_verdict(4, [[]], 0).paid is None
