"""--chat-template-kwargs JSON and --thinking on|off: variables for the checkpoint's chat template, shared by
`generate --chat` and `serve` (where a request's `chat_template_kwargs` are laid over them).

Kimi-K2.5's template reads `thinking`: false renders `<think></think>` after the generation prompt (instant mode:
no reasoning), anything else `<think>` (the model reasons first). Other templates ignore variables they do not read.
"""

from __future__ import annotations

from convert.json_input import parse_json
from jaxspec.cli_common import UsageError

# variables the renderer itself sets: neither a flag nor a request may replace them
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                            "tools_ts_str")


def add_chat_template_flags(p) -> None:
    p.add_argument("--chat-template-kwargs", type=str, default=None, metavar="JSON",
                   help='variables for the chat template, a JSON object (\'{"thinking": false}\'; default none)')
    p.add_argument("--thinking", choices=["on", "off"], default=None,
                   help="Kimi-K2.5's thinking switch (the template's `thinking`; off = instant mode, no reasoning; "
                        "default: the template's, on for K2.5)")


def reserved_key(key) -> bool:
    return not isinstance(key, str) or not key.isidentifier() or key in RESERVED_TEMPLATE_KWARGS


def chat_template_kwargs(a) -> dict:
    """The flags' template variables (--thinking wins over a `thinking` in --chat-template-kwargs)."""
    kwargs = {}
    if a.chat_template_kwargs is not None:
        try:
            kwargs = parse_json(a.chat_template_kwargs)
        except ValueError as e:
            raise UsageError(f"--chat-template-kwargs: not valid JSON ({e})") from None
        if not isinstance(kwargs, dict):
            raise UsageError("--chat-template-kwargs must be a JSON object")
        bad = [k for k in kwargs if reserved_key(k)]
        if bad:
            raise UsageError(f"--chat-template-kwargs may not set {bad[0]!r} (the renderer sets "
                             f"{', '.join(RESERVED_TEMPLATE_KWARGS)}; keys are template variable names)")
    if a.thinking is not None:
        kwargs["thinking"] = a.thinking == "on"
    return kwargs
