"""`python -m bench.mismatched_drafter`: what `generate --baseline` reports for a drafter that never matches its
target, with generate's defaults against a fixed K.

A Kimi-K2.5-shaped target of --layers layers (full width, INT4 experts, random weights) and a random K2.5-shaped
EAGLE-3 draft: its drafts are (almost) never accepted, as with a drafter trained for another target or version.
Each engine is built as `python -m jaxspec.generate` builds it: the default (adaptive speculation of the backend's
kind, K up to 4) and `--no-speculative-adaptive` (fixed K = 4). `jaxspec.speedup.measure_speedup` (what --baseline
runs: interleaved rounds after a warm-up of each) gives the speedup over plain decoding, streamed (the terminal
default) and in the on-device loop (--json); then one more run gives the verdict line the CLI prints. Writes
mismatched-drafter-<device>-<date>.json and .md to --out.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.cycle import spec_pair  # noqa: E402
from bench.report import publish, run_stamp  # noqa: E402
from bench.step import bench_config, draw_weights  # noqa: E402
from jaxspec.adaptive import AdaptivePolicy  # noqa: E402
from jaxspec.adaptive_calls import PerCallPolicy  # noqa: E402
from jaxspec.defaults import DEFAULT_NUM_STEPS, default_adaptive_kind  # noqa: E402
from jaxspec.engine import Engine  # noqa: E402
from jaxspec.sampling import SamplingParams  # noqa: E402
from jaxspec.speculation_verdict import speculation_verdict  # noqa: E402
from jaxspec.speedup import measure_speedup  # noqa: E402


def run(args, log) -> dict:
    cfg = bench_config(args.layers, args.tiny)
    w = draw_weights(cfg, args.tiny, moe_layers=args.moe_layers)
    spec_cfg, _, sw = spec_pair(w, cfg, args.tiny)
    kind = default_adaptive_kind(jax.default_backend())
    engines = {
        f"default (adaptive {kind})": Engine(spec_cfg, sw, num_steps=args.k,
                                             adaptive=PerCallPolicy() if kind == "per_call" else AdaptivePolicy()),
        f"fixed K = {args.k}": Engine(spec_cfg, sw, num_steps=args.k),
    }
    rng = np.random.default_rng(0)
    prompt = [rng.integers(3, cfg.vocab_size, args.prompt_tokens).tolist()]
    greedy = SamplingParams()
    rows = []
    for name, engine in engines.items():
        for streamed in (True, False):
            m = measure_speedup(engine, prompt, args.max_new_tokens, greedy, 0, streamed=streamed,
                                rounds=args.rounds)
            last = (list(engine.stream(prompt, args.max_new_tokens, greedy))[-1] if streamed
                    else engine.generate(prompt, args.max_new_tokens, greedy))
            verdict = speculation_verdict(last, args.k, m.as_dict())
            row = dict(engine=name, **m.as_dict(),
                       k_histogram=None if last.adaptive is None else
                       {str(k): n for k, n in last.adaptive.k_histogram.items()},
                       mean_acceptance_length=last.stats.mean_acceptance_length if last.stats.cycles else None,
                       verdict=verdict.reason if verdict else None)
            rows.append(row)
            log(f"{name}, {m.mode}: speedup {m.speedup:.3f}x ({min(m.speedups):.3f}-{max(m.speedups):.3f}), "
                f"plain {row['decode_tokens_per_s']:.1f} tok/s, K histogram {row['k_histogram']}; "
                f"verdict: {row['verdict']}")
    return dict(rows=rows)


def markdown(result: dict) -> str:
    lines = [f"# A drafter that never matches: {result['device']}, jax {result['jax']}, {result['date']}", "",
             f"Kimi-K2.5 dims, {result['layers']} layers ({result['moe_layers']} MoE layers)"
             f"{' (tiny)' if result['tiny'] else ''}, random target and random EAGLE-3 draft, prompt "
             f"{result['prompt_tokens']} tokens, {result['max_new_tokens']} new tokens, greedy; "
             f"`jaxspec.speedup.measure_speedup`, {result['rounds']} interleaved rounds (median, min-max).", "",
             "| engine | timed | speedup over plain | min-max | plain tok/s | K histogram (last run) | verdict |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['engine']} | {r['mode']} | {r['speedup']:.3f}x | {r['speedup_min']:.3f}-"
                     f"{r['speedup_max']:.3f} | {r['decode_tokens_per_s']:.1f} | {r['k_histogram']} | "
                     f"{r['verdict'] or '-'} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.mismatched_drafter", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--moe-layers", choices=("distinct", "repeated"), default="repeated")
    p.add_argument("--tiny", action="store_true", help="small dims (CPU smoke run)")
    p.add_argument("--k", type=int, default=DEFAULT_NUM_STEPS, help="largest K (adaptive) / the K (fixed)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", required=True, help="results folder (JSON, markdown)")
    a = p.parse_args(argv)
    if a.layers < 3:
        p.error("--layers must be >= 3 (the draft taps three distinct target layers)")
    if a.k < 1 or a.prompt_tokens < 1 or a.max_new_tokens < 2 or a.rounds < 1:
        p.error("--k, --prompt-tokens, --rounds must be >= 1 and --max-new-tokens >= 2")
    return a


def main(argv=None):
    args = parse_args(argv)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    stamp = run_stamp()
    result = dict(**stamp.fields, layers=args.layers, moe_layers=args.moe_layers, tiny=args.tiny, k=args.k,
                  prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens, rounds=args.rounds)
    result.update(run(args, log))
    publish(result, Path(args.out), f"mismatched-drafter-{stamp.suffix}", markdown,
            log)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
