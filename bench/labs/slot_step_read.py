"""`python -m bench.labs.slot_step_read`: what one host step of the server's slot engine costs, the device loop of
`cycles_per_step` cycles over every slot and the read of its results, without HTTP (the serving path's step as
`jaxspec.serving` runs it, for an A/B of the step's read between two checkouts run one after the other).

The embedded pair (jaxspec/default_model), greedy, fixed K = --k, --slots slots each given a prompt of the
coding set, --max-new tokens each. Per round: every slot prefilled, then steps until every slot is done; per step
`StepResult.seconds` (launch to results on the host) and the wall time. Reports the median over every step of
--rounds rounds after one warm-up round, their spread, and tokens per second of the decode. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax.numpy as jnp
import numpy as np

from bench.adaptive_prompts import PROMPTS, encode, load_pair
from jaxspec.sampling import SamplingParams
from jaxspec.serving.slot_engine import SlotEngine


def one_round(engine: SlotEngine, prompts: list[list[int]], max_new: int) -> tuple[list[float], list[float], int]:
    """(step seconds as the engine measured them, wall seconds a step, tokens emitted) of one batch to its end."""
    engine.reset()
    greedy = SamplingParams()
    for slot, tokens in enumerate(prompts):
        engine.prefill(slot, tokens, max_new, greedy, seed=slot)
    cancel = np.zeros(engine.max_batch, bool)
    steps, walls, emitted = [], [], 0
    while True:
        t0 = time.perf_counter()
        result = engine.step(cancel, any_sampled=False)
        walls.append(time.perf_counter() - t0)
        steps.append(result.seconds)
        emitted += sum(len(t) for t in result.tokens)
        if result.done[: len(prompts)].all():
            return steps, walls, emitted


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.slot_step_read", description=__doc__.split("\n")[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    if args.k < 0 or args.slots < 1 or args.max_new < 2 or args.rounds < 1:
        p.error("--k >= 0, --slots >= 1, --max-new >= 2 and --rounds >= 1")
    spec_cfg, weights, tok = load_pair(getattr(jnp, args.dtype))
    engine = SlotEngine(spec_cfg, weights, num_steps=args.k, max_batch=args.slots, max_context=512)
    prompts = [encode(tok, PROMPTS[i % len(PROMPTS)][1]) for i in range(args.slots)]
    one_round(engine, prompts, args.max_new)  # compiles and warms
    steps, walls, tokens, seconds = [], [], 0, 0.0
    for _ in range(args.rounds):
        s, w, n = one_round(engine, prompts, args.max_new)
        steps += s
        walls += w
        tokens += n
        seconds += sum(w)
    ms = lambda xs: dict(median=1e3 * statistics.median(xs), min=1e3 * min(xs), max=1e3 * max(xs))  # noqa: E731
    print(json.dumps(dict(k=args.k, slots=args.slots, max_new=args.max_new, rounds=args.rounds, steps=len(steps),
                          step_ms=ms(steps), wall_ms=ms(walls), tokens_per_s=tokens / seconds)))


if __name__ == "__main__":
    main()
