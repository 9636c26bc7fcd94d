"""`python -m bench.labs.cost_table_check`: does the by-call engine's start-up cost table price its K as whole calls
cost them (issue 53)?

On the embedded pair, for each prompt: the prefilled state and the by-call engine's compiled loops, as `generate`
builds them (jaxspec.adaptive_calls_run._start). Then, interleaved in `--rounds` rounds:
- truth: each K's loop called from the prefilled state (a copy) and run to the end, never leaving (`never_leaving`;
  K = 0 the plain loop): the call's seconds and cycles; and a call of K = 1 that runs no cycle (a call's own cost);
- each variant of the table (`VARIANTS`: jaxspec.adaptive_costs.measure's cycles and repeats), measured afresh.
The rule needs t(K) x cycles(K) ordered as the whole calls are: the report gives, per prompt, the calls' medians, the
per-cycle cost they imply ((call - empty call) / cycles), each variant's median table and spread, and the K each
would rank first for this prompt's cycles against the K the calls rank first. Writes cost-table-check-<date>.json/md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from bench.adaptive_prompts import PROMPTS, encode, load_pair
from bench.report import publish, run_stamp
from jaxspec import adaptive_costs
from jaxspec.adaptive_calls import PerCallPolicy, to_plain
from jaxspec.adaptive_calls_run import NO_LIMIT, _start, never_leaving
from jaxspec.engine import Engine
from jaxspec.sampling import SamplingParams

# name: (cycles of the short and long call, repeats; None = the engine's rule for the backend)
VARIANTS = {
    "engine": None,
    "slope 16-48 x3": ((16, 48), 3),
    "slope 0-48 x3": ((0, 48), 3),
    "slope 0-48 x9": ((0, 48), 9),
}


def measure_variant(run_forced, state, n: int, variant):
    adaptive_costs._MEMORY.clear()
    if variant is None:
        return adaptive_costs.measure(run_forced, state, n)
    cycles, repeats = variant
    return adaptive_costs.measure(run_forced, state, n, cycles=cycles, repeats=repeats)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.labs.cost_table_check", description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=3, help="the first N of bench.adaptive_prompts' prompts")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--out", default=str(Path(__file__).parents[1] / "results"))
    a = p.parse_args(argv)
    stamp = run_stamp()
    cfg, w, tok = load_pair(jnp.dtype(a.dtype))
    engine = Engine(cfg, w, num_steps=4, adaptive=PerCallPolicy())
    steps = engine.adaptive.resolve_steps(engine.k)
    sampling = SamplingParams()
    result = dict(**stamp.fields, args=vars(a), steps=list(steps), variants=list(VARIANTS), prompts=[])
    for kind, text in PROMPTS[: a.prompts]:
        state, sp, *_, programs, _run, _source, _first = _start(engine, [encode(tok, text)], a.max_new_tokens,
                                                                sampling, 0, streamed=False)

        def run_forced(copy, branch, n):
            k, program = steps[branch], programs[steps[branch]]
            if k == 0:
                s, _ = program(engine.weights, to_plain(copy), sp, np.int32(n))
                return s, int(s.steps)
            start = int(copy.cycles)
            s = program(engine.weights, copy, sp, never_leaving(n))[0]
            return s, int(s.cycles) - start

        def whole_call(branch, n=NO_LIMIT):
            return adaptive_costs.timed_call(run_forced, state, branch, n)

        for branch in range(len(steps)):  # warm-up: every loop's first call
            whole_call(branch)
        calls = {k: [] for k in steps}
        cycles = {}
        empty = []
        tables = {name: [] for name in VARIANTS}
        for _ in range(a.rounds):
            for branch, k in enumerate(steps):
                s, cycles[k] = whole_call(branch)
                calls[k].append(s)
            empty.append(whole_call(steps.index(1) if 1 in steps else 0, 0)[0])
            for name, variant in VARIANTS.items():
                table = measure_variant(run_forced, state, len(steps), variant)
                tables[name].append([list(table.costs_s), table.first_run_s])
        call_s = {k: statistics.median(v) for k, v in calls.items()}
        empty_s = statistics.median(empty)
        implied = {k: (call_s[k] - empty_s) / max(cycles[k], 1) for k in steps}
        best_call = min(steps, key=lambda k: call_s[k])
        row = dict(kind=kind, prompt=text, cycles={str(k): v for k, v in cycles.items()},
                   call_ms={str(k): 1e3 * v for k, v in call_s.items()},
                   call_range_ms={str(k): [1e3 * min(v), 1e3 * max(v)] for k, v in calls.items()},
                   empty_call_ms=1e3 * empty_s, implied_ms={str(k): 1e3 * v for k, v in implied.items()},
                   best_by_calls=best_call, variants={})
        for name, runs in tables.items():
            per_k = np.array([r[0] for r in runs])  # [rounds, K]
            med = np.median(per_k, axis=0)
            ranked = [min(steps, key=lambda k: r[0][steps.index(k)] * cycles[k]) for r in runs]
            row["variants"][name] = dict(
                median_ms=[1e3 * float(x) for x in med], min_ms=[1e3 * float(x) for x in per_k.min(0)],
                max_ms=[1e3 * float(x) for x in per_k.max(0)],
                first_run_ms=1e3 * statistics.median(r[1] for r in runs),
                best_by_table=ranked, agrees=sum(k == best_call for k in ranked))
        result["prompts"].append(row)
        print(f"{kind} {text[:24]!r}: calls {[round(1e3 * call_s[k], 2) for k in steps]} ms, cycles "
              f"{[cycles[k] for k in steps]}, empty call {1e3 * empty_s:.2f} ms, implied "
              f"{[round(1e3 * implied[k], 3) for k in steps]} ms a cycle; best K by calls {best_call}", flush=True)
        for name, v in row["variants"].items():
            print(f"  {name:16s} median {[round(x, 3) for x in v['median_ms']]} (first run "
                  f"{v['first_run_ms']:.2f} ms) best K {v['best_by_table']}", flush=True)
    publish(result, Path(a.out), f"cost-table-check-{stamp.suffix}", markdown, print)
    return result


def markdown(result: dict) -> str:
    steps = result["steps"]
    lines = [f"# The by-call cost table against whole calls: {result['device']}, jax {result['jax']}, "
             f"{result['date']}", "", "Method: bench/labs/cost_table_check.py (medians over interleaved rounds).", "",
             "| prompt | measure | " + " | ".join(f"K={k}" for k in steps) + " | best K (rounds) |",
             "|---|---|" + "---|" * len(steps) + "---|"]
    for row in result["prompts"]:
        ks = [str(k) for k in steps]
        lines.append(f"| {row['prompt'][:24]!r} | whole call ms | "
                     + " | ".join(f"{row['call_ms'][k]:.2f}" for k in ks) + f" | {row['best_by_calls']} |")
        lines.append(f"| | implied ms a cycle (empty call {row['empty_call_ms']:.2f}) | "
                     + " | ".join(f"{row['implied_ms'][k]:.3f}" for k in ks) + " | |")
        for name, v in row["variants"].items():
            lines.append(f"| | {name} (first run {v['first_run_ms']:.2f}) | "
                         + " | ".join(f"{m:.3f} ({lo:.3f}-{hi:.3f})" for m, lo, hi in
                                      zip(v["median_ms"], v["min_ms"], v["max_ms"]))
                         + f" | {v['best_by_table']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(sys.argv[1:])
