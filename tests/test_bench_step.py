"""Smoke tests at tiny dims on CPU: `python -m bench.step` times a decode step and a K=1 speculative cycle
(synchronised and inside a jitted loop) and the decode step's floor adds up; `python -m bench.labs.step_profile` reads a
trace (on a mesh: test_bench_step_mesh.py)."""

import json
import math

import pytest

from bench import report
from bench.step import main
from bench.timing import device_loop_ms


def test_bench_step_tiny(tmp_path):
    """One run checks the step, both drafter kinds' cycles and `--prefix-layers`: compiling the tiny model's programs
    is most of a run's cost, so the checks share it."""
    result = main(["--tiny", "--layers", "4", "--batches", "1", "--contexts", "16", "--tokens", "1",
                   "--cycle-k", "1", "--iters", "1", "--loop-steps", "2", "--draft-kinds", "llama", "mla",
                   "--prefix-layers", "2", "--out", str(tmp_path)])
    assert not result["errors"], result["errors"]
    [row] = result["steps"]
    parts = row["bytes"]
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    assert row["unique_experts"] == [4, 4, 4]  # three MoE layers, one token, top-4
    assert parts["kv_cache"] == 4 * 1 * (16 + 1) * (32 + 8) * 2  # layers x batch x slots x (latent + rope) x bf16
    assert row["ratio_4p3"] > 0 and row["median_ms"] > 0
    # 2 and 6 steps in one jitted loop; on a busy CPU the slope between them is noise, so only its presence is checked
    assert math.isfinite(row["device_loop_ms"]) and math.isfinite(row["device_loop_ratio_4p3"])
    assert row["device_loop_chained_ms"] > 0
    cycle, mla = result["cycles"]
    assert (cycle["draft"], mla["draft"]) == ("llama", "mla") and mla["median_ms"] > 0
    # the MLA draft (a full-vocabulary head, one latent row per slot) beside the Llama-shaped one (256-row head)
    assert mla["bytes"]["drafts"] > cycle["bytes"]["drafts"]
    assert mla["bytes"]["total"] == mla["bytes"]["verify"] + mla["bytes"]["drafts"]
    assert cycle["k"] == 1 and cycle["median_ms"] > 0 and cycle["device_loop_chained_ms"] > 0  # 2 and 6 cycles
    assert math.isfinite(cycle["device_loop_ms"]) and math.isfinite(cycle["device_loop_fixed_ms"])
    assert cycle["bytes"]["total"] == cycle["bytes"]["verify"] + cycle["bytes"]["drafts"]
    saved = json.loads(next(tmp_path.glob("step-*.json")).read_text())
    assert saved["steps"][0]["bytes"]["total"] == parts["total"]
    report = next(tmp_path.glob("step-*.md")).read_text()
    assert "| 1 | 16 | 1 |" in report and "## Speculative cycles" in report
    assert "| llama | 1 | 16 | 1 |" in report and "| mla | 1 | 16 | 1 |" in report

    # `--prefix-layers 2` of 4: the same step on layers 0-1, and the difference per MoE layer (2 and 3) beside its
    # own bytes, which are those of one MoE layer (attention, router, shared and 4 routed experts, its cache)
    [slope] = result["layer_slope"]
    assert (slope["prefix_layers"], slope["layers"], slope["tokens"]) == (2, 4, 1)
    assert slope["prefix_row"]["unique_experts"] == row["unique_experts"][:1]  # same tokens: layer 1 routes alike
    assert slope["unique_experts"] == row["unique_experts"][1:] == [4, 4]
    attention_and_cache = (parts["attention"] + parts["kv_cache"]) / 4  # the same in each of the 4 layers
    moe = (parts["router"] + parts["shared"] + parts["routed"]) / 3  # 3 MoE layers, 4 unique experts in each
    assert abs(slope["bytes"] - (attention_and_cache + moe)) < 1e-6 * slope["bytes"]
    assert all(math.isfinite(slope[k]) for k in ("median_ms", "queued_ms", "device_loop_ms", "median_ratio_4p3"))
    assert "## One MoE layer inside the step" in report


def test_prefix_layers_must_leave_out_moe_layers_only(tmp_path):
    for bad in ("4", "5"):  # a prefix of all 4 layers (or more) leaves nothing to difference
        with pytest.raises(SystemExit, match="--prefix-layers"):
            main(["--tiny", "--layers", "4", "--prefix-layers", bad, "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--prefix-layers"):
        main(["--tiny", "--layers", "4", "--prefix-layers", "2", "--mesh", "8", "--out", str(tmp_path)])


def test_device_loop_time_is_the_slope_between_two_loop_lengths(monkeypatch):
    """A loop call costing 60 ms plus 15 ms a step: the slope gives the step, the rest is the call's fixed cost. The
    calls advance a fake clock (a sleeping test measured the machine's load, not the arithmetic)."""
    import types

    import bench.timing

    lengths, clock = [], [0.0]
    monkeypatch.setattr(bench.timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def run_loop(steps):
        lengths.append(steps)
        clock[0] += 0.060 + 0.015 * steps

    got = device_loop_ms(run_loop, steps=2, iters=6)
    assert set(lengths) == {2, 6}
    assert got["device_loop_ms"] == pytest.approx(15) and got["device_loop_fixed_ms"] == pytest.approx(60)
    assert got["device_loop_chained_ms"] == pytest.approx(45)  # (60 + 30) / 2: charging the fixed cost to 2 steps


def test_step_profile_tiny(tmp_path):
    """`python -m bench.labs.step_profile` reads kernel events back from a real jax.profiler trace (XLA's thunks on CPU)."""
    from bench.labs.step_profile import main as profile_main

    # 4 layers, as test_bench_step_tiny: the weights program (the costliest compile here) is compiled once
    result = profile_main(["--tiny", "--layers", "4", "--tokens", "1", "--steps", "2", "--context", "16",
                           "--routing", "independent", "--hlo", "--out", str(tmp_path)])
    assert result["routing"] == "independent" and result["moe_kernel"] == "auto"
    assert "HloModule" in next(tmp_path.glob("step-profile-*-T1.hlo.txt")).read_text()  # --hlo: the loop's program
    [row] = result["rows"]
    assert row["ops"] and row["kernels_per_step"] > 0
    assert 0 < row["busy_ms_per_step"] <= row["span_ms_per_step"] * (1 + 1e-9)
    assert row["busy_ms_per_step"] <= row["kernel_ms_per_step"] * (1 + 1e-9)  # the union never exceeds the sum
    assert "## T = 1" in next(tmp_path.glob("step-profile-*.md")).read_text()


def test_kernel_record_names_the_dispatched_kernel():
    """What the step report says about the MoE kernel of each token count (the Mosaic GPU one only on Hopper)."""
    import jax.numpy as jnp

    from bench.report import _short
    from bench.step import _kernel_record
    from model.configs import known_config
    from model.moe import ExpertWeights
    from model.quant import Int4Weight

    w = Int4Weight(jnp.zeros((2, 256, 64), jnp.uint32), jnp.ones((2, 256, 16), jnp.bfloat16))
    record = _kernel_record(1, ExpertWeights(w, w, w), known_config("kimi-k2.5"))
    assert record["variant"] == "gemv" and record["slots"] == "pairs"  # CPU: the Triton config
    assert _short({"variant": "wgmma", "stages": 2, "gate_up_splits": 4, "down_splits": 8}) == \
        "wgmma st2 gate_up/4 down/8"
    assert _short({"variant": "wgmma", "stages": 2, "gate_up_splits": 4, "down_splits": 8, "down_stages": 4,
                   "permute_h": "before"}) == "wgmma st2/4 gate_up/4 down/8 h-before"
    assert _short({"variant": "wgmma", "stages": 2, "gate_up_splits": 7, "down_splits": 8, "down_k_splits": 2,
                   "permute_h": "before"}) == "wgmma st2 gate_up/7 down/8 F/2 h-before"


def test_report_shows_the_moe_layer_and_its_whole_block():
    """A GPU run's MoE-layer section (the routed experts, then the whole block when it was timed) in the markdown."""
    from bench.report import markdown

    row = dict(tokens=1, unique_experts=8, bytes=198e6, floor_ms_4p3=0.0461, kernel_ms=0.0652, kernel_variant="wgmma",
               kernel_ratio_4p3=1.41, reference_ms=0.9, kernel_rel_err=5e-3, block_bytes=298e6,
               block_floor_ms_4p3=0.0693, block_ms=0.085, block_ratio_4p3=1.23)
    text = markdown(dict(device="H200", jax="0.11.2", date="today", layers=4, tiny=False, moe_path="pallas",
                         moe_layer=dict(rows=[row, {**row, "tokens": 4, "block_ms": None}], sweep={})))
    assert "| 1 | 8 | 198.0 | 46.1 | 65.2 | wgmma | 1.41 |" in text
    assert "| 1 | 298.0 | 69.3 | 85.0 | 1.23 |" in text and "| 4 | 298.0" not in text  # T=4's block not timed



def test_repeated_moe_layers_share_one_draw():
    """`--moe-layers repeated`: every MoE layer runs on one drawn layer's arrays; the dense layers stay as drawn."""
    from bench.step import bench_config, draw_weights

    cfg = bench_config(5, tiny=True)
    w = draw_weights(cfg, tiny=True, moe_layers="repeated")
    assert len(w.layers) == 5 and cfg.first_k_dense_replace == 1
    assert all(lw is w.layers[1] for lw in w.layers[2:])
    assert w.layers[0].mlp.gate.shape != w.layers[1].mlp.experts.gate.shape


@pytest.mark.parametrize("argv, flag", [
    (["--iters", "0"], "--iters"),  # nothing to take a median of (every row an error, the run "complete")
    (["--tokens", "0"], "--tokens"),  # a step of no tokens, timed against a floor of nothing
    (["--batches", "0"], "--batches"),
    (["--contexts", "-1"], "--contexts"),
    (["--layers", "1"], "--layers"),  # K2.5's first layer is dense: one layer has no MoE layer to time
    (["--cycle-k", "0"], "--cycle-k"),
    (["--loop-steps", "-1"], "--loop-steps"),
])
def test_bad_flags_are_one_line_before_anything_runs(argv, flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--tiny", "--out", str(tmp_path), *argv])
    assert e.value.code == 2 and flag in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no result file for a run that did not happen


def test_a_second_run_in_the_same_minute_does_not_overwrite_the_first(tmp_path):
    """Result names carry the minute a run started: a run whose stem an earlier run's files hold writes beside them
    under stem-2, and a run's own later saves (a run cut short keeps what it measured) go on replacing its files."""
    first = report.write_report({"run": 1}, tmp_path, "bench-cpu-20261205-2200", lambda r: f"run {r['run']}\n")
    report._OWN_STEMS.clear()  # what a new process starts from
    second = report.write_report({"run": 2}, tmp_path, "bench-cpu-20261205-2200", lambda r: f"run {r['run']}\n")
    again = report.write_report({"run": 3}, tmp_path, "bench-cpu-20261205-2200", lambda r: f"run {r['run']}\n")
    assert first.name == "bench-cpu-20261205-2200.json"
    assert second.name == again.name == "bench-cpu-20261205-2200-2.json"
    assert json.loads(first.read_text()) == {"run": 1} and first.with_suffix(".md").read_text() == "run 1\n"
    assert json.loads(second.read_text()) == {"run": 3} and second.with_suffix(".md").read_text() == "run 3\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [first.name, second.name, first.with_suffix(".md").name, second.with_suffix(".md").name])
