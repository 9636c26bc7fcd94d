"""Tokenizer and generation files that travel beside the converted weights (the engine reads them there).

Each one must resolve to a regular file inside the source directory: a symlink leaving it (to /etc/shadow,
say) would otherwise put that file into a checkpoint that gets shared."""

from __future__ import annotations

import shutil
from pathlib import Path

from convert.safe_paths import file_inside

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
            if p.name not in found and (p.is_file() or p.is_symlink()):
                found[p.name] = file_inside(directory, p.name, "tokenizer file")
    return list(found.values())


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy every tokenizer / chat-template / generation file of `src` into `dst`; returns their names."""
    copied = []
    for p in tokenizer_files(src):
        shutil.copyfile(p.resolve(), Path(dst) / p.name)
        copied.append(p.name)
    return copied
