"""What `python -m jaxspec.generate` shows a person: the prompt echoed before its continuation, the speedup line."""

from __future__ import annotations

import os
from typing import TextIO

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
    spread = (f"{b['speedup_min']:.2f}-{b['speedup_max']:.2f}x over {b['rounds']} rounds" if b["rounds"] > 1
              else "1 round")
    return (f"baseline (no speculation, same target; {how}, median of {b['rounds']} interleaved rounds): "
            f"{b['decode_tokens_per_s']:.1f} tok/s vs speculative {b['speculative_decode_tokens_per_s']:.1f} tok/s "
            f"-> speedup {b['speedup']:.2f}x ({spread})")
