"""Tokenizer and generation files that travel beside the converted weights (the engine reads them there)."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_PATTERNS = (
    "tiktoken.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
    "chat_template.jinja",
    "*.jinja",
    "tokenization_*.py",
    "generation_config.json",
)


def tokenizer_files(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    found: dict[str, Path] = {}
    for pattern in TOKENIZER_PATTERNS:
        for p in sorted(directory.glob(pattern)):
            if p.is_file():
                found.setdefault(p.name, p)
    return list(found.values())


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy every tokenizer / chat-template / generation file of `src` into `dst`; returns their names."""
    copied = []
    for p in tokenizer_files(src):
        shutil.copy2(p, Path(dst) / p.name)
        copied.append(p.name)
    return copied
