"""Smoke test of `python -m bench.step` at tiny dims on CPU: a decode step is timed and its floor adds up.

(The speculative-cycle section needs >= 3 layers and a draft; it runs in the GPU benchmark, not here, to keep
CI time down.)"""

import json

from bench.step import main


def test_bench_step_tiny(tmp_path):
    result = main(["--tiny", "--layers", "2", "--batches", "1", "--contexts", "16", "--tokens", "1",
                   "--cycle-k", "--iters", "1", "--loop-steps", "2", "--out", str(tmp_path)])
    assert not result["errors"], result["errors"]
    [row] = result["steps"]
    parts = row["bytes"]
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    assert row["unique_experts"] == [4]  # one MoE layer, one token, top-4
    assert parts["kv_cache"] == 2 * 1 * (16 + 1) * (32 + 8) * 2  # layers x batch x slots x (latent + rope) x bf16
    assert row["ratio_4p3"] > 0 and row["median_ms"] > 0
    assert row["device_loop_ms"] > 0 and row["device_loop_ratio_4p3"] > 0  # 2 steps in one jitted loop
    saved = json.loads(next(tmp_path.glob("step-*.json")).read_text())
    assert saved["steps"][0]["bytes"]["total"] == parts["total"]
    assert "| 1 | 16 | 1 |" in next(tmp_path.glob("step-*.md")).read_text()
