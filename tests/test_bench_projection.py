"""bench.projection: the 61-layer projection's arithmetic from bench.step results (no device needed)."""

import json

import pytest

from bench.projection import PUBLISHED_K3, main, merged_depth, project


def slope(t, layer_ms, prefix_ms, routing="neighbour"):
    return dict(batch=1, context=1024, tokens=t, prefix_layers=5, layers=10, device_loop_ms=layer_ms,
                unique_experts=[8 * t] * 5, routing=routing, prefix_row=dict(device_loop_ms=prefix_ms))


DEPTH = dict(device="dev", date="d", layer_slope=[slope(1, 0.2, 1.0 + 4 * 0.2), slope(4, 0.5, 1.1 + 4 * 0.5)])
CYCLES = dict(device="dev", date="d",
              steps=[dict(batch=1, context=1024, tokens=t, moe_path="kernel", device_loop_ms=1.0 + 0.1 * t)
                     for t in (1, 2, 3, 4, 5)],
              cycles=[dict(batch=1, context=1024, k=k, device_loop_ms=1.0 + 0.1 * (k + 1) + 0.5 * k)
                      for k in (1, 2, 3, 4)])


def test_steps_cycles_and_break_even_follow_the_measured_rows():
    r = project(DEPTH, CYCLES)
    assert r["routing"] == "neighbour" and r["context"] == 1024
    assert r["decode"]["ms"] == pytest.approx(1.0 + 60 * 0.2)
    by_k = {c["k"]: c for c in r["cycles"]}
    assert sorted(by_k) == [1, 2, 3, 4]
    # T = 4 measured: fixed 1.1 + 60 x 0.5; T = 2 interpolated a third of the way from T = 1
    assert by_k[3]["verify"]["ms"] == pytest.approx(1.1 + 60 * 0.5) and by_k[3]["verify"]["measured_at_depth"]
    assert by_k[1]["verify"]["layer_us"] == pytest.approx(300.0) and not by_k[1]["verify"]["measured_at_depth"]
    # past the last measured T the layer is held flat, not extrapolated
    assert by_k[4]["verify"]["layer_us"] == pytest.approx(500.0)
    for k, c in by_k.items():
        assert c["draft_ms"] == pytest.approx(0.5 * k)
        assert c["cycle_ms"] == pytest.approx(c["verify"]["ms"] + 0.5 * k)
        assert c["break_even_length"] == pytest.approx(c["cycle_ms"] / r["decode"]["ms"])
    for name, length in PUBLISHED_K3.items():
        assert by_k[3]["speedup_at_published"][name] == pytest.approx(length * r["decode"]["ms"] / by_k[3]["cycle_ms"])


def test_inputs_without_what_it_needs_are_refused_by_name(tmp_path):
    two = dict(DEPTH, layer_slope=DEPTH["layer_slope"] + [slope(4, 0.6, 3.0, routing="shared")])
    with pytest.raises(SystemExit, match="--routing"):
        project(two, CYCLES)
    assert project(two, CYCLES, routing="shared")["decode"]["tokens"] == 1
    with pytest.raises(SystemExit, match="--cycles: no cycle K"):
        project(DEPTH, dict(CYCLES, cycles=[]))
    with pytest.raises(SystemExit, match="--depth: no device-loop layer slope"):
        project(dict(DEPTH, layer_slope=[]), CYCLES)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match="--depth .*bad.json"):
        main(["--depth", str(bad), "--cycles", str(bad), "--out", str(tmp_path)])
    bad.write_text("[1, 2]")  # JSON, but not a bench's result
    with pytest.raises(SystemExit, match="--depth .*bad.json: a JSON list"):
        main(["--depth", str(bad), "--cycles", str(bad), "--out", str(tmp_path)])


def test_the_cli_writes_the_table(tmp_path):
    (tmp_path / "depth.json").write_text(json.dumps(DEPTH))
    (tmp_path / "cycles.json").write_text(json.dumps(CYCLES))
    main(["--depth", str(tmp_path / "depth.json"), "--cycles", str(tmp_path / "cycles.json"), "--out",
          str(tmp_path / "out")])
    md = next((tmp_path / "out").glob("projection-*.md")).read_text()
    assert "| 3 | 4 | 500.0 |" in md and "HumanEval 3.29 ->" in md


def test_a_later_depth_file_replaces_rows_at_the_same_t_and_routing():
    later = dict(device="dev2", date="e", layer_slope=[slope(4, 0.4, 1.1 + 4 * 0.4), slope(4, 0.3, 1.0, "shared")])
    merged = merged_depth([DEPTH, later])
    assert merged["date"] == "d + e" and merged["device"] == "dev"
    r = project(merged, CYCLES, "neighbour")
    by_k = {c["k"]: c for c in r["cycles"]}
    assert by_k[3]["verify"]["layer_us"] == pytest.approx(400.0)  # the later file's T = 4
    assert r["decode"]["layer_us"] == pytest.approx(200.0)  # T = 1 from the first file
