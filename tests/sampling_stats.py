"""Chi-square tests for the sampling-losslessness tests, with cells pooled so every expected count is >= 5.

Pooling merges the rarest cells (by their expected count) into shared bins; the statistic is then the usual
Pearson sum over the bins. Several strata (e.g. prompts) add their statistics and degrees of freedom.
"""

from __future__ import annotations

import numpy as np
from scipy.special import gammaln
from scipy.stats import chi2

MIN_EXPECTED = 5.0


def _pool(weights_C: np.ndarray, need: float) -> list[np.ndarray]:
    """Groups of cell indices: rarest first, each group's weight >= need (a short last group joins the one before)."""
    order = np.argsort(weights_C, kind="stable")
    groups, cur, acc = [], [], 0.0
    for c in order:
        cur.append(c)
        acc += weights_C[c]
        if acc >= need:
            groups.append(np.array(cur))
            cur, acc = [], 0.0
    if cur:
        if groups:
            groups[-1] = np.concatenate([groups[-1], np.array(cur)])
        else:
            groups.append(np.array(cur))
    return groups


def goodness_of_fit(observed_C: np.ndarray, probs_C: np.ndarray) -> tuple[float, int]:
    """(statistic, dof) of observed counts against exact cell probabilities. A count in a cell of probability 0
    is an impossible outcome: the statistic is then infinite."""
    observed_C, probs_C = np.asarray(observed_C, np.float64), np.asarray(probs_C, np.float64)
    n = observed_C.sum()
    if observed_C[probs_C <= 0].sum() > 0:
        return np.inf, 1
    live = probs_C > 0
    obs, exp = observed_C[live], probs_C[live] / probs_C[live].sum() * n
    groups = _pool(exp, MIN_EXPECTED)
    o = np.array([obs[g].sum() for g in groups])
    e = np.array([exp[g].sum() for g in groups])
    return float(((o - e) ** 2 / e).sum()), len(groups) - 1


def homogeneity(counts_a_C: np.ndarray, counts_b_C: np.ndarray) -> tuple[float, int]:
    """(statistic, dof) of the 2 x C contingency test that two samples come from one distribution."""
    table = np.stack([counts_a_C, counts_b_C]).astype(np.float64)
    rows = table.sum(1)
    if rows.min() == 0:
        return 0.0, 0
    # the expected count of a cell is row total * column total / n: pool columns until the smaller row's is >= 5
    need = MIN_EXPECTED * rows.sum() / rows.min()
    groups = _pool(table.sum(0), need)
    pooled = np.stack([table[:, g].sum(1) for g in groups], axis=1)
    exp = rows[:, None] * pooled.sum(0)[None] / rows.sum()
    return float(((pooled - exp) ** 2 / exp).sum()), len(groups) - 1


def log10_p_value(parts: list[tuple[float, int]]) -> float:
    """log10 of the combined p-value of independent chi-square statistics (strata); -inf for an impossible outcome.
    Kept as a log so that a clearly broken rule reports how far out it is instead of an underflowed 0."""
    stat = sum(s for s, _ in parts)
    dof = sum(d for _, d in parts)
    if np.isinf(stat):
        return -np.inf
    if dof == 0:
        return 0.0
    log_sf = chi2.logsf(stat, dof)
    if not np.isfinite(log_sf):  # scipy underflows far out in the tail: the leading term of Q(d/2, stat/2)
        a, x = dof / 2, stat / 2
        log_sf = (a - 1) * np.log(x) - x - gammaln(a)
    return float(log_sf / np.log(10))


def p_value(parts: list[tuple[float, int]]) -> float:
    return float(10 ** log10_p_value(parts))
