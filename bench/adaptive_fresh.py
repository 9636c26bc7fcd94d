"""`python -m bench.adaptive_fresh`: adaptive speculation by call as a new process's first generation gets it (a new
engine each run: no counts pooled from earlier generations, as `python -m jaxspec.generate` runs one prompt), on
the embedded pair, against plain decoding and fixed K, with plain calls that keep the draft current and observe
c_1 (the default, `PerCallPolicy.probe_every`) and without them (`probe_every=0`: plain decoding, once chosen,
to the end).

Two parts, interleaved rounds of one run of each engine in a rotated order, median decode tok/s:
- the trained draft on --prompts (indices into bench.adaptive_prompts' ten; the default takes the random-looking
  ones, whose first cycles the draft cannot follow before the text turns repetitive, and one code prompt);
- a random draft of the same shape (it never matches): what the plain calls' catch-ups cost against plain decoding.
Paired columns: the median over rounds of one engine's rate over another's in the same round. Writes
adaptive-fresh-<device>-<date>.json and .md to --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from bench.adaptive_prompts import PROMPTS, encode, load_pair, paired_ratio, time_engines
from bench.report import fmt, publish, run_stamp
from jaxspec.adaptive_calls import PerCallPolicy
from jaxspec.engine import Engine
from jaxspec.models import SpecWeights
from model.init import init_draft_weights

DEFAULT_PROMPTS = (2, 5, 8, 0)


class FreshEngine:
    """An adaptive engine built anew for every generation (compiled programs and the cost table are kept by the
    process, the pooled counts are not)."""

    def __init__(self, cfg, w, k: int, policy: PerCallPolicy):
        self.make = lambda: Engine(cfg, w, num_steps=k, adaptive=policy)

    def generate(self, *args, **kw):
        return self.make().generate(*args, **kw)


def k_runs(k_per_cycle: list[int]) -> list[list[int]]:
    """[[K, cycles], ...] in order: what each stretch of the generation ran."""
    runs: list[list[int]] = []
    for k in k_per_cycle:
        if runs and runs[-1][0] == k:
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
    return runs


def engines_for(cfg, w, k_max: int, fixed: tuple[int, ...]) -> dict:
    engines = {"baseline": Engine(cfg, w, num_steps=k_max)}
    engines.update({f"K={k}": Engine(cfg, w, num_steps=k) for k in fixed})
    engines["adaptive"] = FreshEngine(cfg, w, k_max, PerCallPolicy())
    engines["adaptive_no_probe"] = FreshEngine(cfg, w, k_max, PerCallPolicy(probe_every=0))
    return engines


def summarise(runs: dict, fixed: tuple[int, ...]) -> dict:
    rate = {name: r["tokens_per_s"] for name, r in runs.items()}
    rounds = {name: r["tokens_per_s_rounds"] for name, r in runs.items()}
    best = max((f"K={k}" for k in fixed), key=rate.get) if fixed else None
    out = {"speedup": {name: rate[name] / rate["baseline"] for name in rate}, "best_fixed": best}
    for name in ("adaptive", "adaptive_no_probe"):
        out[f"{name}_over_baseline_paired"] = paired_ratio(rounds[name], rounds["baseline"])
        if best:
            out[f"{name}_over_best_paired"] = paired_ratio(rounds[name], rounds[best])
    out["adaptive_over_no_probe_paired"] = paired_ratio(rounds["adaptive"], rounds["adaptive_no_probe"])
    return out


def markdown(res: dict) -> str:
    fixed = [f"K={k}" for k in res["fixed"]]
    lines = [f"# Adaptive by call in a new engine: {res['device']}, jax {res['jax']}, {res['date']}", "",
             f"jaxspec/default_model ({res['dtype']}), greedy, {res['max_new_tokens']} new tokens, a new adaptive "
             f"engine each run (K up to {res['k_max']}); median of {res['repeats']} interleaved rounds. Cells: "
             "speed-up over plain decoding (its tok/s first); paired: median over rounds of the same-round ratio.", "",
             "| draft | prompt | plain tok/s | " + " | ".join(fixed) + " | adaptive | no probes | adaptive / best "
             "fixed, paired | adaptive / no probes, paired | adaptive's K stretches (last run) | "
             "no probes' (last run) |",
             "|---" * (len(fixed) + 9) + "|"]
    for row in res["rows"]:
        s, runs = row["summary"], row["runs"]
        cells = " | ".join(f"{s['speedup'][f]:.2f}x" for f in fixed)
        lines.append(f"| {row['draft']} | {row['prompt'][:24]!r} | {runs['baseline']['tokens_per_s']:.0f} | {cells} | "
                     f"{s['speedup']['adaptive']:.2f}x | {s['speedup']['adaptive_no_probe']:.2f}x | "
                     f"{fmt(s.get('adaptive_over_best_paired'))} | {fmt(s['adaptive_over_no_probe_paired'])} | "
                     f"{runs['adaptive']['k_runs']} | {runs['adaptive_no_probe']['k_runs']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.adaptive_fresh", description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, nargs="+", default=list(DEFAULT_PROMPTS),
                   help=f"indices into bench.adaptive_prompts' {len(PROMPTS)} prompts")
    p.add_argument("--k", type=int, nargs="*", default=[3, 4], help="fixed K to time")
    p.add_argument("--adaptive-max", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--no-random-draft", action="store_true", help="skip the random draft's rows")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if any(not 0 <= i < len(PROMPTS) for i in args.prompts):
        p.error(f"--prompts must be in 0..{len(PROMPTS) - 1}")
    if args.adaptive_max < 1 or args.repeats < 1 or args.max_new_tokens < 2 or any(k < 1 for k in args.k):
        p.error("--adaptive-max, --k and --repeats must be >= 1 and --max-new-tokens >= 2")
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    stamp = run_stamp()
    cfg, w, tok = load_pair(jnp.dtype(args.dtype))
    fixed = tuple(sorted(set(args.k)))
    drafts = [("trained", w, [PROMPTS[i][1] for i in args.prompts])]
    if not args.no_random_draft:
        rng = np.random.default_rng(0)
        random_draft = init_draft_weights(cfg.draft, rng, jnp.dtype(args.dtype))
        drafts.append(("random", SpecWeights(w.target, random_draft), [PROMPTS[args.prompts[0]][1]]))
    result = dict(**stamp.fields, dtype=args.dtype, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                  k_max=args.adaptive_max, fixed=list(fixed), rows=[])
    for draft, weights, texts in drafts:
        engines = engines_for(cfg, weights, args.adaptive_max, fixed)
        for text in texts:
            prompt = encode(tok, text)
            last = {}
            for name in ("adaptive", "adaptive_no_probe"):  # what the last run ran, read from a run of its own
                last[name] = k_runs(engines[name].generate([prompt], args.max_new_tokens).adaptive.k_per_cycle)
            runs = time_engines(engines, prompt, args.max_new_tokens, args.repeats)
            for name, stretches in last.items():
                runs[name]["k_runs"] = stretches
            row = dict(draft=draft, prompt=text, runs=runs, summary=summarise(runs, fixed))
            result["rows"].append(row)
            log(f"{draft} {text[:24]!r}: adaptive {row['summary']['speedup']['adaptive']:.2f}x, no probes "
                f"{row['summary']['speedup']['adaptive_no_probe']:.2f}x, {last['adaptive']}")
    publish(result, Path(args.out), f"adaptive-fresh-{stamp.suffix}", markdown, log)
    return result


if __name__ == "__main__":
    main()
