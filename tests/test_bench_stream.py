"""`python -m bench.stream` times the engine's three decode loops (device loop, pipelined stream, one round trip a
cycle) from the engine's own results."""

import pytest

from bench.stream import MODES, main, markdown, time_modes
from jaxspec.engine import GenerationResult


class _FakeEngine:
    """Engine.generate / Engine.stream's contract without a model: `python -m bench.stream` only reads results
    (the real loops are held to each other by tests/test_speculative.py)."""

    def __init__(self):
        self.calls = []

    def _result(self, decode_s):
        return GenerationResult([[1, 2, 3, 4]], [], [5], 0.01, decode_s, 0.0, cycles=3)

    def generate(self, prompts, max_new, speculative):
        self.calls.append(("generate", speculative))
        return self._result(0.003)

    def stream(self, prompts, max_new, speculative, pipelined):
        self.calls.append(("stream" if pipelined else "stream_one_by_one", speculative))
        return iter([[[1]], [[2, 3, 4]], self._result(0.006 if pipelined else 0.009)])


def test_bench_stream_times_each_mode_from_the_engines_results():
    engine = _FakeEngine()
    rows = time_modes(engine, [[5]], 4, False, repeats=2, log=lambda *a: None)
    assert set(rows) == set(MODES)
    assert [c for c, _ in engine.calls] == [m for m in MODES for _ in range(3)]  # warm-up + 2 repeats each
    assert [rows[m]["ms_per_cycle"] for m in MODES] == pytest.approx([1.0, 2.0, 3.0])  # decode_s / cycles
    assert all(r["same_tokens_as_generate"] and r["cycles"] == 3 for r in rows.values())
    result = dict(device="cpu", jax="x", date="d", layers=4, tiny=True, batch=1, prompt_tokens=1, max_new_tokens=4,
                  repeats=2, runs={"baseline (no speculation)": rows})
    assert "| baseline (no speculation) | 1.000 | 2.000 | 3.000 | 2.00 | 3.00 |" in markdown(result)


@pytest.mark.parametrize("argv, flag", [(["--layers", "2"], "--layers"), (["--k", "-1"], "--k"),
                                        (["--repeats", "0"], "--repeats")])
def test_bench_stream_refuses_bad_flags(argv, flag, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert flag in capsys.readouterr().err

