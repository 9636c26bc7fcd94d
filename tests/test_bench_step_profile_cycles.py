"""`python -m bench.labs.step_profile --cycle-k`: speculative cycles traced one dispatch per cycle and in one device
loop, so the two can be compared kernel by kernel (its own file so that `--dist loadfile` can balance it)."""

import pytest

from bench.labs.step_profile import main


def test_step_profile_traces_cycles_both_ways(tmp_path):
    result = main(["--tiny", "--layers", "3", "--tokens", "--steps", "2", "--context", "16", "--cycle-k", "1",
                   "--out", str(tmp_path)])
    per_dispatch, looped = result["rows"]  # no --tokens: cycles only
    assert per_dispatch["label"] == "cycle K = 1, one dispatch per cycle" and per_dispatch["tokens"] == 2
    assert looped["label"] == "cycle K = 1, cycles in one device loop"
    for row in (per_dispatch, looped):
        assert row["ops"] and row["kernels_per_step"] > 0 and row["floor_ms_4p3"] > 0
        assert 0 < row["busy_ms_per_step"] <= row["span_ms_per_step"] * (1 + 1e-9)
    report = next(tmp_path.glob("step-profile-*.md")).read_text()
    assert "## cycle K = 1, one dispatch per cycle" in report and "## T =" not in report
    with pytest.raises(SystemExit, match="--cycle-k must be >= 1"):  # refused before any weight is drawn
        main(["--tiny", "--cycle-k", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="nothing to profile"):
        main(["--tiny", "--tokens", "--out", str(tmp_path)])
