"""`python -m bench.labs.prompt_bench_noise`: what `bench.adaptive_prompts`' worst ratio would read for an adaptive
engine that runs the best fixed K at exactly its cost, given the bench's own noise (issue 53's row: adaptive >= 0.97
of the best fixed K on every one of ten prompts).

Adaptive's one engine is scored against the best of four fixed engines, each a median of noisy rounds. The best of
several noisy medians is biased up, and ten prompts take the worst of ten such ratios. This lab simulates that from
a bench JSON: per prompt and engine, the true speed is taken as the measured median and a round's noise as normal
with the spread the bench measured (1.4826 x the median absolute deviation of its rounds where the JSON keeps them
(`tokens_per_s_rounds`), robust to a stray slow round as the median is; else its range over the rounds / the
expected range of that many normal draws, which a stray round widens, so older results overstate it); each draw
takes every fixed engine's median of R noisy rounds, and a perfect adaptive's median of R rounds of the engine
whose true speed is the best, and reads the worst ratio over the prompts. Prints the distribution of that worst
ratio and, per prompt, the perfect engine's median ratio, beside what the run measured. A model (normal, independent
rounds), not a measurement: read it as the floor the bench's noise sets.

    python -m bench.labs.prompt_bench_noise bench/results/wave3/plain-tail-2030/rows-2035/adaptive-prompts/*.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np


def expected_range(n: int, rng, draws: int = 20000) -> float:
    """E[max - min] of n standard normal draws (about 3.8 at 21)."""
    x = rng.standard_normal((draws, n))
    return float(np.mean(x.max(axis=1) - x.min(axis=1)))


def spread(row: dict, rounds: int, unit_range: float) -> float:
    """One round's standard deviation, relative to the engine's median."""
    rates = row.get("tokens_per_s_rounds")
    if rates and len(rates) > 1:
        return float(1.4826 * np.median(np.abs(np.asarray(rates) - np.median(rates))) / row["tokens_per_s"])
    low, high = row["tokens_per_s_range"]
    return (high - low) / unit_range / row["tokens_per_s"]


def simulate(prompts: list[dict], rounds: int, draws: int, rng) -> dict:
    """Worst-over-prompts ratio of a perfect adaptive, `draws` times; and each prompt's median ratio."""
    unit = expected_range(rounds, rng)
    per_prompt = []
    for p in prompts:
        fixed = {n: r for n, r in p["runs"].items() if n.startswith("K=")}
        true = np.array([r["tokens_per_s"] for r in fixed.values()])
        sigma = np.array([spread(r, rounds, unit) for r in fixed.values()]) * true
        best = int(np.argmax(true))
        noisy_NF = np.median(true + sigma * rng.standard_normal((draws, rounds, len(true))), axis=1)
        copy_N = np.median(true[best] + sigma[best] * rng.standard_normal((draws, rounds)), axis=1)
        per_prompt.append(copy_N / noisy_NF.max(axis=1))
    ratios_PN = np.stack(per_prompt)
    worst_N = ratios_PN.min(axis=0)
    return dict(worst_median=float(np.median(worst_N)), worst_p10=float(np.percentile(worst_N, 10)),
                worst_p90=float(np.percentile(worst_N, 90)), at_least_097=float(np.mean(worst_N >= 0.97)),
                per_prompt_median=[float(np.median(r)) for r in ratios_PN],
                spreads=[[round(spread(r, rounds, unit), 4) for n, r in p["runs"].items() if n.startswith("K=")]
                         for p in prompts])


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.prompt_bench_noise", description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", help="bench.adaptive_prompts JSON files")
    p.add_argument("--draws", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write prompt-bench-noise.json here")
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    report = []
    for path in args.results:
        try:
            result = json.loads(Path(path).read_text())
            prompts, rounds = result["prompts"], int(result["repeats"])
            sim = simulate(prompts, rounds, args.draws, rng)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"{path}: not a bench.adaptive_prompts result ({type(e).__name__}: {e})")
        measured = [q["summary"]["adaptive_over_best"] for q in prompts]
        report.append(dict(result=path, rounds=rounds, measured_worst=min(measured), measured=measured, **sim))
        print(f"{path}: {rounds} rounds; measured worst {min(measured):.3f} (median {statistics.median(measured):.3f});"
              f" a perfect adaptive's worst: median {sim['worst_median']:.3f}, 10th-90th percentile "
              f"{sim['worst_p10']:.3f}-{sim['worst_p90']:.3f}, >= 0.97 in {100 * sim['at_least_097']:.0f}% of draws")
        print("  per prompt, the perfect engine's median ratio: "
              + " ".join(f"{r:.3f}" for r in sim["per_prompt_median"]))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "prompt-bench-noise.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
