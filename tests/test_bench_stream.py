"""Smoke tests at tiny dims on CPU: `python -m bench.stream` times the engine's three decode loops (device loop,
pipelined stream, one round trip a cycle) for speculation and the baseline, with the same tokens from each;
`python -m bench.host_overhead` takes a synchronised step's host time apart."""

import json

import pytest

from bench.stream import MODES, main


def test_bench_stream_tiny(tmp_path):
    """The baseline's loops only (the speculative ones compile a second engine; their streaming is held to
    Engine.generate by tests/test_speculative.py)."""
    result = main(["--tiny", "--layers", "3", "--k", "0", "--prompt-tokens", "5", "--max-new-tokens", "4",
                   "--repeats", "1", "--out", str(tmp_path)])
    [rows] = result["runs"].values()
    assert list(result["runs"]) == ["baseline (no speculation)"] and set(rows) == set(MODES)
    assert all(r["same_tokens_as_generate"] and r["ms_per_cycle"] > 0 for r in rows.values())
    assert {r["cycles"] for r in rows.values()} == {3}  # 4 tokens, the first from prefill; no extra cycle counted
    saved = json.loads(next(tmp_path.glob("stream-*.json")).read_text())
    assert saved["runs"] == json.loads(json.dumps(result["runs"]))
    assert "| baseline (no speculation) |" in next(tmp_path.glob("stream-*.md")).read_text()


@pytest.mark.parametrize("argv, flag", [(["--layers", "2"], "--layers"), (["--k", "-1"], "--k"),
                                        (["--repeats", "0"], "--repeats")])
def test_bench_stream_refuses_bad_flags(argv, flag, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert flag in capsys.readouterr().err


def test_host_overhead_tiny(tmp_path):
    """`python -m bench.host_overhead` on CPU: the step synchronised and queued, the empty program over the same
    arguments, and the host events of a traced step (no device plane on a CPU, so no device columns)."""
    from bench.host_overhead import main as host_overhead

    result = host_overhead(["--tiny", "--layers", "3", "--tokens", "1", "--context", "16", "--iters", "2",
                            "--traced", "2", "--out", str(tmp_path)])
    [row] = result["rows"]
    assert row["step_sync_ms"] > 0 and row["step_queued_ms"] > 0 and row["empty_program_sync_us"] > 0
    assert row["arguments"] > 20  # the weights' leaves, tokens, positions and the cache
    assert len(row["steps"]) == 2 and all(s["wall_us"] > 0 for s in row["steps"])
    assert any("PjitFunction" in e["name"] for e in row["host_events"])
    assert json.loads(next(tmp_path.glob("host-overhead-*.json")).read_text())["rows"][0]["tokens"] == 1
