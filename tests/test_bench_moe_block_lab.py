"""`python -m bench.labs.moe_block_lab` at tiny dims on CPU: the MoE block's launch variants agree and are timed."""

import json

import pytest

from bench.labs.moe_block_lab import main, shared_stream_of


def test_moe_block_lab_tiny(tmp_path):
    result = main(["--tiny", "--tokens", "2", "--rounds", "2", "--iters", "1", "--out", str(tmp_path)])
    rows = result["rows"]
    assert [(r["tokens"], r["variant"]) for r in rows] == [(2, "default"), (2, "stream1")]
    # on a CPU the stream annotation changes nothing: the same numbers
    assert all(r["rel_err"] == 0.0 and len(r["round_ms"]) == 2 and r["floor_ms"] > 0 for r in rows)
    assert json.loads(next(tmp_path.glob("moe-block-lab-*.json")).read_text())["rows"][1]["variant"] == "stream1"


def test_variant_names():
    assert shared_stream_of("default") is None and shared_stream_of("stream2") == 2
    for bad in ("stream", "stream0", "streams1", "fast"):
        with pytest.raises(ValueError, match=f"unknown --variants entry '{bad}'"):
            shared_stream_of(bad)
    with pytest.raises(SystemExit):
        main(["--variants", "default", "stream0"])
    with pytest.raises(SystemExit):
        main(["--tokens", "0"])
