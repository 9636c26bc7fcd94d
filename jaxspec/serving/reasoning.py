"""Kimi's thinking: `<think>` ... `</think>` before the answer, returned apart as `reasoning_content`.

K2.5's chat template ends its generation prompt with `<think>` (thinking on, its default) or `<think></think>`
(`thinking=false`, instant mode), so with thinking on the model's output starts inside the reasoning and only the
closing tag appears; K2-Thinking's template ends at `<|im_middle|>` and the model writes both tags itself. Where
the reasoning starts is therefore read off the rendered prompt, not assumed. The model may also end its reasoning
by opening a tool-call section without `</think>` (vLLM's kimi_k2 reasoning parser accepts this): the scanner in
assistant_output.py treats the section's begin marker as the end of the reasoning.
"""

from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether the rendered prompt ends in an open `<think>`, so the completion starts inside the reasoning. Only its
    end is read: a `<think>` that a user wrote in a message (or an earlier turn left) is text, not the template's
    opening of this answer's reasoning."""
    return prompt_text.rstrip().endswith(THINK_OPEN)
