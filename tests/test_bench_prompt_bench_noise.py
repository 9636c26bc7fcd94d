"""bench.labs.prompt_bench_noise: the worst ratio a perfect adaptive engine would read on the prompt bench's noise."""

import json

import numpy as np
import pytest

from bench.labs.prompt_bench_noise import main, simulate, spread


def bench_result(spread_fraction: float, rounds: int = 21) -> dict:
    """A prompt bench result of 10 prompts where K=3 and K=4 tie within 1% and every engine's rounds spread by
    `spread_fraction` of its median (as the bench writes them)."""
    rng = np.random.default_rng(3)
    prompts = []
    for _ in range(10):
        runs = {}
        for name, speed in (("baseline", 100.0), ("K=3", 200.0), ("K=4", 198.0)):
            rates = (speed * (1 + spread_fraction * rng.standard_normal(rounds))).tolist()
            runs[name] = dict(tokens_per_s=float(np.median(rates)), tokens_per_s_range=[min(rates), max(rates)],
                              tokens_per_s_rounds=rates)
        prompts.append(dict(runs=runs, summary=dict(adaptive_over_best=0.96)))
    return dict(repeats=rounds, prompts=prompts)


def test_without_noise_a_perfect_engine_reads_one_and_noise_pulls_its_worst_prompt_down():
    rng = np.random.default_rng(0)
    quiet = simulate(bench_result(1e-6)["prompts"], 21, 500, rng)
    assert quiet["worst_median"] == pytest.approx(1.0, abs=1e-4) and quiet["at_least_097"] == 1.0
    noisy = simulate(bench_result(0.06)["prompts"], 21, 500, rng)
    assert noisy["worst_median"] < 0.985 and noisy["at_least_097"] < 1.0  # the best of two is biased up
    assert all(0.95 < r <= 1.01 for r in noisy["per_prompt_median"])


def test_the_spread_reads_rounds_robustly_and_falls_back_to_the_range():
    row = dict(tokens_per_s=100.0, tokens_per_s_range=[90.0, 110.0], tokens_per_s_rounds=[99.0, 100.0, 101.0, 40.0])
    assert spread(row, 4, 2.0) == pytest.approx(1.4826 * 1.0 / 100)  # the stray 40 does not count
    del row["tokens_per_s_rounds"]
    assert spread(row, 4, 2.0) == pytest.approx(0.1)


def test_the_command_line_reads_a_result_and_names_a_bad_one(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(bench_result(0.03)))
    main([str(good), "--draws", "50", "--out", str(tmp_path)])
    assert "measured worst 0.960" in capsys.readouterr().out and (tmp_path / "prompt-bench-noise.json").exists()
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="bad.json: not a bench.adaptive_prompts result"):
        main([str(bad)])
