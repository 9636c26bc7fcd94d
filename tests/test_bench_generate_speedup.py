"""bench.generate_speedup reads what `python -m jaxspec.generate --baseline` prints: its patterns are held to the
real formatter here, so a change of the printed line breaks this test rather than the benchmark."""

import pytest

from bench.generate_speedup import K_LINE, SPEEDUP_LINE, markdown, parse_arm, summary
from jaxspec.generate_display import format_speedup


def _baseline(rounds, speedup, low, high):
    return dict(mode="stream", rounds=rounds, decode_tokens_per_s=500.0, speculative_decode_tokens_per_s=480.0,
                speedup=speedup, speedup_min=low, speedup_max=high)


def test_reads_the_printed_speedup_and_its_range():
    m = SPEEDUP_LINE.search("text\n" + format_speedup(_baseline(5, 0.964, 0.931, 1.101)) + "\n")
    assert (m.group(1), m.group(2), m.group(3)) == ("0.96", "0.93", "1.10")
    one = SPEEDUP_LINE.search(format_speedup(_baseline(1, 1.2, 1.2, 1.2)))
    assert one.group(1) == "1.20" and one.group(2) is None


def test_no_speedup_is_said_so_not_printed_as_nan():
    line = format_speedup(_baseline(5, float("nan"), float("nan"), float("nan")))
    assert "nan" not in line and "no speedup" in line and SPEEDUP_LINE.search(line) is None


def test_reads_the_adaptive_histogram_line():
    line = ("adaptive: cycles per K {K=0: 112, K=1: 0, K=3: 5}; cost table ms/cycle {0: 2.26, 1: 4.38, 3: 6.49} "
            "(measured); expected 446.0 tok/s, achieved 404.7")
    assert K_LINE.search(line).group(1) == "K=0: 112, K=1: 0, K=3: 5"


def test_arms_summary_and_table():
    assert parse_arm("fixed=") == ("fixed", [])
    assert parse_arm("k3=--speculative-num-steps 3 --speculative-adaptive") == (
        "k3", ["--speculative-num-steps", "3", "--speculative-adaptive"])
    with pytest.raises(SystemExit):
        parse_arm("--speculative-adaptive")
    rows = [dict(speedup=s, low=s - 0.05, high=s + 0.05, k_histogram=None, costs_ms=None) for s in (0.9, 1.0, 0.97)]
    assert summary(rows, 0.95) == dict(runs=3, median=0.97, low=0.9, high=1.0, below=1)
    doc = markdown(dict(machine="cpu", jax="x", date="d", floor=0.95, rounds_note="5 rounds",
                        arms=[dict(name="fixed", flags=[], modes={"stream": rows})]))
    assert "| fixed | `(defaults)` | stream | 3 | 0.970 | 0.90 | 1.00 | 1 | 0.90, 1.00, 0.97 |" in doc


@pytest.mark.parametrize("bench", ["generate_speedup", "startup"])
def test_an_arm_generate_refuses_is_one_line_naming_its_flags(bench, tmp_path):
    """generate refuses a bad flag in one line with status 2 (before it imports JAX): the bench names the arm's flags
    in one line too, not a RuntimeError traceback."""
    import importlib

    module = importlib.import_module(f"bench.{bench}")
    with pytest.raises(SystemExit) as e:
        module.main(["--arms", "bad=--no-such-flag", "--runs", "1", "--out", str(tmp_path)])
    assert isinstance(e.value.code, str) and e.value.code.startswith("--arms") and "--no-such-flag" in e.value.code
