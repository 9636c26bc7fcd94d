"""What a generation returns: its tokens, acceptance, timings and, with adaptive speculation, the K it chose."""

from __future__ import annotations

import dataclasses

from jaxspec.stats import AcceptanceStats


@dataclasses.dataclass
class AdaptiveReport:
    """What adaptive speculation chose and what it expected (jaxspec.adaptive)."""
    steps: tuple[int, ...]  # the compiled K set
    costs_s: tuple[float, ...]  # t(K) per cycle for each K of the set
    cost_source: str  # "measured", "cached" or "given"
    measure_s: float  # wall time spent measuring the costs (0 when cached or given)
    k_per_cycle: list[int]  # the K each cycle ran
    expected_tokens: float  # the model's E[tokens] summed over the cycles run
    expected_s: float  # t(K) summed over the cycles run
    first_run_s: float = 0.0  # the price of a branch's first run in a call (jaxspec.adaptive_costs.Measured)
    # per sequence, c_j for j = 1..max(steps) as the rule estimated them after the last cycle (its discounted counts
    # of drafted cycles and of the free observations of c_1 that plain stretches' catch-ups make, shrunk towards the
    # prior): what its last choices were made on
    acceptance_estimate: list[list[float]] = dataclasses.field(default_factory=list)
    calls: int = 0  # device calls of the decode loop (adaptive by call; 0 where not counted)

    @property
    def k_histogram(self) -> dict[int, int]:
        return {k: self.k_per_cycle.count(k) for k in self.steps}

    @property
    def expected_tokens_per_s(self) -> float:
        return self.expected_tokens / self.expected_s if self.expected_s > 0 else float("nan")


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated tokens per sequence (EOS included when hit)
    accepted: list[list[int]]  # drafts accepted per cycle, per sequence (empty for the baseline)
    prompt_tokens: list[int]
    prefill_s: float
    decode_s: float  # from the first decode call to the generated tokens on the host
    compile_s: float
    cycles: int  # speculative cycles or baseline steps run after prefill
    adaptive: AdaptiveReport | None = None  # with an adaptive engine: the K chosen per cycle, expected vs achieved

    @property
    def stats(self) -> AcceptanceStats:
        """Acceptance over the cycles that drafted (an adaptive engine's K = 0 cycles accept nothing by design)."""
        if self.adaptive is None:
            return AcceptanceStats.from_lists(self.accepted)
        ks = self.adaptive.k_per_cycle
        return AcceptanceStats.from_lists([[a for a, k in zip(row, ks) if k > 0] for row in self.accepted])

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        # tokens emitted after prefill (the first token comes out of the prefill)
        n = sum(max(len(t) - 1, 0) for t in self.tokens)
        return n / self.decode_s if self.decode_s > 0 else float("nan")
