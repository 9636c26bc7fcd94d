"""`python -m bench.labs.graph_mode_check` at tiny dims on CPU: one process per CUDA-graph scheduling mode, the tokens and
logits of each compared with the first (a CPU has no CUDA graph, so they must be identical)."""

import json

import pytest

from bench.labs.graph_mode_check import AUTOTUNE_CACHE_FLAG, FLAG, _with_mode
from bench.labs.graph_mode_check import main as graph_mode_check


def test_modes_run_in_their_own_processes_and_agree(tmp_path):
    result = graph_mode_check(["--tiny", "--layers", "2", "--steps", "3", "--iters", "2", "--context", "32",
                               "--modes", "LHS", "CONCURRENT", "--out", str(tmp_path)])
    assert [r["mode"] for r in result["runs"]] == ["LHS", "CONCURRENT"]
    assert all(f"{FLAG}={r['mode']}" in r["xla_flags"].split() for r in result["runs"])
    cache_dirs = {f for r in result["runs"] for f in r["xla_flags"].split() if f.startswith(AUTOTUNE_CACHE_FLAG + "=")}
    assert len(cache_dirs) == 1 and result["autotune_cache"] == "shared"  # by default one directory for both
    lhs, concurrent = result["runs"]
    assert len(lhs["tokens"]) == 3 and concurrent["tokens"] == lhs["tokens"] and result["all_tokens_equal"]
    assert lhs["tokens_repeat_equal"] and concurrent["tokens_repeat_equal"]
    for name in ("decode", "verify"):
        assert concurrent[name]["logits_identical_first"] and concurrent[name]["logits_max_abs_diff_first"] == 0
        assert concurrent[name]["sync_ms"] > 0 and concurrent[name]["queued_ms"] > 0
    assert json.loads(next(tmp_path.glob("graph-mode-check-cpu-*.json")).read_text())["all_tokens_equal"]


def test_the_mode_flag_replaces_an_earlier_one():
    flags = f"--xla_backend_optimization_level=0 {FLAG}=LHS"
    assert _with_mode(flags, "CONCURRENT").split() == ["--xla_backend_optimization_level=0", f"{FLAG}=CONCURRENT"]
    assert _with_mode("", "LHS") == f"{FLAG}=LHS"
    engine = f"{AUTOTUNE_CACHE_FLAG}=/engine {FLAG}=CONCURRENT"
    assert _with_mode(engine, "LHS", "/shared").split() == [f"{AUTOTUNE_CACHE_FLAG}=/shared", f"{FLAG}=LHS"]
    assert _with_mode(engine, "LHS").split() == [f"{FLAG}=LHS"]  # own: no cache directory at all
    assert _with_mode("", "CONCURRENT+exclusive-lock").split() == ["--xla_gpu_require_exclusive_lock=true",
                                                                   f"{FLAG}=CONCURRENT"]


def test_bad_flags_are_refused():
    with pytest.raises(SystemExit):
        graph_mode_check(["--modes", "FAST"])
    with pytest.raises(SystemExit):
        graph_mode_check(["--steps", "0"])
    with pytest.raises(SystemExit):
        graph_mode_check(["--modes", "CONCURRENT+no-such-set"])
