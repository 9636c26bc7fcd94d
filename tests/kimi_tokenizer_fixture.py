"""A small tokenizer in Kimi's real format: tiktoken.model (base64 token, rank) + tokenizer_config.json
with added_tokens_decoder for the 258 special ids and a Kimi-style chat template (test helper)."""

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
SPECIAL_NAMES = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                 "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"]


def write_kimi_tokenizer(directory: Path) -> int:
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
    decoder = {str(n + i): {"content": name, "special": True} for i, name in enumerate(SPECIAL_NAMES)}
    config = {
        "added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]",
        "chat_template": CHAT_TEMPLATE, "tokenizer_class": "TikTokenTokenizer",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return n + 258
