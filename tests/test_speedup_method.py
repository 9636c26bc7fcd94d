"""jaxspec.speedup times speculative and plain decoding alike: both warmed up before any timed run, both the same way
(streamed, or the on-device loop), in rounds whose order alternates, each round's speedup from its own pair. This is
what keeps the printed speedup within the mean acceptance length; the figure itself is a timing, so no test bounds it."""

import types

import pytest

from jaxspec.speedup import SpeedupMeasurement, measure_speedup


class _RecordingEngine:
    """Answers generate / stream with a made-up decode rate per call and records each call's kind."""

    k = 3

    def __init__(self):
        self.calls = []

    def _result(self, how, speculative):
        self.calls.append((how, speculative))
        n = len(self.calls)
        return types.SimpleNamespace(decode_tokens_per_s=float(n * (10 if speculative else 1)), decode_s=1.0 / n,
                                     cycles=n)

    def generate(self, prompts, max_new_tokens, sampling, seed=0, speculative=None):
        return self._result("loop", speculative)

    def stream(self, prompts, max_new_tokens, sampling, seed=0, speculative=None):
        yield "partial"
        yield self._result("stream", speculative)


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "device-loop"])
def test_both_runs_are_warmed_up_timed_alike_and_interleaved(streamed):
    eng = _RecordingEngine()
    m = measure_speedup(eng, [[1, 2]], 16, None, 0, streamed=streamed, rounds=3)
    how = "stream" if streamed else "loop"
    assert {h for h, _ in eng.calls} == {how}  # one way of running for both kinds
    order = [s for _, s in eng.calls]
    assert order[:2] == [True, False]  # the warm-ups, untimed
    assert order[2:] == [True, False, False, True, True, False]  # each round alternates who runs first
    # timed calls are 3..8: speculative at 3, 6, 7 (rates 30, 60, 70), plain at 4, 5, 8 (rates 4, 5, 8)
    assert m.speculative_tokens_per_s == (30.0, 60.0, 70.0) and m.baseline_tokens_per_s == (4.0, 5.0, 8.0)
    assert m.speedups == (7.5, 12.0, 8.75) and m.mode == ("stream" if streamed else "device loop")
    assert m.baseline_steps == 8


def test_refuses_what_it_cannot_compare():
    eng = _RecordingEngine()
    with pytest.raises(ValueError, match="rounds"):
        measure_speedup(eng, [[1]], 4, None, 0, streamed=False, rounds=0)
    eng.k = 0
    with pytest.raises(ValueError, match="speculation"):
        measure_speedup(eng, [[1]], 4, None, 0, streamed=False)


def test_runs_with_nothing_to_decode_give_no_speedup_not_a_crash():
    """A plain run that decoded no token after the prefill's (EOS first, or one new token) has a rate of 0: its
    round has no speedup (NaN), where a division by it raised ZeroDivisionError."""
    eng = _RecordingEngine()
    eng._result = lambda how, speculative: types.SimpleNamespace(decode_tokens_per_s=0.0, decode_s=1e-4, cycles=0)
    m = measure_speedup(eng, [[1]], 1, None, 0, streamed=False, rounds=2)
    assert all(s != s for s in m.speedups)  # NaN
    d = m.as_dict()
    assert d["speedup"] != d["speedup"] and d["speedup_min"] != d["speedup_min"]


def test_rounds_without_a_ratio_do_not_set_the_median_or_the_range():
    """Where some rounds have no speedup (NaN) the median and the range come from the others, in any order of rounds:
    a NaN among the values makes min, max and the median depend on where it stands."""
    def measured(baseline):
        return SpeedupMeasurement(mode="device loop", speculative_tokens_per_s=(20.0, 30.0, 40.0),
                                  baseline_tokens_per_s=baseline, baseline_steps=3, baseline_decode_s=0.1)

    for baseline in ((0.0, 10.0, 10.0), (10.0, 0.0, 10.0), (10.0, 10.0, 0.0)):
        d = measured(baseline).as_dict()
        finite = [s / b for s, b in zip((20.0, 30.0, 40.0), baseline) if b > 0]
        assert (d["speedup_min"], d["speedup_max"]) == (min(finite), max(finite))
        assert d["speedup"] == sum(finite) / 2
