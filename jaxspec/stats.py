"""Acceptance statistics: per-cycle accepted drafts -> acceptance length (accepted + 1) and histogram."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class AcceptanceStats:
    accepted_per_cycle: tuple[int, ...]  # all sequences' cycles, flattened

    @classmethod
    def from_lists(cls, accepted: list[list[int]]) -> "AcceptanceStats":
        return cls(tuple(a for row in accepted for a in row))

    @property
    def cycles(self) -> int:
        return len(self.accepted_per_cycle)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens each cycle yields: accepted drafts + the target's own token."""
        if not self.accepted_per_cycle:
            return float("nan")
        return float(np.mean(self.accepted_per_cycle)) + 1.0

    def histogram(self, k: int) -> list[int]:
        """histogram[a] = cycles that accepted exactly a drafts, a = 0..k."""
        return np.bincount(np.asarray(self.accepted_per_cycle, np.int64), minlength=k + 1)[: k + 1].tolist()

    def per_position_acceptance(self, k: int) -> list[float]:
        """P(draft i accepted) for i = 1..k, over all cycles."""
        a = np.asarray(self.accepted_per_cycle)
        if a.size == 0:
            return [float("nan")] * k
        return [float(np.mean(a >= i)) for i in range(1, k + 1)]
