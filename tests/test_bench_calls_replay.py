"""bench.labs.calls_replay: adaptive by call replayed over a simulated device at a flat acceptance."""

import numpy as np

from bench.labs.calls_replay import H200_4_LAYERS, draw_accepted, fixed, main, replay
from jaxspec.adaptive_calls import PerCallPolicy

COSTS, SWITCH = H200_4_LAYERS


def test_drafts_are_accepted_up_to_the_first_wrong_one():
    rng = np.random.default_rng(0)
    assert draw_accepted(rng, 1.0, 4) == 4 and draw_accepted(rng, 0.0, 4) == 0
    mean = np.mean([draw_accepted(rng, 0.5, 2) for _ in range(4000)])
    assert abs(mean - 0.75) < 0.05  # 0.5 + 0.25


def test_the_host_rule_runs_over_the_simulated_calls():
    policy = PerCallPolicy().validate(4)
    rng = np.random.default_rng(1)
    never = replay(0.0, policy, COSTS, SWITCH, 128, rng)
    # the prior's K for the first call's minimum, then plain decoding to the end in its plain tail (one call)
    assert never["calls"] == 1 and never["ks"][:4] == [1] * 4 and set(never["ks"][4:]) == {0}
    assert len(never["ks"]) == 127  # one token a cycle or step after the prefill's first
    always = replay(1.0, policy, COSTS, SWITCH, 128, rng)
    # every draft right: after the prior's K, a depth nobody observed is taken where it is the fastest
    assert always["ks"][:4] == [1] * 4 and set(always["ks"][4:]) <= {3, 4}
    plain = fixed(0.0, 0, COSTS, 128, rng)
    assert abs(plain - 127 / (127 * COSTS[0] * 1e-3)) < 1e-6
    assert never["tokens_per_s"] < plain  # the first cycles and one more call are paid for
    untailed = replay(0.0, PerCallPolicy(plain_tails=()).validate(4), COSTS, SWITCH, 128, np.random.default_rng(1))
    assert untailed["calls"] == 2 and untailed["ks"] == never["ks"]  # plain decoding in a call of its own
    assert untailed["tokens_per_s"] < never["tokens_per_s"]  # which costs the price of one more call


def test_the_command_line_writes_its_rows(tmp_path, capsys):
    main(["--acceptance", "0", "--seeds", "3", "--variants", '{"min 3": {"min_cycles": 3}}', "--out",
          str(tmp_path)])
    assert "min 3" in capsys.readouterr().out and (tmp_path / "calls-replay.json").exists()
