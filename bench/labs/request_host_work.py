"""`python -m bench.labs.request_host_work`: the host work a `generate` request pays outside its timed prefill and
decode (wall time less `prefill_s` and `decode_s`), on the embedded pair, for the fixed-K engine and adaptive by
call. Median and spread over --runs generations after two warm-up generations (programs compiled, cost table
measured). Prints one line per engine; docs/performance.md ("The synchronised step's host round trip") quotes it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax.numpy as jnp

from bench.adaptive_prompts import PROMPTS, encode, load_pair
from jaxspec.adaptive_calls import PerCallPolicy
from jaxspec.engine import Engine


def host_ms(engine: Engine, prompt: list[int], max_new: int, runs: int) -> list[float]:
    for _ in range(2):
        engine.generate([prompt], max_new)
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        res = engine.generate([prompt], max_new)
        out.append(1e3 * (time.perf_counter() - t0 - res.prefill_s - res.decode_s))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.request_host_work", description=__doc__.split("\n")[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    args = p.parse_args(argv)
    cfg, w, tok = load_pair(jnp.dtype(args.dtype))
    prompt = encode(tok, PROMPTS[0][1])
    for name, engine in ((f"fixed K={args.k}", Engine(cfg, w, num_steps=args.k)),
                         ("adaptive by call", Engine(cfg, w, num_steps=args.k, adaptive=PerCallPolicy()))):
        ms = host_ms(engine, prompt, args.max_new_tokens, args.runs)
        print(f"{name}: host work outside prefill and decode, median {statistics.median(ms):.1f} ms "
              f"({min(ms):.1f}-{max(ms):.1f}) over {args.runs} generations", flush=True)


if __name__ == "__main__":
    main()
