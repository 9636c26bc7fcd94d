"""bench.labs.choice_bias: the rule's estimate of another K's tokens a cycle from one K's log, the first draft's
acceptance after full and rejected cycles, and a tiny run on the embedded pair."""

import json

import pytest

from bench.labs.choice_bias import analyse, estimate_E, estimate_E_two_state, first_draft_after, main, summarise


def test_a_log_that_accepts_everything_predicts_every_k_near_its_full_length():
    e = estimate_E([3] * 200, k=3, k_max=4)
    assert e[:3] == pytest.approx([2.0, 3.0, 4.0], abs=0.03)
    assert e[3] == pytest.approx(5.0, abs=0.05)  # depth 4 unobserved: it expects what depth 3 accepts


def test_a_log_that_rejects_every_first_draft_predicts_one_token_a_cycle():
    assert estimate_E([0] * 200, k=4, k_max=4) == pytest.approx([1.0] * 4, abs=0.02)


def test_the_two_state_model_weighs_each_state_by_how_often_the_chain_is_in_it():
    assert estimate_E_two_state([3] * 200, k=3, kp=3) == pytest.approx(4.0, abs=0.03)  # never leaves "full"
    # a full cycle is always followed by a rejected one and the reverse: half the cycles in each state, emitting
    # 1 and 3 tokens
    assert estimate_E_two_state([2, 0] * 100, k=2, kp=2) == pytest.approx(2.0, abs=0.03)
    # the same log read for K' = 1: after a cycle with a draft accepted none is, and after none both are
    assert estimate_E_two_state([2, 0] * 100, k=2, kp=1) == pytest.approx(1.5, abs=0.03)


def test_first_draft_after_full_and_rejected_cycles():
    # pairs: (2,2) full then accepted; (2,0) full then rejected; (0,1) rejected then accepted; (1,2) rejected then ok
    assert first_draft_after([2, 2, 0, 1, 2], k=2) == {"after_full": [1, 2], "after_reject": [2, 2]}


def test_analyse_scores_each_estimate_against_the_other_run():
    logs = {1: [1, 0, 1, 1], 2: [2, 0, 1, 2]}
    a = analyse(logs)
    assert a["measured"] == {1: 1.75, 2: 2.25}
    assert a["errors"]["1->2"] == pytest.approx(a["estimates"][1][1] / 2.25 - 1)
    assert set(a["errors"]) == {"1->2", "2->1"}
    assert set(a["ratio_errors"]) == {"independent from 1", "independent from 2", "two-state from 1",
                                      "two-state from 2"}
    s = summarise([a, a])
    assert s["errors"]["2->1"]["low"] == s["errors"]["2->1"]["high"] == pytest.approx(a["errors"]["2->1"])
    # K = 2's pairs: (2, 0) after a full cycle, rejected; (0, 1) and (1, 2) after rejections, accepted
    assert s["first_draft"]["2"] == {"after_full": 0.0, "after_reject": 1.0}


def test_a_tiny_run_writes_its_table(tmp_path):
    res = main(["--k-max", "2", "--prompts", "1", "--max-new-tokens", "8", "--dtype", "float32",
                "--out", str(tmp_path)])
    (json_path,) = tmp_path.glob("choice-bias-*.json")
    written = json.loads(json_path.read_text())
    assert written["ks"] == [1, 2] and len(written["prompts"]) == 1
    assert set(res["summary"]["errors"]) == {"1->2", "2->1"}
    assert (tmp_path / json_path.name.replace(".json", ".md")).exists()
