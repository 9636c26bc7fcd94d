"""The server says when speculation does not pay: once no draft has been accepted in many slot-cycles, /metrics
shows it and the log has one line saying why, once; any accepted draft keeps it quiet (acceptance alone, without a
cycle's cost in plain steps, decides nothing else)."""

import logging
import threading

import numpy as np

from jaxspec.sampling import SamplingParams
from jaxspec.serving.metrics import NEVER_ACCEPTED_MIN_SLOT_CYCLES, Metrics
from jaxspec.serving.prefix_index import PrefixIndex
from jaxspec.serving.scheduler import Finished, Request, Scheduler
from jaxspec.serving.slot_engine import StepResult


def _value(metrics: Metrics, name: str) -> float:
    return next(float(line.split()[1]) for line in metrics.render().splitlines() if line.startswith(name + " "))


def test_metrics_say_it_after_enough_slot_cycles_with_nothing_accepted():
    m = Metrics(4)
    m.step(8, 4, 0, NEVER_ACCEPTED_MIN_SLOT_CYCLES - 1)
    assert m.speculation_not_paying() is None and _value(m, "jaxspec_speculation_not_paying") == 0
    m.step(2, 1, 0, 1)
    line = m.speculation_not_paying()
    assert line and f"no draft was accepted in {NEVER_ACCEPTED_MIN_SLOT_CYCLES} slot-cycles" in line
    assert _value(m, "jaxspec_speculation_not_paying") == 1
    assert _value(m, "jaxspec_slot_cycles_total") == NEVER_ACCEPTED_MIN_SLOT_CYCLES
    m.step(3, 1, 1, 1)  # one accepted draft: nothing proven
    assert m.speculation_not_paying() is None and _value(m, "jaxspec_drafts_accepted_total") == 1


class _NeverAccepting:
    """A speculating engine whose drafts are never accepted: one token per slot-cycle."""

    def __init__(self, k: int):
        self.k, self.max_batch = k, 2
        self.cfg = type("C", (), {"eos_ids": ()})()
        self.prefix = PrefixIndex(0, 64)
        self.left: dict[int, int] = {}

    def admits_in_chunks(self, tokens):
        return False

    def has_room(self, prompt_len, max_new):
        return True

    def free_slots(self, slots):
        pass

    def slots_to_preempt(self):
        return []

    def prefill(self, slot, tokens, max_new, sampling, seed):
        self.left[slot] = max_new - 1
        return 1, False

    def step(self, cancel, any_sampled):
        tokens = [[2] * 4 if self.left.get(s, 0) > 0 else [] for s in range(self.max_batch)]
        for s in list(self.left):
            self.left[s] -= 4
        done = np.array([self.left.get(s, 0) <= 0 for s in range(self.max_batch)])
        live = sum(1 for t in tokens if t)
        return StepResult(tokens, done, accepted=0, slot_cycles=4 * live, cycles=4, k=self.k)

    def reset(self):
        pass


def _serve_one(engine, metrics: Metrics, max_new: int, caplog) -> list[str]:
    """One request through the scheduler to its end: the log's warning lines."""
    scheduler = Scheduler(engine, metrics, max_queue=4)
    ended = threading.Event()
    scheduler.submit(Request([5, 6], max_new, SamplingParams(), 0, lambda e: isinstance(e, Finished) and ended.set()))
    with caplog.at_level(logging.WARNING, logger="jaxspec.serve"):
        scheduler.start()
        assert ended.wait(30)
        scheduler.stop(5)
    return [r.getMessage() for r in caplog.records]


def _serve(k: int, caplog) -> list[str]:
    return [m for m in _serve_one(_NeverAccepting(k), Metrics(2), 200, caplog) if "speculation does not pay" in m]


def test_the_server_logs_it_once(caplog):
    assert len(_serve(4, caplog)) == 1


def test_without_speculation_nothing_is_said(caplog):
    assert _serve(0, caplog) == []


def test_an_adaptive_server_says_when_it_goes_plain_and_shows_its_figures(caplog):
    from jaxspec.serving.adaptive_k import BatchAdaptiveK

    class _Adaptive(_NeverAccepting):
        """Its K chosen per step by the server's rule, timed as a cycle of K costing 1 + K / 4 plain steps."""

        def __init__(self):
            super().__init__(4)
            self.choose_k, self._last = BatchAdaptiveK(4, explore_every=64), None

        def step(self, cancel, any_sampled):
            self.k = self.choose_k(self._last)
            result = super().step(cancel, any_sampled)
            live = result.slot_cycles // 4
            by_count = (float(result.slot_cycles),) + (0.0,) * self.k if self.k else (result.slot_cycles,)
            self._last = StepResult(result.tokens, result.done, 0, result.slot_cycles, 4, self.k, by_count,
                                    (0, result.slot_cycles if self.k == 0 else 0), 4 * (1 + self.k / 4) * max(live, 1))
            return self._last

    metrics = Metrics(2)
    said = [m for m in _serve_one(_Adaptive(), metrics, 400, caplog) if m.startswith("speculation off:")]
    assert len(said) == 1 and "plain steps" in said[0]
    assert _value(metrics, "jaxspec_speculation_k") == 0
    assert 'jaxspec_speculation_loops_total{k="0"}' in metrics.render()


def test_the_engine_thread_shortens_the_gil_switch_interval_and_never_lengthens_it(caplog):
    """Started, the scheduler bounds how long the HTTP threads keep the GIL from the engine thread after a device
    loop; an interval already shorter is kept."""
    import sys

    from jaxspec.serving.scheduler import GIL_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)  # Python's default
        _serve_one(_NeverAccepting(4), Metrics(2), 8, caplog)
        assert sys.getswitchinterval() == GIL_SWITCH_INTERVAL_S < 0.005
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S / 2)
        _serve_one(_NeverAccepting(4), Metrics(2), 8, caplog)
        assert sys.getswitchinterval() == GIL_SWITCH_INTERVAL_S / 2
    finally:
        sys.setswitchinterval(before)
