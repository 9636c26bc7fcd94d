"""Whether speculation paid in a generation, said in one plain line with the figures that decide it.

A speculative cycle of K drafts yields E[tokens | K] = 1 + sum_{j<=K} prod_{i<=j} c_i tokens (c_j: the conditional
acceptance of draft position j) and costs t(K) / t(0) plain decode steps, each of which yields one token, so
speculating at K pays exactly when E[tokens | K] > t(K) / t(0). The verdict puts these two figures side by side:

- Adaptive runs (jaxspec.adaptive): the rule's own acceptance estimate at the end of the run (its discounted
  counts, including the free observations of c_1 that plain stretches make) against its cost table. Speculation
  is "off" when the run ended in plain steps and no K of the compiled set would pay at that estimate; the line
  gives the cycles that ran plain, what the drafted cycles accepted, the estimate and the cost table in plain steps.
  A run that ended speculating gets a line too where its figures prove a loss: no draft accepted in 8 or more
  drafted cycles (the estimate, shrunk towards the prior, never reaches 0, so a K whose cycle costs little more
  than a plain step can stay chosen for a drafter that never matches), or --baseline measured it slower than plain
  decoding (the cost table was wrong for this run).
- Fixed-K runs: only a measured baseline (`generate --baseline`) shows a loss (speedup < 1), and then the line gives
  the speedup, the mean acceptance length and the cycle's cost in plain steps (the speculative rounds' ms per cycle
  over the plain rounds' ms per step, both medians of the same interleaved rounds). Without a baseline the one loss
  the figures prove is a drafter whose drafts were never accepted: every cycle then yields the single token a plain
  step yields, at a cycle's cost, which is never below a step's.

`paid` is True or False only where the figures back it, None otherwise (no cycles, no plain step in the compiled
set to compare with, a cost table that was never measured, or a run whose end and figures disagree).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports this module before JAX (and numpy), to answer --help and flag errors quickly
    from jaxspec.generation_result import AdaptiveReport, GenerationResult

# cycles with nothing accepted before "no draft was accepted" is said without a measured baseline: a few say little
# about a drafter, and cost little
NEVER_ACCEPTED_MIN_CYCLES = 8
ADAPTIVE_HINT = ("adaptive speculation (the default; drop --no-speculative-adaptive) chooses K and falls back to plain "
                 "decoding where speculation does not pay")


@dataclasses.dataclass(frozen=True)
class Verdict:
    paid: bool | None  # None: the figures do not decide it
    reason: str | None  # one line for the user where speculation did not pay; None otherwise
    figures: dict  # what the line is made of (JSON-ready)

    def as_dict(self) -> dict:
        return {"paid": self.paid, "reason": self.reason, "figures": self.figures}


def position_counts(accepted: list[list[int]], k_per_cycle: list[int] | int) -> tuple[list[int], list[int]]:
    """(accepted, observed) per draft position j = 1..max K over every sequence's drafting cycles: a cycle that drafted
    K and accepted a observes positions 1..min(a + 1, K), accepted up to a. `k_per_cycle`: each cycle's K (adaptive)
    or one K for all (fixed); cycles with K = 0 drafted nothing."""
    k_max = max(k_per_cycle, default=0) if isinstance(k_per_cycle, list) else k_per_cycle
    hits, trials = [0] * k_max, [0] * k_max
    for row in accepted:
        ks = k_per_cycle if isinstance(k_per_cycle, list) else [k_per_cycle] * len(row)
        for a, k in zip(row, ks):
            for j in range(1, min(a + 1, k) + 1):
                trials[j - 1] += 1
                hits[j - 1] += int(a >= j)
    return hits, trials


def expected_tokens_per_cycle(estimate_J: list[float], k: int) -> float:
    """E[tokens | K] = 1 + sum_{j<=K} prod_{i<=j} c_i."""
    tokens, reach = 1.0, 1.0
    for c in estimate_J[:k]:
        reach *= c
        tokens += reach
    return tokens


def _figures(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def _per_position(hits: list[int], trials: list[int]) -> list[float | None]:
    return [h / t if t else None for h, t in zip(hits, trials)]


def _observed_positions(rates: list[float | None]) -> str:
    """The measured per-position acceptance up to the deepest position observed."""
    shown = rates[: max((j + 1 for j, r in enumerate(rates) if r is not None), default=0)]
    return " ".join("n/a" if r is None else f"{r:.2f}" for r in shown)


def adaptive_verdict(report: AdaptiveReport, accepted: list[list[int]], baseline: dict | None = None) -> Verdict:
    """The verdict on an adaptive run: its K per cycle, cost table and the rule's final acceptance estimate
    (`report.acceptance_estimate`, one row per sequence), the drafted cycles' outcomes in `accepted`."""
    ks, steps = report.k_per_cycle, list(report.steps)
    hits, trials = position_counts(accepted, ks)
    plain = ks.count(0)
    figures = {"cycles": len(ks), "plain_cycles": plain, "drafting_cycles": len(ks) - plain,
               "first_drafts": trials[0] if trials else 0, "first_drafts_accepted": hits[0] if hits else 0,
               "per_position_acceptance": _per_position(hits, trials), "estimate": None,
               "cost_in_plain_steps": None, "expected_tokens_per_cycle": None,
               "speedup": None if baseline is None else baseline["speedup"]}
    measured = report.cost_source in ("measured", "cached", "given") and len(report.costs_s) == len(steps)
    if not ks or 0 not in steps or not measured or not report.acceptance_estimate:
        return Verdict(None, None, figures)
    # the batch's throughput is the sum over its sequences: their mean E[tokens | K] against t(K) / t(0)
    estimate_J = [statistics.fmean(col) for col in zip(*report.acceptance_estimate)]
    t0 = report.costs_s[steps.index(0)]
    ratio = {k: c / t0 for k, c in zip(steps, report.costs_s)}
    gain = {k: statistics.fmean(expected_tokens_per_cycle(row, k) for row in report.acceptance_estimate) for k in steps}
    figures.update(estimate=estimate_J, cost_in_plain_steps={str(k): r for k, r in ratio.items()},
                   expected_tokens_per_cycle={str(k): g for k, g in gain.items()})
    pays = {k: gain[k] > ratio[k] for k in steps if k > 0}
    if ks[-1] == 0 and not any(pays.values()):
        return Verdict(False, _off_line(report, estimate_J, ratio, gain, hits, trials), figures)
    if ks[-1] > 0 and trials and trials[0] >= NEVER_ACCEPTED_MIN_CYCLES and hits[0] == 0:
        # the estimate never reaches 0 (it is shrunk towards the prior), so a K cheap enough keeps being chosen
        return Verdict(False, _kept_drafting_line(report, estimate_J, ratio, gain, trials), figures)
    if ks[-1] > 0 and any(pays.values()):
        if baseline is not None and baseline["speedup"] < 1.0:
            return Verdict(False, _slower_despite_rule_line(report, estimate_J, ratio, baseline), figures)
        return Verdict(True, None, figures)
    return Verdict(None, None, figures)


def _off_line(report: AdaptiveReport, estimate_J, ratio, gain, hits, trials) -> str:
    ks, steps = report.k_per_cycle, report.steps
    k1 = min(k for k in steps if k > 0)
    if trials and trials[0]:
        seen = (f"the drafter's first draft was accepted {hits[0]} of the {trials[0]} times it was drafted "
                f"({100 * hits[0] / trials[0]:.0f}%; per-position acceptance "
                f"{_observed_positions(_per_position(hits, trials))}; the rule's estimate at the end "
                f"c_1..c_{len(estimate_J)} = {_figures(estimate_J)})")
    else:
        seen = (f"no cycle drafted, and the rule's estimate of the drafter's acceptance at the end is "
                f"c_1..c_{len(estimate_J)} = {_figures(estimate_J)}")
    return (f"speculation off for {ks.count(0)} of {len(ks)} cycles: {seen}; a K={k1} cycle costs {ratio[k1]:.2f} "
            f"plain steps for {gain[k1]:.2f} expected tokens (K={', '.join(map(str, steps))}: cost in plain steps "
            f"{_figures([ratio[k] for k in steps])}, expected tokens per cycle {_figures([gain[k] for k in steps])})"
            f": speculating would not pay")


def _kept_drafting_line(report: AdaptiveReport, estimate_J, ratio, gain, trials) -> str:
    steps = report.steps
    k1 = min(k for k in steps if k > 0)
    return (f"speculation did not pay: the drafter's first draft was accepted 0 of the {trials[0]} times it was "
            f"drafted, so each drafting cycle yielded one token, yet the rule kept drafting: its estimate at the end "
            f"c_1..c_{len(estimate_J)} = {_figures(estimate_J)}, shrunk towards its prior, expects {gain[k1]:.2f} "
            f"tokens from a K={k1} cycle that costs {ratio[k1]:.2f} plain steps (K={', '.join(map(str, steps))}: "
            f"cost in plain steps {_figures([ratio[k] for k in steps])}, expected tokens per cycle "
            f"{_figures([gain[k] for k in steps])})")


def _slower_despite_rule_line(report: AdaptiveReport, estimate_J, ratio, baseline: dict) -> str:
    ks, steps = report.k_per_cycle, report.steps
    return (f"speculation ran slower than plain decoding: speedup {baseline['speedup']:.2f}x "
            f"({_spread(baseline)}) while the rule drafted in {len(ks) - ks.count(0)} of {len(ks)} cycles, "
            f"expecting it to pay from its cost table (K={', '.join(map(str, steps))}: cost in plain steps "
            f"{_figures([ratio[k] for k in steps])}) and acceptance estimate (c_1..c_{len(estimate_J)} = "
            f"{_figures(estimate_J)})")


def _spread(baseline: dict) -> str:
    if baseline["rounds"] > 1:
        return f"{baseline['speedup_min']:.2f}-{baseline['speedup_max']:.2f}x over {baseline['rounds']} rounds"
    return "1 round"


def fixed_verdict(k: int, accepted: list[list[int]], cycles: int, baseline: dict | None = None) -> Verdict:
    """The verdict on a fixed-K run of `cycles` cycles from its drafts' outcomes (`accepted`, per sequence per
    cycle) and, with --baseline, the measured rounds (`jaxspec.speedup.SpeedupMeasurement.as_dict()`)."""
    drafted = sum(len(row) for row in accepted)  # a sequence's cycles end with it
    mal = 1.0 + sum(map(sum, accepted)) / drafted if drafted else None
    figures = {"k": k, "cycles": cycles, "mean_acceptance_length": mal, "speedup": None, "ms_per_cycle": None,
               "ms_per_plain_step": None, "cycle_cost_in_plain_steps": None}
    if not drafted:
        return Verdict(None, None, figures)
    if baseline is not None:
        figures["speedup"] = baseline["speedup"]
        cost = ""
        if baseline.get("speculative_cycles") and baseline["steps"]:  # the rounds' medians, timed alike
            ms_step = 1000.0 * baseline["decode_s"] / baseline["steps"]
            ms_cycle = 1000.0 * baseline["speculative_decode_s"] / baseline["speculative_cycles"]
            figures.update(ms_per_cycle=ms_cycle, ms_per_plain_step=ms_step,
                           cycle_cost_in_plain_steps=ms_cycle / ms_step)
            cost = (f"; a K={k} cycle took {ms_cycle / ms_step:.2f} plain steps ({ms_cycle:.3f} ms per cycle against "
                    f"{ms_step:.3f} ms per plain step, medians of the rounds)")
        if baseline["speedup"] >= 1.0:
            return Verdict(True, None, figures)
        return Verdict(False, f"speculation ran slower than plain decoding: speedup {baseline['speedup']:.2f}x "
                              f"({_spread(baseline)}) at mean acceptance length {mal:.2f}{cost}: {ADAPTIVE_HINT}",
                       figures)
    if mal == 1.0 and cycles >= NEVER_ACCEPTED_MIN_CYCLES:
        return Verdict(False, f"speculation did not pay: no draft was accepted in {cycles} cycles (mean acceptance "
                              f"length 1.00 at K={k}), so each cycle yielded the one token a plain step yields, at "
                              f"the cost of drafting {k} tokens and verifying {k + 1} positions: {ADAPTIVE_HINT}",
                       figures)
    return Verdict(None, None, figures)


def speculation_verdict(result: GenerationResult, k: int, baseline: dict | None = None) -> Verdict | None:
    """The verdict on a generation with speculation (K >= 1); None without (K = 0)."""
    if k < 1:
        return None
    if result.adaptive is not None:
        return adaptive_verdict(result.adaptive, result.accepted, baseline)
    return fixed_verdict(k, result.accepted, result.cycles, baseline)
