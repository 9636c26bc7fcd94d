"""The adaptive benchmarks' command lines on tiny settings: bench.adaptive_acceptance (K2.5-shaped, controllable
drafter; JSON, markdown and the plot) and bench.adaptive_prompts (the embedded pair), and their flag errors."""

import functools
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import adaptive_acceptance, adaptive_prompts
from bench.adaptive_acceptance import controlled_drafter
from jaxspec.prefill import spec_prefill
from tests.speculative_cases import pair  # noqa: F401 (fixture)


def test_controlled_drafter_proposes_the_truth_at_the_asked_rate(pair):
    """Per position, the true next token with probability a and never by accident otherwise."""
    cfg, w = pair
    b, k, n = 64, 4, 40
    tokens = jnp.tile(jnp.arange(3, 19, dtype=jnp.int32)[None], (b, 1))
    # jitted: one program each, where running op by op compiles every operation on its own
    prefill = jax.jit(functools.partial(spec_prefill, cfg=cfg, capacity=64, k=k, greedy=True, max_new_tokens=n,
                                        max_cycles=n))
    state = prefill(w, tokens, jnp.full((b,), 16, jnp.int32), jax.random.key(0), {})
    cont = jax.random.randint(jax.random.key(1), (b, n), 0, cfg.target.vocab_size, jnp.int32)
    drafter = jax.jit(lambda w, state, rate, cont: controlled_drafter(jax.random.key(2), w, cfg, state, k, True, {},
                                                                       rate=rate, continuation_BS=cont)[0])
    for a in (0.0, 0.5, 1.0):
        drafts = drafter(w, state, jnp.float32(a), cont)
        hit = np.asarray(drafts == cont[:, 1: 1 + k])  # generated = 1: draft j is continuation[1 + j]
        assert abs(hit.mean() - a) < 0.1


def test_acceptance_sweep_cli_writes_table_and_plot(tmp_path):
    result = adaptive_acceptance.main(["--tiny", "--layers", "3", "--k", "1", "--adaptive-steps", "0", "1",
                                       "--acceptance", "0", "1", "--prompt-tokens", "8", "--max-new-tokens", "12",
                                       "--repeats", "1", "--target", "chained", "--out", str(tmp_path)])
    stems = {p.suffix: p for p in tmp_path.iterdir()}
    assert set(stems) == {".json", ".md", ".png"}
    doc = json.loads(stems[".json"].read_text())
    assert doc["acceptance"] == [0.0, 1.0] and set(doc["rows"]) == {"K=0", "K=1", "adaptive"}
    rows = result["rows"]
    assert rows["K=0"]["chain_holds"] == 1.0  # the chained target's greedy tokens are f of the last, every one
    # a = 1: every draft the truth
    assert rows["K=1"][1.0]["acceptance"] == pytest.approx(1.0) and rows["K=1"][1.0]["same_tokens"]
    assert rows["K=1"][0.0]["acceptance"] == 0.0
    assert all(sum(r["k_histogram"].values()) > 0 for r in rows["adaptive"].values())
    assert "| 1.0 |" in stems[".md"].read_text()


def test_prompts_cli_compares_plain_fixed_and_adaptive(tmp_path):
    result = adaptive_prompts.main(["--k", "1", "--adaptive-max", "1", "--prompts", "1", "--max-new-tokens", "6",
                                    "--repeats", "1", "--dtype", "float32", "--out", str(tmp_path)])
    row = result["prompts"][0]
    assert set(row["runs"]) == {"baseline", "K=1", "adaptive"}
    assert row["same_tokens_as_plain"] is True
    assert row["summary"]["speedup"]["baseline"] == 1.0
    assert sum(row["runs"]["adaptive"]["k_histogram"].values()) == row["runs"]["adaptive"]["cycles"]
    # adaptive against the engine of the K it ran most (plain decoding for K = 0)
    hist = row["runs"]["adaptive"]["k_histogram"]
    ran = row["summary"]["adaptive_k"]
    assert hist[str(ran)] == max(hist.values())
    same = row["runs"]["baseline" if ran == 0 else f"K={ran}"]["tokens_per_s"]
    assert row["summary"]["adaptive_over_same_k"] == pytest.approx(row["runs"]["adaptive"]["tokens_per_s"] / same)
    assert result["median_adaptive_over_same_k"] == row["summary"]["adaptive_over_same_k"]
    assert len(row["runs"]["K=1"]["tokens_per_s_rounds"]) == 1 and row["summary"]["best_copy_over_best"] is None
    assert {p.suffix for p in tmp_path.iterdir()} == {".json", ".md"}
    # the table again from the JSON alone, its figures recomputed from the rounds it keeps
    again = adaptive_prompts.main(["--summarise", str(next(tmp_path.glob("*.json")))])
    assert again["prompts"][0]["summary"] == row["summary"]
    assert again["worst_adaptive_over_best"] == result["worst_adaptive_over_best"]


def test_ratios_paired_by_round_divide_out_what_a_round_shares():
    # a slow second round (the host busy) slows every engine of it: the ratio of medians keeps part of it, the
    # median of per-round ratios does not
    adaptive, fixed = [98.0, 49.0, 97.0], [100.0, 50.0, 100.0]
    assert adaptive_prompts.paired_ratio(adaptive, fixed) == pytest.approx(0.98)
    assert adaptive_prompts.paired_ratio([], []) is None
    row = {"runs": {"baseline": {"tokens_per_s": 50.0, "tokens_per_s_rounds": [50.0, 25.0, 50.0]},
                    "K=3": {"tokens_per_s": 100.0, "tokens_per_s_rounds": fixed},
                    "adaptive": {"tokens_per_s": 97.0, "tokens_per_s_rounds": adaptive, "k_histogram": {"3": 9}}}}
    s = adaptive_prompts.summarise(row)
    assert s["adaptive_over_best"] == pytest.approx(0.97)
    assert s["adaptive_over_best_paired"] == s["adaptive_over_same_k_paired"] == pytest.approx(0.98)
    del row["runs"]["K=3"]["tokens_per_s_rounds"]  # a run from before the rounds were kept
    assert adaptive_prompts.summarise(row)["adaptive_over_best_paired"] is None


def test_a_copy_of_the_best_engine_is_scored_against_the_best_of_the_other_half():
    # K=2's rounds alternate 100 / 90 and K=3's 95 / 95: by the even rounds K=2 is best (100) and its odd rounds
    # read 90 (0.90); by the odd rounds K=3 is best (95) and its even rounds read 95 (1.0)
    rounds = {"K=2": [100, 90] * 3, "K=3": [95, 95] * 3}
    assert adaptive_prompts.best_copy_over_best(rounds) == pytest.approx((0.90 + 1.0) / 2)
    assert adaptive_prompts.best_copy_over_best({"K=1": [1.0, 2.0, 3.0]}) is None  # too few rounds to halve
    steady = {"K=1": [50.0] * 6, "K=2": [60.0] * 6}
    assert adaptive_prompts.best_copy_over_best(steady) == pytest.approx(1.0)


@pytest.mark.parametrize("module, argv, needle", [
    (adaptive_acceptance, ["--layers", "2"], "--layers"),
    (adaptive_acceptance, ["--acceptance", "1.5"], "--acceptance"),
    (adaptive_acceptance, ["--k", "0"], "--k"),
    (adaptive_acceptance, ["--min-cycles", "0", "--adaptive-kind", "per_call"], "--min-cycles"),
    (adaptive_acceptance, ["--min-cycles", "2", "--adaptive-kind", "per_cycle"], "--min-cycles"),
    (adaptive_prompts, ["--prompts", "0"], "--prompts"),
    (adaptive_prompts, ["--k", "0"], "--k"),
])
def test_bad_flags_are_refused(module, argv, needle, capsys, tmp_path):
    with pytest.raises(SystemExit):
        module.main(argv + ["--out", str(tmp_path)])
    assert needle in capsys.readouterr().err


def test_prompts_takes_a_run_or_a_summary_not_both(capsys, tmp_path):
    for argv in ([], ["--out", str(tmp_path), "--summarise", str(tmp_path / "x.json")]):
        with pytest.raises(SystemExit):
            adaptive_prompts.main(argv)
        assert "--summarise" in capsys.readouterr().err


def test_the_sweep_reports_other_first_tests_beside_the_tables_adaptive():
    rows = {"K=0": {"tokens_per_s": 100.0}, "K=1": {0.5: {"tokens_per_s": 150.0, "acceptance": 0.5}},
            "adaptive": {0.5: {"tokens_per_s": 147.0, "k_histogram": {"0": 0, "1": 9}}}}
    result = dict(acceptance=[0.5], rows=rows, min_cycles=4,
                  min_cycles_variants={"2": {0.5: {"tokens_per_s": 120.0, "k_histogram": {"0": 9, "1": 0}}}})
    (row,) = adaptive_acceptance.summary(result)
    assert row["best"] == "K=1" and row["adaptive_over_best"] == pytest.approx(0.98)
    assert row["adaptive_over_plain"] == pytest.approx(1.47) and row["by_min_cycles"] == {"2": pytest.approx(0.8)}
    result.update(device="cpu", jax="x", date="d", layers=3, tiny=True, batch=1, prompt_tokens=8, max_new_tokens=8,
                  repeats=1, adaptive_steps=[0, 1], costs_ms={})
    assert "- a = 0.5: 4 cycles 0.980; 2 cycles 0.800 {'0': 9, '1': 0}" in adaptive_acceptance.markdown(result)


def test_interleaved_rounds_rotate_the_engines_after_an_untimed_warm_up():
    order = []

    def contender(name):
        out = types.SimpleNamespace(generated=jnp.zeros(1), out_tokens=jnp.zeros(1))
        return adaptive_acceptance.Contender(lambda rep: jnp.full((), rep), lambda s: order.append((name, int(s)))
                                             or out, lambda o: order.append((name, "seen")))

    times, outs = adaptive_acceptance.interleaved({n: contender(n) for n in "abc"}, repeats=3)
    runs = [o for o in order if o[1] != "seen"]
    assert [n for n, _ in runs] == list("abc" "bca" "cab" "abc")  # each round starts one later
    assert [rep for _, rep in runs] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    assert order[:3] == [("a", 0), ("b", 0), ("c", 0)]  # the warm-up round is neither timed nor seen
    assert all(len(t) == 3 for t in times.values()) and sum(o[1] == "seen" for o in order) == 9
    assert set(outs) == set("abc")


def test_an_interleaved_sweep_compares_adaptive_with_plain_of_its_own_rounds_and_pairs_them():
    # plain decoding ran slower in a = 0.5's rounds (100) than over the sweep (110): adaptive is held to the 100
    rows = {"K=0": {"tokens_per_s": 110.0, "by_a": {0.5: 100.0}, "rounds": {0.5: [100.0, 50.0, 100.0]}},
            "K=1": {0.5: {"tokens_per_s": 90.0, "rounds": [90.0, 45.0, 90.0], "acceptance": 0.5}},
            "adaptive": {0.5: {"tokens_per_s": 96.0, "rounds": [98.0, 49.0, 96.0], "k_histogram": {"0": 9}}}}
    result = dict(acceptance=[0.5], rows=rows, device="cpu", jax="x", date="d", layers=3, tiny=True, batch=1,
                  prompt_tokens=8, max_new_tokens=8, repeats=3, adaptive_steps=[0, 1], costs_ms={}, interleaved=True)
    (row,) = adaptive_acceptance.summary(result)
    assert row["best"] == "K=0" and row["adaptive_over_best"] == pytest.approx(0.96)
    assert row["adaptive_over_best_paired"] == row["adaptive_over_plain_paired"] == pytest.approx(0.98)
    # read back from its JSON (the a's are strings there): the same table
    again = json.loads(json.dumps(result))
    assert adaptive_acceptance.summary(again)[0]["adaptive_over_best_paired"] == pytest.approx(0.98)
    assert "| 0.5 | 100.0 | 90.0 | 96.0 | K=0 | 0.960 | 0.980 |" in adaptive_acceptance.markdown(again)


def test_summarise_names_a_file_it_cannot_read(tmp_path):
    """--summarise of a missing file, of text that is not JSON and of another bench's JSON: one line naming the
    flag and the file (SystemExit with a message), not a traceback."""
    step = tmp_path / "step.json"
    step.write_text(json.dumps({"device": "cpu", "steps": []}))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for path in (tmp_path / "missing.json", bad, step):
        with pytest.raises(SystemExit) as e:
            adaptive_prompts.main(["--summarise", str(path)])
        assert isinstance(e.value.code, str) and e.value.code.startswith("--summarise") and str(path) in e.value.code


def test_fresh_cli_times_new_engines_with_and_without_probes(tmp_path):
    """bench.adaptive_fresh on one prompt, a few tokens: every engine's row, the adaptive engines built anew for each
    run (their stretches cover the run's cycles), the random draft's row, and the markdown table."""
    from bench import adaptive_fresh

    result = adaptive_fresh.main(["--prompts", "2", "--k", "1", "--adaptive-max", "2", "--max-new-tokens", "8",
                                  "--repeats", "1", "--dtype", "float32", "--out", str(tmp_path)])
    assert [r["draft"] for r in result["rows"]] == ["trained", "random"]
    for row in result["rows"]:
        runs = row["runs"]
        assert set(runs) == {"baseline", "K=1", "adaptive", "adaptive_no_probe"}
        assert runs["adaptive"]["tokens"] == runs["baseline"]["tokens"] == runs["K=1"]["tokens"]
        assert sum(n for _, n in runs["adaptive"]["k_runs"]) == runs["adaptive"]["cycles"]
        assert row["summary"]["best_fixed"] == "K=1" and row["summary"]["speedup"]["baseline"] == 1.0
    assert adaptive_fresh.k_runs([3, 3, 0, 0, 0, 4]) == [[3, 2], [0, 3], [4, 1]]
    md = next(tmp_path.glob("*.md")).read_text()
    assert "| random |" in md and "no probes" in md
