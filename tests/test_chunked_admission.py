"""A prompt longer than the prefill chunk is admitted a chunk at a time between device steps
(`SlotEngine.begin_admission` / `admit_chunk` / `finish_admission`, driven by the scheduler): it answers exactly as
the one-program prefill does, and the slots already running keep emitting while it is admitted."""

import numpy as np
import pytest

from jaxspec.sampling import SamplingParams
from jaxspec.serving.slot_engine import SlotEngine
from tests.sharded_pair import NUM_STEPS, sharded_pair

CHUNK = 16
LONG = [int(t) for t in np.random.default_rng(7).integers(1, 60, size=45)]  # 3 chunks, the last one partial


@pytest.fixture(scope="module")
def engine():
    cfg, w = sharded_pair()
    eng = SlotEngine(cfg, w, num_steps=NUM_STEPS, max_batch=4, max_context=96, cycles_per_step=2, prefill_chunk=CHUNK)
    eng.warm_up([16])
    return eng


def _run(engine, slot, steps=12):
    out = []
    for _ in range(steps):
        result = engine.step(np.zeros((engine.max_batch,), bool), any_sampled=True)
        out += result.tokens[slot]
        if result.done[slot]:
            break
    return out


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95)],
                         ids=["greedy", "sampled"])
def test_an_admission_in_chunks_answers_as_the_one_program_prefill(engine, sampling):
    assert engine.admits_in_chunks(LONG) and not engine.admits_in_chunks(LONG[:CHUNK])
    compiled = set(engine._programs)
    engine.reset()
    want_first, _ = engine.prefill(0, LONG, 20, sampling, seed=3)
    want = _run(engine, 0)
    engine.reset()
    a = engine.begin_admission(LONG, sampling, seed=3)
    chunks = 0
    while not a.prefilled:
        engine.admit_chunk(a)
        chunks += 1
    assert chunks == 3
    first, done = engine.finish_admission(0, a, 20)
    assert (first, done) == (want_first, False)
    assert _run(engine, 0) == want
    # the one-program prefill of this length compiled its bucket; the admission needed nothing the warm-up lacked
    assert set(engine._programs) - compiled <= {("prefill", 64, sampling.greedy)}


def test_finishing_before_the_last_chunk_is_refused(engine):
    a = engine.begin_admission(LONG, SamplingParams(), seed=0)
    engine.admit_chunk(a)
    with pytest.raises(ValueError, match="finished at position 16"):
        engine.finish_admission(0, a, 8)


class _Recording(SlotEngine):
    """The engine, with the order of its device calls kept (what the scheduler interleaves)."""

    calls: list

    def step(self, cancel, any_sampled):
        self.calls.append("step")
        return super().step(cancel, any_sampled)

    def admit_chunk(self, a):
        self.calls.append("chunk")
        return super().admit_chunk(a)


def test_the_scheduler_keeps_running_slots_emitting_while_a_long_prompt_is_admitted():
    import threading

    from jaxspec.serving.metrics import Metrics
    from jaxspec.serving.scheduler import Finished, Request, Scheduler, Tokens

    cfg, w = sharded_pair()
    engine = _Recording(cfg, w, num_steps=NUM_STEPS, max_batch=4, max_context=96, cycles_per_step=1,
                        prefill_chunk=CHUNK)
    engine.warm_up([16])
    engine.calls = []
    got, ended = {}, threading.Event()
    events = []

    def deliver(name):
        def on(event):
            events.append((name, event))
            if isinstance(event, Tokens):
                got.setdefault(name, []).extend(event.ids)
            elif name == "long":
                ended.set()
        return on

    scheduler = Scheduler(engine, Metrics(4), max_queue=8)
    scheduler.submit(Request([3, 9, 4], 60, SamplingParams(), 0, deliver("short")))
    scheduler.submit(Request(LONG, 8, SamplingParams(), 0, deliver("long")))
    scheduler.start()
    assert ended.wait(120)
    scheduler.stop(30)
    first_chunk = engine.calls.index("chunk")
    assert engine.calls[first_chunk:first_chunk + 6] == ["chunk", "step", "chunk", "step", "chunk", "step"]
    # the short request received tokens between the long prompt's first chunk and its first token
    long_first = next(i for i, (n, e) in enumerate(events) if n == "long" and isinstance(e, Tokens))
    assert any(n == "short" and isinstance(e, Tokens) for n, e in events[1:long_first])
    assert any(n == "long" and isinstance(e, Finished) for n, e in events)
    # and the long request answers as it would alone
    solo = SlotEngine(cfg, w, num_steps=NUM_STEPS, max_batch=4, max_context=96, cycles_per_step=1, prefill_chunk=CHUNK)
    first, _ = solo.prefill(0, LONG, 8, SamplingParams(), 0)
    want = [first]
    while len(want) < 8:
        result = solo.step(np.zeros((4,), bool), any_sampled=False)
        want += result.tokens[0]
    assert got["long"] == want[:8]
