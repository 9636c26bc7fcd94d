"""Smoke test at tiny dims on CPU: `python -m bench.step --mesh` on 8 simulated devices (its own file so that
`--dist loadfile` can run it beside test_bench_step.py's single-device runs)."""

from bench.step import main


def test_bench_step_on_a_mesh(tmp_path):
    """`python -m bench.step --mesh 2x4` (8 simulated devices): weights drawn into their shards, caches over data,
    steps and a cycle traced in the mesh with the router ids recorded outside the expert-parallel shard_map, the
    all-reduce latency and per-device floors reported."""
    result = main(["--tiny", "--layers", "3", "--batches", "2", "--contexts", "16", "--tokens", "1", "--iters", "1",
                   "--loop-steps", "0", "--cycle-k", "1", "--mesh", "2x4", "--out", str(tmp_path)])
    assert not result["errors"], result["errors"]
    assert result["mesh"] == {"data": 2, "model": 4} and result["allreduce_us"]["T1"] > 0
    assert result["allreduces_per_step"] == 7
    [cycle] = result["cycles"]
    assert cycle["k"] == 1 and cycle["median_ms"] > 0 and 4 <= max(cycle["bytes"]["unique_experts"]) <= 16
    [row] = result["steps"]
    assert 4 <= max(row["unique_experts"]) <= 8  # global ids: two tokens, top-4 of 16 (not one device's local ids)
    assert row["floor_ms_per_device"] * 8 == row["floor_ms_4p3"]
    assert "## On the mesh (data 2 x model 4)" in next(tmp_path.glob("step-*.md")).read_text()
