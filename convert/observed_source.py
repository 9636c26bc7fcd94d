"""A tensor source whose reads are shown to observers: the checks and the progress bar a conversion runs on every
tensor it reads, without a wrapper class each."""

from __future__ import annotations

from typing import Callable

import numpy as np

# observer(name, tensor, source): raises to refuse the tensor (naming `source.file_of(name)`), or returns
Observer = Callable[[str, np.ndarray, object], None]


class ObservedSource:
    """`src` (has / shape / file_of / get) with every tensor `get` returns shown to each observer first, in order."""

    def __init__(self, src, *observers: Observer):
        self.src, self.observers = src, observers

    def has(self, name: str) -> bool:
        return self.src.has(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.src.shape(name)

    def file_of(self, name: str):
        return self.src.file_of(name)

    def get(self, name: str) -> np.ndarray:
        x = self.src.get(name)
        for observe in self.observers:
            observe(name, x, self.src)
        return x
