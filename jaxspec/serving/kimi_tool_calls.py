"""Kimi K2's tool-call format: the marker tokens, and what makes one call's header and arguments valid.

The format (Moonshot's tool_call_guidance for Kimi-K2-Instruct; the same tokens in K2-Thinking's and K2.5's chat
templates, vLLM's kimi_k2 tool parser and SGLang's KimiK2Detector):

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>   (one or more)
    <|tool_calls_section_end|>

The header `functions.NAME:IDX` is the call's id: the chat templates write a tool call back with
`<|tool_call_begin|>{{ tool_call['id'] }}` and a tool result with `## Return of {{ tool_call_id }}`, so returning
the header itself as the OpenAI id keeps the conversation in the format the model was trained on (vLLM does the
same). The scanning over streamed text lives in assistant_output.py.
"""

from __future__ import annotations

import dataclasses
import json
import re

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)

FUNCTION_PREFIX = "functions."
# OpenAI's rule for a function name; a header is `functions.NAME:IDX` (the prefix and the index are optional here,
# as peers accept them: a model that drops one still names its function)
_HEADER = re.compile(r"(?:functions\.)?(?P<name>[A-Za-z0-9_.\-]{1,64}?)(?::(?P<index>\d{1,9}))?")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    index: int  # position among the response's tool calls
    id: str  # the model's header, e.g. functions.get_weather:0
    name: str  # without the functions. prefix and the :IDX suffix
    # the arguments as they were decoded, in order; two calls that differ only in where the text was cut are equal
    argument_pieces: tuple[str, ...] = dataclasses.field(compare=False)

    @property
    def arguments(self) -> str:
        return "".join(self.argument_pieces)

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_name(header: str, known: frozenset[str]) -> str | None:
    """The function a call header names, or None where the header is not `[functions.]NAME[:IDX]` or NAME is not
    among the request's tools (a model that invents a function has not called one of the client's)."""
    m = _HEADER.fullmatch(header.strip())
    if m is None or m["name"] not in known:
        return None
    return m["name"]


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def arguments_are_an_object(arguments: str) -> bool:
    """OpenAI clients json.loads a call's arguments into keyword arguments: they must be one JSON object. Python's
    json.loads also takes NaN, Infinity and -Infinity, which are not JSON (RFC 8259): a client that parses them
    with a strict parser (JavaScript's JSON.parse, Go's encoding/json) would fail, so they are refused here."""
    try:
        return isinstance(json.loads(arguments, parse_constant=_not_json), dict)
    except (ValueError, RecursionError):
        return False
