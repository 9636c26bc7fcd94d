"""`python -m bench.labs.adaptive_plain_overhead`: what the adaptive loop costs over plain decoding when it runs
plain steps only (issue 37), on the embedded pair.

Where no K pays, adaptive speculation runs K = 0: the target's step as plain decoding runs it, plus the draft's
catch-up over the backlog every `backlog` steps (and, with the probe, the observations of c_1 it makes). This lab
times `Engine.generate`'s decode (the on-device loop) of plain decoding and of adaptive loops forced to K = 0 with
chosen backlogs and the probe on or off, in interleaved rounds (each round runs every variant once, so drift in
the machine's speed falls on all alike), greedy or sampled, and prints each variant's median over plain decoding's.
"""

from __future__ import annotations

import argparse
import statistics

import jax.numpy as jnp

from bench.adaptive_prompts import encode, load_pair
from jaxspec.adaptive import AdaptivePolicy
from jaxspec.engine import Engine
from jaxspec.generate import DEFAULT_PROMPT
from jaxspec.sampling import SamplingParams

COSTS = ((0, 2e-3), (1, 4e-3), (2, 6e-3), (3, 7e-3), (4, 9e-3))  # given, so no start-up timing: the runs force K = 0
VARIANTS = {  # name: policy (None: plain decoding)
    "plain": None,
    "forced0": AdaptivePolicy(costs=COSTS, schedule=(0,)),  # this machine's default backlog
    "forced0_backlog8": AdaptivePolicy(costs=COSTS, schedule=(0,), backlog=8),
    "forced0_backlog32": AdaptivePolicy(costs=COSTS, schedule=(0,), backlog=32),
    "forced0_backlog64": AdaptivePolicy(costs=COSTS, schedule=(0,), backlog=64),
    "forced0_noprobe": AdaptivePolicy(costs=COSTS, schedule=(0,), probe=False),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.labs.adaptive_plain_overhead",
                                description=__doc__.split("\n")[0])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    a = p.parse_args(argv)
    names = ["plain"] + [n for n in a.variants if n != "plain"]
    cfg, weights, tok = load_pair(jnp.dtype(a.dtype))
    prompt = encode(tok, DEFAULT_PROMPT)
    sampling = SamplingParams(a.temperature, 0, a.top_p)
    engines = {n: Engine(cfg, weights, num_steps=4, adaptive=VARIANTS[n]) for n in names}

    def decode_s(name):
        return engines[name].generate([prompt], a.max_new_tokens, sampling,
                                      speculative=VARIANTS[name] is not None).decode_s

    for n in names:  # compile and warm up
        decode_s(n)
    times = {n: [] for n in names}
    for _ in range(a.rounds):
        for n in names:
            times[n].append(decode_s(n))
    base = statistics.median(times["plain"])
    print(f"{'sampled' if a.temperature > 0 else 'greedy'}, {a.max_new_tokens} tokens, median of {a.rounds} "
          f"interleaved rounds")
    for n in names:
        m = statistics.median(times[n])
        print(f"{n:20s} {1e3 * m:8.1f} ms  x{m / base:.3f} of plain  ({1e3 * min(times[n]):.1f}-"
              f"{1e3 * max(times[n]):.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
