"""`python -m bench.labs.stream_read`: the streaming path's decode (`Engine.stream`, pipelined: one cycle queued
behind the one whose progress the host reads) on the embedded pair, for an A/B of that read between two checkouts
run one after the other. Greedy, --max-new tokens, the coding prompts one at a time; engines: fixed K = --k and
the backend's default adaptive kind. Per engine the median decode tokens per second over --rounds rounds (the
engines' order rotated each round) after one warm-up, and its range. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp

from bench.adaptive_prompts import PROMPTS, encode, load_pair
from jaxspec.adaptive import AdaptivePolicy
from jaxspec.adaptive_calls import PerCallPolicy
from jaxspec.defaults import default_adaptive_kind
from jaxspec.engine import Engine


def streamed_tokens_per_s(engine: Engine, prompt: list[int], max_new: int) -> float:
    result = list(engine.stream([prompt], max_new))[-1]
    return (sum(len(t) for t in result.tokens) - 1) / result.decode_s


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.stream_read", description=__doc__.split("\n")[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    if args.k < 1 or args.max_new < 2 or not 1 <= args.prompts <= len(PROMPTS) or args.rounds < 1:
        p.error(f"--k >= 1, --max-new >= 2, --prompts in 1..{len(PROMPTS)}, --rounds >= 1")
    cfg, w, tok = load_pair(jnp.bfloat16)
    kind = default_adaptive_kind(jax.default_backend())
    policy = PerCallPolicy() if kind == "per_call" else AdaptivePolicy()
    engines = {f"K={args.k}": Engine(cfg, w, num_steps=args.k), "adaptive": Engine(cfg, w, num_steps=args.k,
                                                                                   adaptive=policy)}
    prompts = [encode(tok, text) for _, text in PROMPTS[: args.prompts]]
    rows = {}
    for i, prompt in enumerate(prompts):
        names = list(engines)
        for name in names:  # compile and warm
            streamed_tokens_per_s(engines[name], prompt, args.max_new)
        got = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                got[name].append(streamed_tokens_per_s(engines[name], prompt, args.max_new))
        rows[str(i)] = {name: dict(median=statistics.median(v), min=min(v), max=max(v)) for name, v in got.items()}
    print(json.dumps(dict(k=args.k, max_new=args.max_new, rounds=args.rounds, adaptive_kind=kind,
                          tokens_per_s=rows)))


if __name__ == "__main__":
    main()
