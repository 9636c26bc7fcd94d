"""The server's host-side pieces without a model: stop strings over streamed text, request validation, flags, the
queue's bound."""

import types

import numpy as np
import pytest

from jaxspec.sampling import SamplingParams
from jaxspec.serve import main as serve_main
from jaxspec.serving.app import _Text
from jaxspec.serving.metrics import Metrics
from jaxspec.serving.protocol import BadRequest, parse_chat, parse_completion
from jaxspec.serving.reasoning import prompt_opens_reasoning
from jaxspec.serving.scheduler import QueueFull, Request, Scheduler
from jaxspec.serving.stop import StopMatcher


def test_stop_matcher_holds_back_a_possible_start_and_cuts_at_the_first_stop():
    m = StopMatcher(("END", "xy"))
    assert m.push("abc E") == ("abc ", False)  # "E" may start "END"
    assert m.push("Nd") == ("ENd", False)  # it did not
    assert m.push(" x") == (" ", False)
    assert m.push("yz END") == ("", True)  # "xy" straddled two pushes: nothing of it is released
    m = StopMatcher(("END",))
    assert m.push("tail EN") == ("tail ", False)
    assert m.flush() == "EN"
    assert StopMatcher(()).push("free") == ("free", False)


class _CountedSlices(str):
    """A stop string that counts the prefixes taken of it."""
    slices = 0

    def __getitem__(self, key):
        _CountedSlices.slices += 1
        return str.__getitem__(self, key)


def test_a_long_stop_string_costs_a_push_no_more_than_the_text_it_sees():
    """Stop strings are matched on the event loop, per token: a client's stop string of megabytes (well within the
    body's limit) must not have every one of its prefixes tried at each push, which took time in its length squared
    and froze every other request for minutes. The prefixes a push tries follow the text it holds."""
    _CountedSlices.slices = 0
    stop = _CountedSlices("a" * 10 ** 4)
    m = StopMatcher((stop, "END"))
    pushes = ("x", "aa", "E", "b")
    assert [m.push(t) for t in pushes] == [("x", False), ("", False), ("aa", False), ("Eb", False)]
    assert m.push("aa") == ("", False) and m.flush() == "aa"
    assert _CountedSlices.slices <= sum(len(t) + 2 for t in pushes) + 4  # every prefix: 10 ** 4 a push


def test_completion_fields_and_defaults():
    r = parse_completion({"prompt": "hi", "max_tokens": 5, "temperature": 0, "stop": "x", "top_k": -1, "seed": 3})
    assert (r.prompt, r.max_tokens, r.sampling.greedy, r.sampling.top_k, r.stop, r.seed) == ("hi", 5, True, 0, ("x",), 3)
    d = parse_completion({"prompt": [1, 2]})
    assert d.max_tokens == 16 and d.sampling.temperature == 1.0 and d.prompt == [1, 2] and not d.stream
    assert parse_completion({"prompt": ["one"]}).prompt == "one"


@pytest.mark.parametrize("body, param", [
    ([1], None), ({"prompt": True}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"), ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"), ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "seed": -1}, "seed"), ({"prompt": "x", "n": 3}, "n"), ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "stream": "yes"}, "stream"), ({"prompt": "x", "stop": ["s"] * 17}, "stop"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "top_k": 2 ** 31}, "top_k"),  # past the int32 it travels as: a 400, not a failed prefill
    # what would change or constrain the sampled tokens, refused rather than ignored
    ({"prompt": "x", "response_format": {"type": "json_object"}}, "response_format"),
    ({"prompt": "x", "repetition_penalty": 1.2}, "repetition_penalty"),
    ({"prompt": "x", "min_tokens": 8}, "min_tokens"),
    ({"prompt": "x", "stop_token_ids": [5]}, "stop_token_ids"), ({"prompt": "x", "ignore_eos": True}, "ignore_eos"),
    ({"prompt": "x", "guided_regex": "[0-9]+"}, "guided_regex"),
])
def test_bad_completion_fields_name_the_field(body, param):
    with pytest.raises(BadRequest) as e:
        parse_completion(body)
    assert e.value.param == param


def test_neutral_values_of_the_refused_fields_are_taken():
    r = parse_completion({"prompt": "x", "response_format": {"type": "text"}, "repetition_penalty": 1, "min_tokens": 0,
                          "stop_token_ids": [], "ignore_eos": False})
    assert r.prompt == "x"


def test_chat_messages():
    r = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                                            "text": "b"}]}],
                    "max_completion_tokens": 7})
    assert r.prompt == [{"role": "user", "content": "ab"}] and r.max_tokens == 7
    assert parse_chat({"messages": [{"role": "user", "content": "hi"}]}).max_tokens is None
    for bad in ({"messages": []}, {"messages": [{"content": "x"}]}, {"messages": [{"role": "user", "content": 5}]}):
        with pytest.raises(BadRequest):
            parse_chat(bad)


@pytest.mark.parametrize("argv", [["--max-batch", "0"], ["--port", "70000"], ["--speculative-eagle-topk", "2"],
                                  ["--warmup-buckets", "a"], ["--prefill-chunk", "24"], ["--no-such-flag"],
                                  ["--model", "/nonexistent/dir"]])
def test_serve_flag_errors_are_one_line_exit_2(argv, capsys):
    assert serve_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")


def test_requests_whose_clients_gave_up_hold_no_place_in_the_queue():
    """A full queue of cancelled requests takes a new one at once, though the engine thread (not started here: busy
    in a long prefill) has not dropped them; a full queue of live ones refuses it."""
    engine = types.SimpleNamespace(cfg=types.SimpleNamespace(eos_ids=()))
    scheduler = Scheduler(engine, Metrics(max_batch=2), max_queue=3)

    def request():
        return Request([1, 2], 4, SamplingParams(), 0, lambda event: None)

    waiting = [request() for _ in range(3)]
    for r in waiting:
        scheduler.submit(r)
    with pytest.raises(QueueFull, match="3 requests are already waiting"):
        scheduler.submit(request())
    for r in waiting[:2]:
        scheduler.cancel(r)
    scheduler.submit(request())  # two places free: the cancelled requests left the queue
    scheduler.submit(request())
    with pytest.raises(QueueFull):
        scheduler.submit(request())


class _DeviceSlots:
    """An engine without a model that keeps which slots the device would compute as live (admitted, not yet done
    or cancelled), and notes every step that runs a live slot the scheduler holds no request in."""

    max_batch = 2
    cache_pages = None

    def __init__(self):
        self.cfg = types.SimpleNamespace(eos_ids=())
        self.prefix = types.SimpleNamespace(stats=lambda: {})
        self.choose_k = lambda last: 0
        self.live, self.left, self.orphans, self.scheduler = [False] * 2, [0] * 2, [], None

    def admits_in_chunks(self, tokens):
        return False

    def has_room(self, prompt_len, max_new):
        return True

    def pages_short(self):
        return 0

    def slots_to_preempt(self):
        return []

    def free_slots(self, slots):
        pass

    def prefill(self, slot, tokens, max_new, sampling, seed):
        self.live[slot], self.left[slot] = max_new > 1, max_new - 1
        return 1, max_new <= 1

    def step(self, cancel, any_sampled):
        from jaxspec.serving.slot_engine import StepResult

        self.live = [live and not c for live, c in zip(self.live, cancel)]
        self.orphans += [s for s, live in enumerate(self.live) if live and s not in self.scheduler._active]
        tokens = [[1] if live else [] for live in self.live]
        self.left = [n - len(t) for n, t in zip(self.left, tokens)]
        self.live = [live and n > 0 for live, n in zip(self.live, self.left)]
        return StepResult(tokens, np.array([not live for live in self.live]), 0, sum(map(len, tokens)), 1, 0)


def test_a_cancelled_slot_stops_on_the_device_though_no_step_ran_when_it_was_freed():
    """The last running request is cancelled: its slot is freed with no step to end it on the device. The next
    step, once a new request arrives in another slot, must still end it, or the device goes on decoding the
    cancelled request (its whole budget of cycles, counted in the acceptance figures the adaptive K reads)."""
    import threading

    from jaxspec.serving.scheduler import Finished, Tokens

    engine = _DeviceSlots()
    requests, ended = {}, threading.Event()

    class _Metrics(Metrics):
        def occupancy(self, queued, active):  # the late request arrives once the cancelled one's slot is freed
            super().occupancy(queued, active)
            if requests["b"].cancelled and not active and "c" not in requests:
                requests["c"] = Request([1], 3, SamplingParams(), 0, deliver("c"))
                scheduler.submit(requests["c"])

    def deliver(name):
        def on(event):
            if name == "b" and isinstance(event, Tokens) and len(requests["b"].generated) > 1:
                scheduler.cancel(requests["b"])  # the client leaves after its second token
            if name == "c" and isinstance(event, Finished):
                ended.set()
        return on

    scheduler = engine.scheduler = Scheduler(engine, _Metrics(max_batch=2), max_queue=4)
    requests["a"] = Request([1], 2, SamplingParams(), 0, deliver("a"))  # slot 0: done after one step
    requests["b"] = Request([1], 100, SamplingParams(), 0, deliver("b"))  # slot 1: cancelled after that step
    scheduler.submit(requests["a"])
    scheduler.submit(requests["b"])
    scheduler.start()
    assert ended.wait(30)
    scheduler.stop(10)
    assert requests["c"].generated == [1, 1, 1]
    assert engine.orphans == []


def _text(stops, pieces):
    """A request's _Text over a tokenizer whose token i decodes to pieces[i]."""
    tokenizer = types.SimpleNamespace(decode=lambda ids: "".join(pieces[i] for i in ids))
    service = types.SimpleNamespace(tokenizer=tokenizer, scheduler=types.SimpleNamespace(eos_ids=frozenset()))
    return _Text(service, stops)


def test_a_stop_string_ends_the_count_and_the_text_at_the_token_that_completes_it():
    """A device step hands over several tokens at once: usage counts those up to the token that completed the stop
    string (not the ones decoded past it, which the client never sees), and which stop string wins does not depend
    on how the tokens were grouped into steps."""
    pieces = ["im", "port", " sys", "\n", "import", " os", "\n"]
    text = _text(("sys",), pieces)
    assert text.push([0]) == ("im", False)
    assert text.push([1, 2, 3, 4, 5]) == ("port ", True) and text.tokens == 3
    grouped, one_by_one = _text(("abcd", "c"), ["a", "b", "c", "d"]), _text(("abcd", "c"), ["a", "b", "c", "d"])
    assert grouped.push([0, 1, 2, 3]) == ("ab", True) and grouped.tokens == 3
    assert [one_by_one.push([i]) for i in range(3)] == [("", False), ("", False), ("ab", True)]


def test_a_think_tag_in_a_message_does_not_open_the_reasoning():
    """Only a prompt that ends in an open <think> (K2.5's generation prompt) starts the answer inside the reasoning:
    a user who writes the tag in a message gets the answer as content."""
    assert prompt_opens_reasoning("<|im_assistant|>assistant<|im_middle|><think>")
    assert not prompt_opens_reasoning("<|im_assistant|>assistant<|im_middle|><think></think>")
    assert not prompt_opens_reasoning("# user: what does <think> do?\n# assistant:\n")
