"""A chat completion's text -> reasoning, content and tool calls, incrementally (for server-sent events) or whole.

The text arrives in pieces cut anywhere (a marker may straddle two pieces), so the tail that could still begin a
marker is held back until the next piece decides it. Reasoning and content are released as soon as they are known;
a tool call is released when the model closes it with `<|tool_call_end|>` and it is valid (a function among the
request's tools, arguments one JSON object), its arguments in the pieces in which they were decoded. A call is
released only once it is known valid, so that a streamed response and a whole one say the same thing and a
malformed call can still come back as plain content instead of as a call the client would try to run.

Malformed output never raises: a call naming an unknown function, with arguments that are not a JSON object, with
its markers out of order, or cut off (an unclosed section: a stop string or max_tokens inside it) is returned as
content, its raw text included, and is listed in `malformed` for the server's metrics.
"""

from __future__ import annotations

import dataclasses

from jaxspec.serving.kimi_tool_calls import (ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END, ToolCall,
                                             arguments_are_an_object, call_name)
from jaxspec.serving.reasoning import THINK_CLOSE, THINK_OPEN

# what /metrics counts, one label value each
UNKNOWN_FUNCTION = "unknown_function"
ARGUMENTS_NOT_JSON = "arguments_not_json"
MARKERS_OUT_OF_ORDER = "markers_out_of_order"
UNCLOSED_SECTION = "unclosed_section"
MALFORMED_KINDS = (UNKNOWN_FUNCTION, ARGUMENTS_NOT_JSON, MARKERS_OUT_OF_ORDER, UNCLOSED_SECTION)


@dataclasses.dataclass(frozen=True)
class Reasoning:
    text: str


@dataclasses.dataclass(frozen=True)
class Content:
    text: str


Delta = Reasoning | Content | ToolCall


@dataclasses.dataclass
class AssistantMessage:
    reasoning: str
    content: str
    tool_calls: list[ToolCall]
    malformed: list[str]


class AssistantOutputParser:
    """`push(text)` -> the deltas that text settles; `finish()` -> the rest, at the end of the output.

    `tools`: the names of the request's functions, or None to leave tool-call markers as plain text (no tools in
    the request, or tool_choice "none"). `in_reasoning`: the prompt left a `<think>` open."""

    def __init__(self, tools: frozenset[str] | None, in_reasoning: bool = False):
        self.tools = tools
        self.mode = "reasoning" if in_reasoning else "content"  # or "section"
        # A `<think>` opens the reasoning only as the model's first words (K2-Thinking writes its own): once the
        # answer has begun, or a reasoning or a section has come and gone, the tag is the answer's text (an answer
        # about think tags must not vanish into reasoning_content), as peers read only one leading reasoning block.
        self.may_open_reasoning = not in_reasoning
        self.held = ""  # a tail that may be the start of a marker
        self.calls: list[ToolCall] = []
        self.malformed: list[str] = []
        self._raw = ""  # the open call's raw text, from its begin marker
        self._between = ""  # a section's text outside its calls
        self._call: str | None = None  # inside a section: None between calls, "header" or "arguments"
        self._header = ""
        self._pieces: list[str] = []
        self._section_calls = 0  # calls settled (accepted or returned as content) in the open section

    # --- the markers each mode reacts to ----------------------------------------------------------------
    def _markers(self) -> tuple[str, ...]:
        if self.mode == "section":
            return (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
        tools = (SECTION_BEGIN,) if self.tools is not None else ()
        if self.mode == "reasoning":
            return (THINK_CLOSE,) + tools
        return ((THINK_OPEN,) if self.may_open_reasoning else ()) + tools

    def push(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        buf = self.held + text
        while True:
            markers = self._markers()
            hits = [(i, m) for m in markers if (i := buf.find(m)) >= 0]
            if not hits:
                break
            i, marker = min(hits)
            self._text(buf[:i], out)
            self._marker(marker, out)
            buf = buf[i + len(marker):]
        hold = max((n for m in self._markers() for n in range(1, len(m)) if buf.endswith(m[:n])), default=0)
        self.held = buf[len(buf) - hold:] if hold else ""
        self._text(buf[: len(buf) - hold], out)
        return _merged(out)

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        tail, self.held = self.held, ""
        self._text(tail, out)
        if self.mode == "section":
            # cut off (a stop string, max_tokens, or the model's end) inside the section: the open call, or an
            # empty section's begin marker, returns as the model wrote it
            if self._call is not None:
                out.append(Content(self._raw))
            elif self._section_calls == 0:
                out.append(Content(SECTION_BEGIN + self._between))
            else:
                self._flush_between(out)
            self.malformed.append(UNCLOSED_SECTION)
            self._call, self._raw, self._between, self.mode = None, "", "", "content"
        return _merged(out)

    # --- scanning ---------------------------------------------------------------------------------------
    def _text(self, text: str, out: list[Delta]) -> None:
        if not text:
            return
        if self.mode == "content":
            out.append(Content(text))
            self.may_open_reasoning = self.may_open_reasoning and not text.strip()
        elif self.mode == "reasoning":
            out.append(Reasoning(text))
        elif self._call is None:
            self._between += text
        else:
            self._raw += text
            if self._call == "header":
                self._header += text
            else:
                self._pieces.append(text)

    def _flush_between(self, out: list[Delta]) -> None:
        """Text between a section's markers: the model's whitespace is dropped with them; anything else was not
        meant for a marker's place and returns as content."""
        if self._between.strip():
            out.append(Content(self._between))
            self.malformed.append(MARKERS_OUT_OF_ORDER)
        self._between = ""

    def _marker(self, marker: str, out: list[Delta]) -> None:
        if self.mode != "section":
            if marker == THINK_OPEN and not self.may_open_reasoning:
                # found before the text ahead of it (scanned in the same piece) showed that the answer had begun
                self._text(marker, out)
                return
            self.may_open_reasoning = False
            if marker == SECTION_BEGIN:
                self.mode, self._call, self._between, self._section_calls = "section", None, "", 0
            else:  # <think> opens the reasoning, </think> closes it
                self.mode = "reasoning" if marker == THINK_OPEN else "content"
            return
        expected = {None: (CALL_BEGIN, SECTION_END), "header": (ARGUMENT_BEGIN,), "arguments": (CALL_END,)}[self._call]
        if marker not in expected:
            # the open call (or the stray marker) returns as content; a call or section marker still does its job
            self.malformed.append(MARKERS_OUT_OF_ORDER)
            if self._call is not None:
                out.append(Content(self._raw))
                self._call, self._raw = None, ""
                self._section_calls += 1
            if marker not in (CALL_BEGIN, SECTION_END):
                self._between += marker
                return
        if marker == CALL_BEGIN:
            self._flush_between(out)
            self._raw, self._call, self._header, self._pieces = marker, "header", "", []
        elif marker == ARGUMENT_BEGIN:
            self._raw += marker
            self._call = "arguments"
        elif marker == CALL_END:
            self._raw += marker
            self._settle_call(out)
        else:  # SECTION_END
            self._flush_between(out)
            self.mode = "content"

    def _settle_call(self, out: list[Delta]) -> None:
        name = call_name(self._header, self.tools or frozenset())
        if name is not None and arguments_are_an_object("".join(self._pieces)):
            call = ToolCall(len(self.calls), self._header.strip(), name, tuple(p for p in self._pieces if p))
            self.calls.append(call)
            out.append(call)
        else:
            self.malformed.append(UNKNOWN_FUNCTION if name is None else ARGUMENTS_NOT_JSON)
            out.append(Content(self._raw))
        self._call, self._raw = None, ""
        self._section_calls += 1


def _merged(deltas: list[Delta]) -> list[Delta]:
    """Adjacent text of one kind as one delta, empty text dropped."""
    out: list[Delta] = []
    for d in deltas:
        if isinstance(d, ToolCall):
            out.append(d)
        elif d.text:
            if out and type(out[-1]) is type(d):
                out[-1] = type(d)(out[-1].text + d.text)
            else:
                out.append(d)
    return out


def parse_assistant(text: str, tools: frozenset[str] | None, in_reasoning: bool = False) -> AssistantMessage:
    """The whole output at once: the same parser, fed once."""
    parser = AssistantOutputParser(tools, in_reasoning)
    return collect(parser, parser.push(text) + parser.finish())


def collect(parser: AssistantOutputParser, deltas: list[Delta]) -> AssistantMessage:
    reasoning = "".join(d.text for d in deltas if isinstance(d, Reasoning))
    content = "".join(d.text for d in deltas if isinstance(d, Content))
    return AssistantMessage(reasoning, content, list(parser.calls), list(parser.malformed))
