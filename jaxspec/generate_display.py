"""What `python -m jaxspec.generate` shows a person: the prompt echoed before its continuation, a chat answer's
thinking apart from it and its tool calls as JSON, the speedup line."""

from __future__ import annotations

import math
import os
import json
from typing import TextIO

from jaxspec.serving.assistant_output import Content, Reasoning
from jaxspec.serving.kimi_tool_calls import ToolCall

DIM, RESET = "\x1b[2m", "\x1b[0m"


def echo_prompt(prompt: str, out: TextIO) -> None:
    """On a terminal, write the prompt (dimmed) so the continuation that follows reads in context. A pipe gets only
    the generated text, without escape codes; NO_COLOR (no-color.org) keeps the echo but drops the dimming."""
    if not out.isatty():
        return
    plain = os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb"
    out.write(prompt if plain else f"{DIM}{prompt}{RESET}")
    out.flush()


def format_speedup(b: dict) -> str:
    """The --baseline line from SpeedupMeasurement.as_dict()."""
    how = "both streamed" if b["mode"] == "stream" else "both in the on-device loop"
    head = (f"baseline (no speculation, same target; {how}, median of {b['rounds']} interleaved rounds): "
            f"{b['decode_tokens_per_s']:.1f} tok/s vs speculative {b['speculative_decode_tokens_per_s']:.1f} tok/s")
    if not math.isfinite(b["speedup"]):  # every plain run ended at the prefill's token (EOS first): nothing to time
        return f"{head} -> no speedup: plain decoding decoded no token after the prefill's in any round"
    spread = (f"{b['speedup_min']:.2f}-{b['speedup_max']:.2f}x over {b['rounds']} rounds" if b["rounds"] > 1
              else "1 round")
    return f"{head} -> speedup {b['speedup']:.2f}x ({spread})"


class ChatDisplay:
    """A chat answer as it streams: thinking dimmed on a terminal (to stderr in a pipe, so stdout holds only the
    answer), the answer as text, each tool call as one line of JSON once the model has closed it."""

    def __init__(self, out: TextIO, err: TextIO):
        self.out, self.err = out, err
        self.tty = out.isatty()
        self.dim = self.tty and not (os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb")
        self.last = None  # the kind of the last thing written: a change of kind starts a new line

    def write(self, deltas) -> None:
        for d in deltas:
            if isinstance(d, Reasoning):
                where = self.out if self.tty else self.err
                where.write(d.text if not self.dim or self.last is Reasoning else DIM + d.text)
                self.last = Reasoning
                continue
            self._leave_reasoning()
            if isinstance(d, Content):
                self.out.write(d.text)
                self.last = Content
            else:
                assert isinstance(d, ToolCall)
                if self.last is not None:
                    self.out.write("\n")
                self.out.write(json.dumps({"tool_call": d.as_openai()}, ensure_ascii=False) + "\n")
                self.last = ToolCall
        self.out.flush()
        self.err.flush()

    def end(self) -> None:
        self._leave_reasoning()
        self.out.flush()

    def _leave_reasoning(self) -> None:
        if self.last is Reasoning:
            if self.tty:
                self.out.write(RESET + "\n" if self.dim else "\n")
            else:
                self.err.write("\n")
            self.last = None
