"""What generate shows a person: the prompt echoed (dimmed) only on a terminal, the speedup line with its spread."""

import io

from jaxspec.generate_display import DIM, RESET, echo_prompt, format_speedup
from jaxspec.speedup import SpeedupMeasurement


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_prompt_echoed_dimmed_on_a_terminal_only(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    tty, pipe = _Terminal(), io.StringIO()
    echo_prompt("def f(x):", tty)
    echo_prompt("def f(x):", pipe)
    assert tty.getvalue() == f"{DIM}def f(x):{RESET}" and pipe.getvalue() == ""
    monkeypatch.setenv("NO_COLOR", "1")
    plain = _Terminal()
    echo_prompt("def f(x):", plain)
    assert plain.getvalue() == "def f(x):"


def test_speedup_is_the_median_of_paired_rounds_with_its_range():
    m = SpeedupMeasurement(mode="stream", speculative_tokens_per_s=(200.0, 300.0, 240.0),
                           baseline_tokens_per_s=(100.0, 100.0, 200.0), baseline_steps=15, baseline_decode_s=0.1)
    assert m.speedups == (2.0, 3.0, 1.2) and m.speedup == 2.0 and m.rounds == 3
    d = m.as_dict()
    assert (d["speedup_min"], d["speedup_max"], d["decode_tokens_per_s"]) == (1.2, 3.0, 100.0)
    line = format_speedup(d)
    assert "speedup 2.00x (1.20-3.00x over 3 rounds)" in line and "both streamed" in line


def test_chat_answer_thinking_apart_and_tool_calls_as_json(monkeypatch):
    from jaxspec.generate_display import ChatDisplay
    from jaxspec.serving.assistant_output import AssistantOutputParser

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    answer = ("Need the weather.</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.w:0"
              '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
    call = '{"tool_call": {"id": "functions.w:0", "type": "function", "function": {"name": "w", "arguments": ' \
           '"{\\"city\\": \\"Paris\\"}"}}}\n'
    for out, err in ((_Terminal(), io.StringIO()), (io.StringIO(), io.StringIO())):
        parser, display = AssistantOutputParser(frozenset({"w"}), in_reasoning=True), ChatDisplay(out, err)
        for ch in answer:  # as it streams
            display.write(parser.push(ch))
        display.write(parser.finish())
        display.end()
        if out.isatty():  # thinking dimmed on the terminal, the answer on its own line, the call as JSON
            assert out.getvalue() == f"{DIM}Need the weather.{RESET}\nChecking.\n{call}" and err.getvalue() == ""
        else:  # a pipe gets the answer and the call; the thinking goes to stderr, undimmed
            assert out.getvalue() == f"Checking.\n{call}" and err.getvalue() == "Need the weather.\n"


def test_a_batch_answer_shows_as_the_streamed_one(monkeypatch):
    """`--batch-file --chat` writes each whole parsed answer: an answer without thinking (thinking off, or a plain
    tool call) gets no empty dimmed block, no blank line on stderr and no blank line before its call's JSON line."""
    from jaxspec.generate import parse_assistant_deltas
    from jaxspec.generate_display import ChatDisplay
    from jaxspec.serving.assistant_output import AssistantOutputParser, parse_assistant

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    call = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.w:0<|tool_call_argument_begin|>{}"
            "<|tool_call_end|><|tool_calls_section_end|>")
    for answer, in_reasoning in (("Hello.", False), (call, False), ("Hm.</think>Hello.", True)):
        for make in (_Terminal, io.StringIO):
            shown = []
            for batch in (False, True):
                out, err = make(), io.StringIO()
                display = ChatDisplay(out, err)
                if batch:
                    display.write(parse_assistant_deltas(parse_assistant(answer, frozenset({"w"}), in_reasoning)))
                else:
                    parser = AssistantOutputParser(frozenset({"w"}), in_reasoning)
                    display.write(parser.push(answer) + parser.finish())
                display.end()
                shown.append((out.getvalue(), err.getvalue()))
            assert shown[0] == shown[1], (answer, make)
