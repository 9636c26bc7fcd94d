"""JSON read from untrusted files and flags (checkpoints, tokenizer files, cost tables, tool lists)."""

from __future__ import annotations

import json


def parse_json(text: str | bytes, **kwargs):
    """`json.loads`, with a document nested past the decoder's recursion limit refused as malformed: a ValueError,
    as every other malformed document is, where json.loads raises RecursionError (a traceback past every caller's
    one-line error)."""
    try:
        return json.loads(text, **kwargs)
    except RecursionError:
        raise ValueError("nested too deeply to decode") from None
