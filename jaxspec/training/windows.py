"""Fixed-length token windows cut from a token stream (training batches, evaluation sets, prompts)."""

from __future__ import annotations

import numpy as np


def random_windows(stream: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """[batch, length] windows at uniform random offsets (they may span file boundaries)."""
    starts = rng.integers(0, len(stream) - length + 1, size=batch)
    return stream[starts[:, None] + np.arange(length)]


def tiled_windows(stream: np.ndarray, length: int, max_windows: int | None = None) -> np.ndarray:
    """Consecutive non-overlapping windows covering the stream (the remainder is dropped)."""
    n = len(stream) // length
    if max_windows is not None:
        n = min(n, max_windows)
    return stream[: n * length].reshape(n, length)


def file_prompts(files: list[np.ndarray], count: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """[count, length] prompts, each from one file at a random offset (files shorter than `length` skipped)."""
    long_enough = [f for f in files if len(f) >= length]
    if not long_enough:
        raise ValueError(f"no file has {length} tokens")
    picks = rng.integers(0, len(long_enough), size=count)
    out = np.empty((count, length), np.int32)
    for i, j in enumerate(picks):
        f = long_enough[j]
        start = rng.integers(0, len(f) - length + 1)
        out[i] = f[start : start + length]
    return out
