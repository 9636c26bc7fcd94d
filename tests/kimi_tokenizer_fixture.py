"""A small tokenizer in Kimi's real format: tiktoken.model (base64 token, rank) + tokenizer_config.json
with added_tokens_decoder for the 258 special ids and a Kimi-style chat template, or one of the K2 family's real
templates (tests/kimi_chat_templates.py) (test helper).

The named specials sit at the offsets past the base vocabulary that Kimi K2's tokenizer_config.json gives them
(163584 + offset there: [BOS] 163584, <|im_end|> 163586, <|im_system|> 163594, the five tool-call markers
163595-163599, <|im_middle|> 163601, <think> / </think> 163606 / 163607, [UNK] / [PAD] 163838 / 163839); the
unnamed ones get `<|reserved_token_N|>` from the loader, as tokenization_kimi.py names them."""

from __future__ import annotations

import base64
import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"er", b" a", b"an", b"nd", b" and", b"de", b"def",
          b"  ", b"    ", b"re", b"return", b"ret", b"retu", b"retur", b"on", b"ion", b"es", b"is", b" is"]
SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
    7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>", 17: "<|im_middle|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}
SPECIAL_NAMES = list(SPECIAL_OFFSETS.values())


def write_kimi_tokenizer(directory: Path, chat_template: str = CHAT_TEMPLATE) -> int:
    """Write the files; return the total vocabulary (base + 258 specials)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokens = [bytes([i]) for i in range(256)]
    for m in MERGES:
        if m not in tokens:
            tokens.append(m)
    (directory / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens))
    )
    n = len(tokens)
    decoder = {str(n + i): {"content": name, "special": True} for i, name in SPECIAL_OFFSETS.items()}
    config = {
        "added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]",
        "chat_template": chat_template, "tokenizer_class": "TikTokenTokenizer",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return n + 258
