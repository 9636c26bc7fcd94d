"""Smoke test at tiny dims on CPU: `python -m bench.labs.host_overhead` takes a synchronised step's host time apart."""

import json

from bench.labs.host_overhead import main as host_overhead


def test_host_overhead_tiny(tmp_path):
    """`python -m bench.labs.host_overhead` on CPU: the step synchronised and queued, the empty program over the same
    arguments, and the host events of a traced step (no device plane on a CPU, so no device columns)."""
    result = host_overhead(["--tiny", "--layers", "3", "--tokens", "1", "--context", "16", "--iters", "2",
                            "--traced", "2", "--arg-counts", "1", "10", "500", "--out", str(tmp_path)])
    [row] = result["rows"]
    assert row["step_sync_ms"] > 0 and row["step_queued_ms"] > 0 and row["empty_program_sync_us"] > 0
    assert row["arguments"] > 20  # the weights' leaves, tokens, positions and the cache
    assert sorted(row["empty_program_by_arguments"]) == [1, 10]  # 500: more than the step has, left out
    assert all(c["sync_us"] > 0 and c["queued_us"] > 0 for c in row["empty_program_by_arguments"].values())
    assert len(row["steps"]) == 2 and all(s["wall_us"] > 0 for s in row["steps"])
    assert any("PjitFunction" in e["name"] for e in row["host_events"])
    assert json.loads(next(tmp_path.glob("host-overhead-*.json")).read_text())["rows"][0]["tokens"] == 1
