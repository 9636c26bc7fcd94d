"""bench.admission_gaps on the embedded pair, small: the streams' gaps around a long prompt's admission are
measured and written (no figure is asserted: timings are the bench's to report)."""

import json

from bench import admission_gaps


def test_the_bench_measures_gaps_around_an_admission(tmp_path):
    result = admission_gaps.main(["--out", str(tmp_path), "--prefill-chunks", "16", "--prompt-tokens", "64",
                                  "--streams", "2", "--stream-tokens", "96", "--max-context", "256"])
    (row,) = result["rows"]
    assert row["prefill_chunk"] == 16 and row["gaps_before"] >= 4 and row["gaps_during"] >= 1
    assert row["largest_gap_during_s"] > 0 and row["median_gap_s"] > 0 and row["long_ttft_s"] > 0
    assert json.loads(next(tmp_path.glob("admission-gaps-*.json")).read_text())["rows"][0]["ratio"] == row["ratio"]
    assert "| 16 |" in next(tmp_path.glob("admission-gaps-*.md")).read_text()
