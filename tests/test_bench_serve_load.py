"""bench.serve_load's flags, summary and table without a server (tests/test_serve.py drives its load generator
against the real server)."""

import pytest

from bench.serve_load import (CacheSampler, _by_k, _with_preamble, compare, markdown, mode_k, parse_args, percentiles,
                              summarize)


@pytest.mark.parametrize("argv", [["--concurrency", "0,4"], ["--concurrency", "a"], ["--modes", "fast"],
                                  ["--max-tokens", "0"], ["--speculative-num-steps", "0"],
                                  ["--turns", "0"], ["--system-prompt-share", "1.5"], ["--modes", "spec0"],
                                  ["--modes", "spec3,spec3"], ["--modes", "specx"], ["--rounds", "0"],
                                  ["--switch-interval-ms", "0.5,x"], ["--switch-interval-ms", "0"]])
def test_bad_flags_exit_2(argv, tmp_path):
    with pytest.raises(SystemExit) as e:
        parse_args(["--out", str(tmp_path), *argv])
    assert e.value.code == 2


def test_summary_counts_failures_and_compares_with_solo():
    results = [("a", ("xy", 5, 0.010, 0.002)), ("b", ("zz", 3, 0.030, 0.004)), ("a", RuntimeError("boom")),
               ("b", ("no", 1, 0.020, None))]
    row = summarize(4, results, 2.0, {"a": "xy", "b": "zz"})
    assert (row["sent"], row["completed"], row["failed"], row["equal_to_solo"]) == (4, 3, 1, 1 + 1)
    assert row["tokens"] == 9 and row["tokens_per_s"] == pytest.approx(4.5)
    assert row["ttft_ms"]["50"] == pytest.approx(20.0) and row["itl_ms"]["50"] == pytest.approx(3.0)
    assert row["errors"] == ["RuntimeError: boom"]
    assert percentiles([]) == {"50": None, "90": None, "99": None}
    row.update(cycles=3, tokens_per_cycle=3.0)
    table = markdown({"device": "cpu", "jax": "x", "date": "d", "model": "m", "dtype": "float32", "max_tokens": 4,
                      "requests_per_worker": 1, "cycles_per_step": 4, "max_context": 128,
                      "modes": [{"mode": "spec", "k": 3, "mean_acceptance_length": 2.5, "rows": [row]}]})
    assert "| spec | 3 | 4 | 4 | 3 | 1 | 2 of 3 | 4.5 | 3.00 | 20.0 |" in table
    assert "spec K=3: 2.50" in table


def test_the_system_prompt_goes_on_its_share_of_requests_and_the_sampler_reads_positions_per_token():
    assert [sum(_with_preamble(i, share) for i in range(100)) for share in (0, 0.25, 0.75, 1)] == [0, 25, 75, 100]
    assert [_with_preamble(i, 0.5) for i in range(4)] == [False, True, False, True]  # spread, not bunched
    sampler = CacheSampler("http://unused/v1")
    sampler.samples = [(2, 100, 1), (5, 200, 3), (3, 150, 2)]
    got = sampler.summary(64)
    assert (got["pages_in_use_peak"], got["tokens_held_at_peak"], got["slots_at_peak"]) == (5, 200, 3)
    assert got["positions_per_token_held"]["50"] == pytest.approx(1.28)  # 3 x 64 / 150


def test_metrics_labelled_by_k_are_read_per_k():
    metrics = {'jaxspec_speculation_loops_total{k="0"}': 2.0, 'jaxspec_speculation_loops_total{k="3"}': 7.0,
               "jaxspec_speculation_k": 3.0, 'jaxspec_draft_acceptance_estimate{position="1"}': 0.7}
    assert _by_k(metrics, "jaxspec_speculation_loops_total") == {"0": 2.0, "3": 7.0}
    assert _by_k(metrics, "jaxspec_cycle_cost_plain_steps") == {}


def test_modes_name_their_k_and_rounds_compare_medians_with_the_best_fixed_k():
    a = parse_args(["--out", "unused", "--modes", "spec3,spec,adaptive,base", "--speculative-num-steps", "4",
                    "--switch-interval-ms", "5,0.5"])
    assert [mode_k(a, m) for m in a.mode_list] == [3, 4, 4, 0] and a.switch_intervals == [5.0, 0.5]

    def rows(*tps, c=16, ms=None):
        return [{"concurrency": c, "tokens_per_s": t, **({"switch_interval_ms": ms} if ms else {})} for t in tps]

    modes = [{"mode": "spec3", "rows": rows(100.0, 120.0, 90.0) + rows(10.0, c=1)},
             {"mode": "spec4", "rows": rows(105.0, 95.0, 104.0) + rows(12.0, c=1)},
             {"mode": "base", "rows": rows(50.0, 50.0, 50.0) + rows(20.0, c=1)},
             {"mode": "adaptive", "rows": rows(99.0, 101.0, 98.0) + rows(18.0, c=1)}]
    by_level = {r["concurrency"]: r for r in compare(modes)}
    got = by_level[16]
    assert got["tokens_per_s"] == {"spec3": 100.0, "spec4": 104.0, "base": 50.0, "adaptive": 99.0}
    assert got["range"]["spec3"] == [90.0, 120.0] and got["rounds"] == 3
    assert got["best_fixed"] == "spec4" and got["adaptive_over_best"] == pytest.approx(99 / 104)
    assert "adaptive_over_base" not in got
    assert by_level[1]["best_fixed"] == "spec4" and by_level[1]["adaptive_over_base"] == pytest.approx(0.9)
    table = markdown({"device": "cpu", "jax": "x", "date": "d", "model": "m", "dtype": "float32", "max_tokens": 4,
                      "requests_per_worker": 1, "cycles_per_step": 4, "max_context": 128, "rounds": 3,
                      "modes": [], "comparison": compare(modes)})
    assert "| 16 | - | spec3 100.0 [90-120]; spec4 104.0 [95-105]" in table and "| spec4 | 0.952 |" in table
    assert "(over base 0.900)" in table
