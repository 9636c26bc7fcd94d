"""`python -m bench.labs.step_profile --loop-fixed`: device-loop calls of N and 3N decode steps traced, so a call's fixed
cost can be taken apart (device kernels and idle gaps, host events) from a real jax.profiler trace."""

from bench.labs.step_profile import idle_gaps, main


def test_idle_gaps_finds_the_stretches_without_a_kernel():
    ev = lambda name, start_us, dur_us: dict(name=name, start_ns=start_us * 1e3, duration_ns=dur_us * 1e3)  # noqa: E731
    events = [ev("a", 0, 10), ev("b", 5, 30), ev("c", 100, 5), ev("d", 110, 1), ev("e", 200, 1)]
    gaps = idle_gaps(events, min_us=20)
    # b ends at 35 (a's end at 10 is covered), c starts at 100; d ends at 111, e starts at 200; the 5 us gap is too short
    assert [(g["us"], g["before"], g["after"]) for g in gaps] == [(65.0, "b", "c"), (89.0, "d", "e")]
    assert [g["kernel_index"] for g in gaps] == [2, 4]


def test_loop_fixed_cost_traced_for_two_lengths(tmp_path):
    result = main(["--tiny", "--layers", "2", "--tokens", "--steps", "2", "--context", "16", "--loop-fixed",
                   "--out", str(tmp_path)])
    lf = result["loop_fixed"]
    assert (lf["short"]["steps"], lf["long"]["steps"]) == (2, 6)
    for r in (lf["short"], lf["long"]):
        assert r["kernels"] > 0 and 0 < r["busy_ms"] <= r["span_ms"] * (1 + 1e-9) and r["wall_ms"] > 0
        assert r["host"] and all(not h["name"].startswith("$profiler.py") for h in r["host"])
    assert lf["long"]["kernels"] > lf["short"]["kernels"]  # 4 more steps of thunks
    assert set(lf["per_step"]) == set(lf["fixed"]) == {"wall_ms", "busy_ms", "span_ms", "kernels"}
    report = next(tmp_path.glob("step-profile-*.md")).read_text()
    assert "## A device-loop call's fixed cost" in report and "| loop of 6 |" in report
