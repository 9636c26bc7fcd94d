"""Conversion progress: a tqdm bar over source bytes (rate and ETA), fed as tensors are read."""

from __future__ import annotations

import sys

from tqdm import tqdm


def progress_bar(total_bytes: int, done_bytes: int, enabled: bool = True) -> tqdm:
    return tqdm(
        total=total_bytes, initial=done_bytes, unit="B", unit_scale=True, unit_divisor=1024,
        desc="convert", file=sys.stderr, disable=not enabled, dynamic_ncols=True, mininterval=0.5,
    )


def count_bytes(bar: tqdm):
    """An `ObservedSource` observer that advances `bar` by each tensor's bytes."""
    return lambda name, x, source: bar.update(x.nbytes)
