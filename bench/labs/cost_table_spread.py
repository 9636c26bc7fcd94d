"""`python -m bench.labs.cost_table_spread`: how much adaptive speculation's start-up cost table moves between
measurements on this machine (issue 37).

The rule compares K by t(K) / t(0); on a shared machine one slow moment during the start-up timing can price a K
as if it paid. This lab builds one adaptive engine on the embedded pair, then measures its table `--measurements`
times (the engine's own `jaxspec.adaptive_costs.measure`, the in-process table cleared before each), and prints
each table's ratios, the median ratio per K and the spread (largest / smallest ratio) per K. Compare settings of
`jaxspec.adaptive_costs` by running it on each.
"""

from __future__ import annotations

import argparse
import statistics

import jax.numpy as jnp
import numpy as np

from bench.adaptive_prompts import encode, load_pair
from jaxspec import adaptive_costs
from jaxspec.adaptive import AdaptivePolicy
from jaxspec.engine import Engine
from jaxspec.generate import DEFAULT_PROMPT



def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.labs.cost_table_spread", description=__doc__.split("\n")[0])
    p.add_argument("--measurements", type=int, default=8)
    p.add_argument("--k", type=int, default=4, help="largest K of the adaptive set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    a = p.parse_args(argv)
    if a.measurements < 2:
        p.error("--measurements must be >= 2 (a spread needs two)")
    cfg, weights, tok = load_pair(jnp.dtype(a.dtype))
    engine = Engine(cfg, weights, num_steps=a.k, adaptive=AdaptivePolicy())
    prompt = encode(tok, DEFAULT_PROMPT)
    ratios, seconds = [], []
    for _ in range(a.measurements):
        adaptive_costs._MEMORY.clear()  # noqa: SLF001 - force a fresh measurement on the same compiled programs
        r = engine.generate([prompt], a.max_new_tokens)
        costs = np.asarray(r.adaptive.costs_s)
        ratios.append(costs / costs[0])
        seconds.append(r.adaptive.measure_s)
        print(" ".join(f"{x:.2f}" for x in ratios[-1]), f"| t(0) {1e3 * costs[0]:.2f} ms | cycles per K "
              f"{r.adaptive.k_histogram} | measured in {r.adaptive.measure_s:.2f} s", flush=True)
    table = np.array(ratios)
    steps = r.adaptive.steps
    print("K:                 ", " ".join(f"{k:>5d}" for k in steps))
    print("median t(K) / t(0):", " ".join(f"{x:5.2f}" for x in np.median(table, axis=0)))
    print("spread (max / min):", " ".join(f"{x:5.2f}" for x in table.max(axis=0) / table.min(axis=0)))
    print(f"measurement time: median {statistics.median(seconds):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
