"""The draft vocabulary: the target's most frequent tokens, as EAGLE-3 drafters store it (d2t / t2d)."""

from __future__ import annotations

import numpy as np


def frequent_token_ids(stream: np.ndarray, vocab_size: int, draft_vocab_size: int) -> np.ndarray:
    """The `draft_vocab_size` most frequent target ids, ascending (ties broken by the lower id)."""
    counts = np.bincount(stream, minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
    return np.sort(order[:draft_vocab_size]).astype(np.int32)


def d2t_offsets(draft_to_target_ids: np.ndarray) -> np.ndarray:
    """d2t[i] = target id of draft id i, minus i (the on-disk form: target = draft + d2t[draft])."""
    return (draft_to_target_ids - np.arange(len(draft_to_target_ids))).astype(np.int64)


def t2d_mask(draft_to_target_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """t2d[v]: whether target id v is in the draft vocabulary."""
    mask = np.zeros(vocab_size, bool)
    mask[draft_to_target_ids] = True
    return mask


def coverage(stream: np.ndarray, draft_to_target_ids: np.ndarray, vocab_size: int) -> float:
    """Fraction of the stream's tokens the draft vocabulary can emit."""
    return float(t2d_mask(draft_to_target_ids, vocab_size)[stream].mean())
