"""`python -m bench.labs.adaptive_calls_ab`: where adaptive speculation by call spends time beyond the fixed-K loop,
on the embedded pair, one prompt, interleaved rounds in one process.

Variants (each `Engine.generate` of --max-new-tokens, greedy):
- `fixed`: the fixed-K engine (K = --k), one call of its device loop;
- `calls_one_k`: adaptive by call with the set {K} alone, so its loop never leaves (one call, the leaving test still
  evaluated every cycle): the per-call program and host against the fixed loop;
- `calls`: adaptive by call with the default set 0..K (what `generate` runs on a GPU).
Per variant: the median and spread of decode ms over --rounds after a warm-up, cycles and calls. Writes
adaptive-calls-ab-<device>-<date>.json and .md to --out.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.adaptive_prompts import PROMPTS, encode, load_pair
from bench.report import publish
from jaxspec.adaptive_calls import PerCallPolicy
from jaxspec.engine import Engine


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.adaptive_calls_ab", description=__doc__.split("\n")[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prompt", type=int, default=0, help=f"index into bench.adaptive_prompts' {len(PROMPTS)} prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    cfg, w, tok = load_pair(jnp.dtype(args.dtype))
    prompt = encode(tok, PROMPTS[args.prompt][1])
    engines = {"fixed": Engine(cfg, w, num_steps=args.k),
               "calls_one_k": Engine(cfg, w, num_steps=args.k, adaptive=PerCallPolicy(steps=(args.k,))),
               "calls": Engine(cfg, w, num_steps=args.k, adaptive=PerCallPolicy())}
    for eng in engines.values():
        eng.generate([prompt], args.max_new_tokens)  # compile, measure the cost table, warm up
    times = {name: [] for name in engines}
    last = {}
    for r in range(args.rounds):
        names = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in names:
            last[name] = engines[name].generate([prompt], args.max_new_tokens)
            times[name].append(1e3 * last[name].decode_s)
    rows = {}
    for name, ts in times.items():
        res = last[name]
        rows[name] = dict(decode_ms=statistics.median(ts), min_ms=min(ts), max_ms=max(ts), cycles=res.cycles,
                          calls=None if res.adaptive is None else res.adaptive.calls,
                          k_histogram=None if res.adaptive is None else
                          {str(k): n for k, n in res.adaptive.k_histogram.items()})
        log(f"{name}: {rows[name]['decode_ms']:.3f} ms ({min(ts):.3f}-{max(ts):.3f}), {res.cycles} cycles, "
            f"calls {rows[name]['calls']}, K {rows[name]['k_histogram']}")
    dev = jax.devices()[0]
    now = datetime.datetime.now(datetime.timezone.utc)
    result = dict(device=dev.device_kind, jax=jax.__version__, date=now.isoformat(timespec="seconds"), k=args.k,
                  prompt=PROMPTS[args.prompt][1], max_new_tokens=args.max_new_tokens, rounds=args.rounds,
                  dtype=args.dtype, rows=rows)

    def markdown(res):
        lines = [f"# Adaptive by call against fixed K: {res['device']}, {res['date']}", "",
                 f"Embedded pair ({res['dtype']}), prompt {res['prompt'][:24]!r}, {res['max_new_tokens']} tokens, "
                 f"K = {res['k']}, median of {res['rounds']} interleaved rounds.", "",
                 "| variant | decode ms | min-max | cycles | calls | K histogram |", "|---|---|---|---|---|---|"]
        for name, r in res["rows"].items():
            lines.append(f"| {name} | {r['decode_ms']:.3f} | {r['min_ms']:.3f}-{r['max_ms']:.3f} | {r['cycles']} | "
                         f"{r['calls']} | {r['k_histogram']} |")
        return "\n".join(lines) + "\n"

    publish(result, Path(args.out), f"adaptive-calls-ab-{dev.platform}-{now.strftime('%Y%m%d-%H%M')}", markdown, log)


if __name__ == "__main__":
    main(sys.argv[1:])
