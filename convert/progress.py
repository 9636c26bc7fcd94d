"""Conversion progress: a tqdm bar over source bytes (rate and ETA), fed as tensors are read."""

from __future__ import annotations

import sys

import numpy as np
from tqdm import tqdm


def progress_bar(total_bytes: int, done_bytes: int, enabled: bool = True) -> tqdm:
    return tqdm(
        total=total_bytes, initial=done_bytes, unit="B", unit_scale=True, unit_divisor=1024,
        desc="convert", file=sys.stderr, disable=not enabled, dynamic_ncols=True, mininterval=0.5,
    )


class CountingSource:
    """A tensor source that reports the bytes of every tensor read to `on_bytes`."""

    def __init__(self, src, on_bytes):
        self.src, self.on_bytes = src, on_bytes

    def has(self, name: str) -> bool:
        return self.src.has(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.src.shape(name)

    def file_of(self, name: str):
        return self.src.file_of(name)

    def get(self, name: str) -> np.ndarray:
        x = self.src.get(name)
        self.on_bytes(x.nbytes)
        return x
