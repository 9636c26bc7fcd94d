"""bench.labs.calls_replay: adaptive by call replayed over a simulated device at a flat acceptance, or on text."""

import json

import numpy as np
import pytest

from bench.labs.calls_replay import H200_4_LAYERS, draw_accepted, fixed, flat, main, on_text, replay
from jaxspec.adaptive_calls import PerCallPolicy, Pool

COSTS, SWITCH = H200_4_LAYERS


def test_drafts_are_accepted_up_to_the_first_wrong_one():
    rng = np.random.default_rng(0)
    assert draw_accepted(rng, 1.0, 4) == 4 and draw_accepted(rng, 0.0, 4) == 0
    mean = np.mean([draw_accepted(rng, 0.5, 2) for _ in range(4000)])
    assert abs(mean - 0.75) < 0.05  # 0.5 + 0.25


def test_the_host_rule_runs_over_the_simulated_calls():
    policy = PerCallPolicy().validate(4)
    rng = np.random.default_rng(1)
    never = replay(flat(rng, 0.0), policy, COSTS, SWITCH, 128)
    # the prior's K for the first call's minimum, then plain decoding to the end in its plain tail (one call)
    assert never["calls"] == 1 and never["ks"][:4] == [1] * 4 and set(never["ks"][4:]) == {0}
    assert len(never["ks"]) == 127  # one token a cycle or step after the prefill's first
    always = replay(flat(rng, 1.0), policy, COSTS, SWITCH, 128)
    # every draft right: after the prior's K, a depth nobody observed is taken where it is the fastest
    assert always["ks"][:4] == [1] * 4 and set(always["ks"][4:]) <= {3, 4}
    plain = fixed(flat(rng, 0.0), 0, COSTS, 128)
    assert abs(plain - 127 / (127 * COSTS[0] * 1e-3)) < 1e-6
    assert never["tokens_per_s"] < plain  # the first cycles and one more call are paid for
    untailed = replay(flat(np.random.default_rng(1), 0.0), PerCallPolicy(plain_tails=()).validate(4), COSTS, SWITCH,
                      128)
    assert untailed["calls"] == 2 and untailed["ks"] == never["ks"]  # plain decoding in a call of its own
    assert untailed["tokens_per_s"] < never["tokens_per_s"]  # which costs the price of one more call


def test_at_depth_a_k_the_prior_made_look_good_does_not_run_to_the_end():
    """61-layer costs (a call a third of a step) at a flat acceptance of 0.15: the prior's first call leaves, the
    host's estimate, still leaning on the prior, may take K = 1, and its loop leaves once its window shows plain
    decoding faster (with the first test's band alone it ran K = 1 to the end: 0.94 of plain decoding)."""
    costs, policy = (10.97, 13.95, 17.34, 21.29, 25.00), PerCallPolicy().validate(4)
    plain = fixed(flat(np.random.default_rng(0), 0.15), 0, costs, 128)
    runs = [replay(flat(np.random.default_rng(seed), 0.15), policy, costs, 4.0, 128) for seed in range(40)]
    longest_k1 = [max((len(r["ks"]) - i for i in range(len(r["ks"])) if r["ks"][i:] == [1] * (len(r["ks"]) - i)),
                      default=0) for r in runs]
    assert max(longest_k1) < 64  # no generation ends on a long run of K = 1
    assert np.mean([r["tokens_per_s"] for r in runs]) > 0.96 * plain


def test_the_command_line_writes_its_rows(tmp_path, capsys):
    main(["--acceptance", "0", "--seeds", "3", "--variants", '{"min 3": {"min_cycles": 3}}', "--out",
          str(tmp_path)])
    assert "min 3" in capsys.readouterr().out and (tmp_path / "calls-replay.json").exists()


def test_on_text_a_cycle_accepts_what_its_position_allows():
    """N[g] read for the cycle that starts after g tokens: the oracle's row g - 1 (its prefill emits token g)."""
    accept = [0, 2, 5, 1] + [0] * 12
    draw = on_text(accept)
    assert draw(4, 1) == 0 and draw(4, 2) == 2 and draw(4, 3) == 4 and draw(1, 3) == 1
    # fixed K = 4 to 17 tokens: at 1 N is 0 (to 2), at 2 N is 2 (to 5), then N is 0: 12 cycles of one token each
    costs = (1.0, 1.0, 1.0, 1.0, 1.0)
    assert fixed(draw, 4, costs, 17) == pytest.approx(16 / (14 * 1e-3))


def test_a_kept_pool_carries_what_earlier_generations_saw():
    policy = PerCallPolicy().validate(4)
    pool = Pool(4, float(policy.window))
    always = on_text([8] * 127)
    first = replay(always, policy, COSTS, SWITCH, 128, pool=pool)
    again = replay(always, policy, COSTS, SWITCH, 128, pool=pool)
    assert first["ks"][:4] == [1] * 4  # a fresh pool: the prior's K first
    assert again["ks"][0] in (3, 4) and again["tokens_per_s"] > first["tokens_per_s"]  # the pool's deep K at once


def test_the_text_replay_writes_a_row_per_prompt(tmp_path, capsys):
    oracle = tmp_path / "oracle.json"
    oracle.write_text(json.dumps(dict(prompts=[dict(prompt="all", accept=[8] * 63), dict(prompt="none",
                                                                                            accept=[0] * 63)])))
    rows = main(["--oracle", str(oracle), "--rounds", "2", "--max-new-tokens", "64", "--out", str(tmp_path)])
    assert [r["prompt"] for r in rows] == ["all", "none"]
    assert max(rows[0]["fixed"], key=rows[0]["fixed"].get) == 4 and max(rows[1]["fixed"], key=rows[1]["fixed"].get) == 0
    assert rows[1]["adaptive"]["default"]["over_best"] <= 1.0 + 1e-9
    assert "adaptive over the best fixed K" in capsys.readouterr().out
    assert (tmp_path / "calls-replay-text.json").exists()
    oracle.write_text("{}")
    with pytest.raises(SystemExit, match="oracle"):
        main(["--oracle", str(oracle)])


def test_in_the_prompt_benchs_order_each_prompt_follows_its_own_generations(tmp_path):
    """`--order sequential` runs a prompt's warm-up and rounds in a row, as bench.adaptive_prompts does: the pool a
    generation starts from is then its own prompt's, where the rotated passes start each from another prompt's."""
    oracle = tmp_path / "oracle.json"
    oracle.write_text(json.dumps(dict(prompts=[dict(prompt="all", accept=[8] * 63), dict(prompt="none",
                                                                                            accept=[0] * 63)])))
    args = ["--oracle", str(oracle), "--rounds", "3", "--max-new-tokens", "64"]
    rotated = main(args + ["--order", "rotated"])
    sequential = main(args + ["--order", "sequential"])
    for r, s in zip(rotated, sequential):
        assert s["adaptive"]["default"]["over_best"] >= r["adaptive"]["default"]["over_best"] - 1e-9
    assert sequential[0]["adaptive"]["default"]["over_best"] > rotated[0]["adaptive"]["default"]["over_best"]


def test_plain_calls_probe_as_the_engines_do():
    """A text the draft cannot follow for its first 10 tokens, then always: the first call leaves for plain
    decoding, whose blocks (8, 16) see the draft right again, and the host speculates for the rest; without probes
    plain decoding runs to the end. A text it never follows: plain to the end either way, in one plain call."""
    from bench.labs.calls_replay import H200_EMBEDDED

    turns = on_text(np.array([0] * 10 + [4] * 200))
    probed = replay(turns, PerCallPolicy(), *H200_EMBEDDED, 128)
    ks = probed["ks"]
    assert ks[:4] == [3] * 4 and ks[4:28] == [0] * 24 and set(ks[28:]) == {4} and probed["calls"] == 3
    unprobed = replay(turns, PerCallPolicy(probe_every=0), *H200_EMBEDDED, 128)
    assert set(unprobed["ks"][4:]) == {0} and probed["tokens_per_s"] > 1.3 * unprobed["tokens_per_s"]
    never = replay(on_text(np.zeros(210, int)), PerCallPolicy(), *H200_EMBEDDED, 128)
    assert set(never["ks"][4:]) == {0} and never["calls"] == 2


def test_a_new_engine_comes_back_from_plain_decoding_where_the_text_turns(tmp_path, capsys):
    """`--turns-at`: drafts fail before token 9 and are all accepted after it. A new engine leaves its first K for
    plain decoding, and the plain call's blocks (8 and 16 steps, each read against a table priced for its own
    observations) take it back after 24 plain steps; a first block read as a whole one left where the host then
    stayed, and the next call's minimum held plain decoding for 64 steps."""
    rows = main(["--turns-at", "9", "--costs-ms", "0.1537", "0.217", "0.2335", "0.244", "0.274", "--switch-ms", "0.5",
                 "--out", str(tmp_path)])
    got = rows[0]["adaptive"]["default"]
    assert got["stretches"][0][0] > 0 and got["stretches"][1] == [0, 24] and got["stretches"][2][0] > 0
    assert got["calls"] == 3 and got["over_best"] > 0.75
    assert "turns at 9" in capsys.readouterr().out and (tmp_path / "calls-replay-turning.json").exists()
