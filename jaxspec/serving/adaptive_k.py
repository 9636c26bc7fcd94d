"""The server's adaptive draft length: one K per device loop for the whole batch (one compiled loop per K), chosen on
the host between loops from what the loops measured.

The model is generate's (jaxspec.adaptive): with c_j the conditional acceptance rate of draft position j, a cycle of
K drafts yields E[tokens | K] = 1 + sum_{j<=K} prod_{i<=j} c_i per live slot, and the batch's rate at K is
E[tokens | K] / t(K, live) with t the time of one cycle at K over `live` slots. Unlike generate's on-device rule,
the server measures t itself: each loop's wall time (launch to its tokens on the host, so the host's share of a
loop counts too) per cycle, kept per K and per occupancy (live slots in powers of two), as the median of the last
few loops. So the choice rests on this device's real times, whatever the backend, the model or the batch.

Estimates. Each loop's acceptance counts (`StepResult.accepted_by_count`: live slot-cycles that accepted n drafts)
observe positions 1..min(n+1, K); a plain loop of a speculating server observes position 1 for free (the probe:
whether a greedy slot emitted the draft's own first guess). Counts decay by `decay` per loop so the rates follow
the traffic. c_j is shrunk towards c_{j-1} (c_1 towards `prior`) with the weight of PRIOR_WEIGHT observations.

Times not yet measured at an occupancy are scaled from the nearest occupancy where both that K and the current one
were measured, or else fitted as a line in K through the Ks measured here (a cycle's time grows about linearly with
its drafts). The first Ks tried are the neighbours of the starting K (a program's first run is not counted: it
carries one-time costs); a K the fit puts ahead is run, and so measured, when the rule chooses it. Every
`explore_every` loops a neighbour of the K in use (the one measured longest ago) is run again, so a time measured
under other traffic, or once in a noisy moment, is refreshed; an exploration that leaves the choice as it was
doubles the gap to the next one, up to EXPLORE_BACKOFF times `explore_every`.
A change of K needs the best K's rate `hysteresis` above the current one's.
"""

from __future__ import annotations

import collections
import math
import statistics

import numpy as np

PRIOR_WEIGHT = 4.0
COST_WINDOW = 5  # loops whose median is a K's time at an occupancy
EXPLORE_BACKOFF = 8
LOOP_LOG = 4096  # loops whose (K, live, cycles, seconds) are kept


def occupancy_bucket(live: float) -> int:
    """Live slots rounded up to a power of two (the times of a loop are kept per bucket)."""
    return 1 << max(0, int(np.ceil(np.log2(max(live, 1.0)))))


def line_through(points: dict) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through {x: y} (two or more distinct x)."""
    n, xs, ys = len(points), list(points), list(points.values())
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


class BatchAdaptiveK:
    """`SlotEngine(choose_k=BatchAdaptiveK(num_steps))`: called with the last loop's StepResult (None before the
    first), returns the next loop's K in `ks` (0..num_steps). `ks` tells the engine which loops to compile."""

    def __init__(self, num_steps: int, *, prior: float = 0.5, decay: float = 0.9, explore_every: int = 8,
                 hysteresis: float = 0.03):
        if num_steps < 1:
            raise ValueError(f"adaptive speculation needs num_steps >= 1, got {num_steps}")
        self.ks = tuple(range(num_steps + 1))
        self.prior, self.decay, self.explore_every, self.hysteresis = prior, decay, explore_every, hysteresis
        self.hits, self.trials = np.zeros(num_steps + 1), np.zeros(num_steps + 1)  # index j: draft position j
        self.times: dict[tuple[int, int], collections.deque] = {}  # (bucket, K) -> seconds per cycle, last loops
        # (bucket, K) -> the median of its times, kept as they come: the choice runs between every two device loops
        # with the device idle, so it reads medians instead of computing them for every K at every loop
        self.median: dict[tuple[int, int], float] = {}
        self.k, self.loops, self.live = num_steps, 0, 1.0
        self.explore_gap, self.explore_next, self._explored_from = explore_every, explore_every, None
        self.choices = collections.Counter()  # K -> loops run with it
        self._runs = collections.Counter()  # K -> loops observed
        self._measured_at: dict[tuple[int, int], int] = {}  # (bucket, K) -> the loop that last measured it
        # (K, live slots, cycles, seconds) of the latest loops: what the times above were taken from, for a bench
        self.loop_log: collections.deque = collections.deque(maxlen=LOOP_LOG)

    # --- what the loops measured ----------------------------------------------------------------------------
    def observe(self, last) -> None:
        if last.cycles <= 0:
            return
        self.live = last.slot_cycles / last.cycles
        self.loop_log.append((last.k, round(self.live, 2), last.cycles, round(last.seconds, 6)))
        self._runs[last.k] += 1
        if self.live > 0 and self._runs[last.k] > 1:  # a program's first run carries one-time costs
            key = (occupancy_bucket(self.live), last.k)
            times = self.times.setdefault(key, collections.deque(maxlen=COST_WINDOW))
            times.append(last.seconds / last.cycles)
            self.median[key] = statistics.median(times)
            self._measured_at[key] = self.loops
        self.hits *= self.decay
        self.trials *= self.decay
        counts = np.asarray(last.accepted_by_count, float)
        for j in range(1, last.k + 1):  # accepted n: positions 1..n accepted, n + 1 rejected
            self.trials[j] += counts[j - 1:].sum()
            self.hits[j] += counts[j:].sum()
        if last.k == 0 and last.probe[1]:
            self.hits[1] += last.probe[0]
            self.trials[1] += last.probe[1]

    def acceptance(self) -> np.ndarray:
        """c_j for j = 1..num_steps (index 0 unused)."""
        c = np.zeros_like(self.hits)
        below = self.prior
        for j in range(1, len(c)):
            c[j] = below = (self.hits[j] + PRIOR_WEIGHT * below) / (self.trials[j] + PRIOR_WEIGHT)
        return c

    def expected_tokens(self) -> np.ndarray:
        """E[tokens | K] per live slot-cycle for K in ks."""
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.acceptance()[1:]))])

    def cycle_time(self, k: int, bucket: int) -> float | None:
        """Seconds of one cycle at K over `bucket` live slots: measured, scaled from the nearest bucket where K and
        the current K were both measured, or fitted in K through this bucket's measured Ks; None when none
        applies."""
        med = self.median
        own = med.get((bucket, k))
        if own is not None:
            return own
        here = med.get((bucket, self.k))
        others = sorted((abs(math.log2(b) - math.log2(bucket)), b) for b, kk in med if kk == k)
        for _, b in others:
            there = med.get((b, self.k))
            if here is not None and there is not None:
                return med[(b, k)] * here / there
        measured = {kk: t for (b, kk), t in med.items() if b == bucket}
        if len(measured) >= 2:
            slope, intercept = line_through(measured)
            return max(intercept + slope * k, min(measured.values()) * 0.5)
        return med[(others[0][1], k)] if others else None

    # --- the choice -------------------------------------------------------------------------------------------
    def choose(self) -> int:
        bucket = occupancy_bucket(self.live)
        times = {k: self.cycle_time(k, bucket) for k in self.ks}
        self.loops += 1
        untried = sorted((k for k in self.ks if times[k] is None), key=lambda k: abs(k - self.k))
        if untried:  # what a K costs on this device is learnt by running it (the nearest first)
            return untried[0] if self.loops > 1 else self.k
        rate = self.expected_tokens() / np.array([times[k] for k in self.ks])
        best = int(np.argmax(rate))
        if self._explored_from is not None:  # the loop after an exploration: did it change the choice?
            confirmed = best == self._explored_from
            self.explore_gap = min(2 * self.explore_gap, EXPLORE_BACKOFF * self.explore_every) if confirmed \
                else self.explore_every
            self._explored_from = None
        if rate[best] > rate[self.k] * (1 + self.hysteresis):
            self.k = best
        if self.loops >= self.explore_next:  # refresh a neighbour's time here (and its positions)
            self.explore_next = self.loops + self.explore_gap
            self._explored_from = self.k
            near = [k for k in (self.k - 1, self.k + 1) if k in self.ks]
            return min(near, key=lambda k: self._measured_at.get((bucket, k), -1))
        return self.k

    # --- what the user is told -------------------------------------------------------------------------------
    def report(self) -> dict:
        """The figures behind the choice, for /metrics: the K of the next loop, loops run per K, the acceptance
        estimate per draft position, and per K its expected tokens per slot-cycle and the time of its cycle in
        plain steps at the current occupancy (where both are known)."""
        bucket = occupancy_bucket(self.live)
        plain = self.cycle_time(0, bucket)
        expected = self.expected_tokens()
        in_steps = {}
        for k in self.ks:
            t = self.cycle_time(k, bucket)
            if t is not None and plain:
                in_steps[k] = t / plain
        return dict(k=self.k, loops=dict(self.choices), acceptance=[float(c) for c in self.acceptance()[1:]],
                    expected_tokens={k: float(expected[k]) for k in self.ks}, cycle_plain_steps=in_steps)

    def verdict(self, report: dict | None = None) -> str | None:
        """One line when plain steps are the choice because no K pays, with the figures that decided it (`report`:
        this loop's `report()`, where taken already); None while a K >= 1 is chosen or before the costs are known."""
        if self.k != 0:
            return None
        r = report if report is not None else self.report()
        paying = [(k, r["expected_tokens"][k], r["cycle_plain_steps"][k]) for k in self.ks
                  if k > 0 and k in r["cycle_plain_steps"]]
        if not paying:
            return None
        k, tokens, steps = min(paying, key=lambda x: x[2] / x[1])
        return (f"speculation off: the drafts' measured acceptance is {r['acceptance'][0]:.2f} at the first position; "
                f"the best K, {k}, yields {tokens:.2f} tokens a slot-cycle for a cycle that costs {steps:.2f} plain "
                f"steps, so plain steps are faster (neighbouring K are tried again every {self.explore_every}-"
                f"{EXPLORE_BACKOFF * self.explore_every} loops)")

    def __call__(self, last) -> int:
        if last is not None:
            self.observe(last)
        k = self.choose()
        self.choices[k] += 1
        return k
