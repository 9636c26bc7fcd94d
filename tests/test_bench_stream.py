"""Smoke test at tiny dims on CPU: `python -m bench.stream` times the engine's three decode loops (device loop,
pipelined stream, one round trip a cycle) for speculation and the baseline, with the same tokens from each."""

import json

import pytest

from bench.stream import MODES, main


def test_bench_stream_tiny(tmp_path):
    result = main(["--tiny", "--layers", "3", "--k", "1", "--prompt-tokens", "5", "--max-new-tokens", "4",
                   "--repeats", "1", "--out", str(tmp_path)])
    assert set(result["runs"]) == {"speculative K=1", "baseline (no speculation)"}
    for rows in result["runs"].values():
        assert set(rows) == set(MODES)
        assert all(r["same_tokens_as_generate"] and r["ms_per_cycle"] > 0 for r in rows.values())
        assert len({r["cycles"] for r in rows.values()}) == 1  # the pipeline's extra cycle is not counted
    assert result["runs"]["baseline (no speculation)"]["generate"]["cycles"] == 3  # 4 tokens, the first by prefill
    saved = json.loads(next(tmp_path.glob("stream-*.json")).read_text())
    assert saved["runs"] == json.loads(json.dumps(result["runs"]))
    assert "| speculative K=1 |" in next(tmp_path.glob("stream-*.md")).read_text()


@pytest.mark.parametrize("argv, flag", [(["--layers", "2"], "--layers"), (["--k", "-1"], "--k"),
                                        (["--repeats", "0"], "--repeats")])
def test_bench_stream_refuses_bad_flags(argv, flag, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert flag in capsys.readouterr().err
