"""Speculative decoding against plain decoding on the same target (`generate --baseline`), measured fairly.

One timed run says little on a shared machine: the two kinds of run are repeated in interleaved rounds (the order
alternating, so drift in the machine's speed falls on both alike), timed the same way (both streamed or both in the
on-device loop), after a warm-up run of each. Each round gives a speedup, the ratio of the two runs' decode rates;
the figure reported is their median, with the smallest and largest beside it.

A speculative cycle yields `mean acceptance length` tokens for at least the cost of one plain step (it runs the
target over K + 1 positions where the step runs it over one), so the speedup cannot honestly exceed the mean
acceptance length; a figure above it means the two runs were not timed alike.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports this module before JAX, to answer --help and flag errors quickly
    from jaxspec.engine import Engine, GenerationResult
    from jaxspec.sampling import SamplingParams

DEFAULT_ROUNDS = 5


@dataclasses.dataclass(frozen=True)
class SpeedupMeasurement:
    mode: str  # "stream" or "device loop"
    speculative_tokens_per_s: tuple[float, ...]  # one per round
    baseline_tokens_per_s: tuple[float, ...]
    baseline_steps: int
    baseline_decode_s: float  # median over rounds
    # the speculative runs' cycles and decode time (median over rounds), timed as the baseline's steps are: what a
    # cycle costs in plain steps
    speculative_cycles: int | None = None
    speculative_decode_s: float | None = None

    @property
    def rounds(self) -> int:
        return len(self.speedups)

    @property
    def speedups(self) -> tuple[float, ...]:
        # a plain run that decoded nothing after the prefill's token (EOS first) has rate 0: that round has no ratio
        return tuple(s / b if b > 0 else float("nan")
                     for s, b in zip(self.speculative_tokens_per_s, self.baseline_tokens_per_s))

    @property
    def speedup(self) -> float:
        return statistics.median(self._finite_speedups) if self._finite_speedups else float("nan")

    @property
    def _finite_speedups(self) -> tuple[float, ...]:
        """The rounds that have a ratio (min, max and the median of NaN depend on the rounds' order)."""
        return tuple(x for x in self.speedups if math.isfinite(x))

    def as_dict(self) -> dict:
        return {
            "decode_tokens_per_s": statistics.median(self.baseline_tokens_per_s),
            "decode_s": self.baseline_decode_s,
            "steps": self.baseline_steps,
            "speculative_decode_tokens_per_s": statistics.median(self.speculative_tokens_per_s),
            "speculative_decode_s": self.speculative_decode_s,
            "speculative_cycles": self.speculative_cycles,
            "speedup": self.speedup,
            "speedup_min": min(self._finite_speedups, default=float("nan")),
            "speedup_max": max(self._finite_speedups, default=float("nan")),
            "rounds": self.rounds,
            "mode": self.mode,
        }


def _timed_run(engine: Engine, prompts, max_new_tokens, sampling, seed, speculative: bool,
               streamed: bool) -> GenerationResult:
    if streamed:
        *_, result = engine.stream(prompts, max_new_tokens, sampling, seed=seed, speculative=speculative)
        return result
    return engine.generate(prompts, max_new_tokens, sampling, seed=seed, speculative=speculative)


def measure_speedup(engine: Engine, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams,
                    seed: int, *, streamed: bool, rounds: int = DEFAULT_ROUNDS) -> SpeedupMeasurement:
    """Interleaved rounds of a speculative and a plain run of the same prompts (the engine needs K >= 1)."""
    if engine.k < 1:
        raise ValueError("a speedup over plain decoding needs speculation (num_steps >= 1)")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")

    def run(speculative: bool) -> GenerationResult:
        return _timed_run(engine, prompts, max_new_tokens, sampling, seed, speculative, streamed)

    run(True), run(False)  # warm-up (and compilation) of both
    spec, base = [], []
    for r in range(rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        for speculative in order:
            (spec if speculative else base).append(run(speculative))
    return SpeedupMeasurement(
        mode="stream" if streamed else "device loop",
        speculative_tokens_per_s=tuple(x.decode_tokens_per_s for x in spec),
        baseline_tokens_per_s=tuple(x.decode_tokens_per_s for x in base),
        baseline_steps=base[-1].cycles,
        baseline_decode_s=statistics.median(x.decode_s for x in base),
        speculative_cycles=spec[-1].cycles,
        speculative_decode_s=statistics.median(x.decode_s for x in spec),
    )
