"""bench.projection_per_device: one device's measured rows plus each collective at the assumed latency."""

import json

import pytest

from bench.projection_per_device import main, project


def _doc():
    row = lambda kind, t, ms, n, k=None: dict(kind=kind, tokens=t, routing="neighbour", k=k, step_ms=ms,  # noqa: E731
                                              layers=61, context=1024, collectives_cut={"all-reduce": n - 2,
                                                                                        "all-gather": 2})
    return dict(device="NVIDIA H200", date="2026-12-03", rows=[row("decode", 1, 5.0, 125), row("verify", 4, 8.0, 125),
                                                               row("cycle", 4, 10.0, 128, k=3)])


def test_a_step_on_8_devices_is_the_device_step_plus_its_collectives_one_after_another():
    (r,) = project(_doc(), [8.0], [3.2], 3)
    assert r["decode_ms"] == pytest.approx(5.0 + 125 * 0.008)
    assert r["plain_tok_s"] == pytest.approx(1e3 / 6.0)
    assert r["verify_ms"] == pytest.approx(8.0 + 1.0)
    assert r["cycle_ms"] == pytest.approx(10.0 + 128 * 0.008)
    assert r["cycle_tok_s"]["3.2"] == pytest.approx(3.2e3 / (10.0 + 1.024))


def test_a_file_that_is_not_a_per_device_result_is_named(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"rows": [{"kind": "decode"}]}))
    with pytest.raises(SystemExit, match="x.json: a row lacks"):
        main(["--per-device", str(bad), "--out", str(tmp_path / "out")])
    bad.write_text("{")
    with pytest.raises(SystemExit, match="--per-device .*x.json"):
        main(["--per-device", str(bad), "--out", str(tmp_path / "out")])
    good = tmp_path / "pd.json"
    good.write_text(json.dumps(_doc()))
    result = main(["--per-device", str(good), "--out", str(tmp_path / "out"), "--collective-us", "0", "25"])
    assert [r["collective_us"] for r in result["rows"]] == [0.0, 25.0]
    assert result["rows"][0]["decode_ms"] == pytest.approx(5.0)


def test_the_table_shows_the_latency_it_assumed(tmp_path):
    """A latency below 1 us or between whole numbers shows as given, not rounded (2.5 had read "2", 0.5 "0")."""
    good = tmp_path / "pd.json"
    good.write_text(json.dumps(_doc()))
    main(["--per-device", str(good), "--out", str(tmp_path / "out"), "--collective-us", "0.5", "2.5", "8"])
    table = next((tmp_path / "out").glob("*.md")).read_text()
    cells = [line.split(" | ")[1] for line in table.splitlines() if line.startswith("| neighbour |")]
    assert cells == ["0.5", "2.5", "8"]
