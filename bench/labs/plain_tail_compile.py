"""`python -m bench.labs.plain_tail_compile`: what plain decoding inside the K loop's own call would cost to build
(issue 53). Adaptive by call pays one more call to go from a K loop to plain decoding; replayed, running the plain
steps in the same call lifts the rows where speculation never pays (docs/performance.md, "What reading a call's
result costs"). Each K loop would then hold a plain decode step beside its cycle. This lab compiles, cold and side by
side as `bench.compile_adaptive` does, the fixed engine's loop, the by-call set as the engine builds it, and the
same set with a plain tail after every K loop (`spec_loop_then_plain`: its while loop runs where the rule's limit
is negative, so the program is whole and the tail costs a predicate where it does not run). Kimi-K2.5 shapes from
shapes alone. Prints one line a depth and writes plain-tail-compile-<device>-<date>.json to --out.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.compile_adaptive import MAX_NEW, abstract_pair, fixed_loop_spec, per_call_specs, timed_compile
from bench.step import bench_config
from jaxspec.adaptive_calls import RULE_LIMIT, PerCallPolicy, spec_loop, to_plain
from jaxspec.adaptive_calls_run import never_leaving
from jaxspec.baseline_step import baseline_step


def spec_loop_then_plain(w, state, sp, rule_F, *, cfg, k: int, window: int, greedy: bool, max_new_tokens: int):
    """`spec_loop`, then plain decode steps to the end of the batch where `rule_F`'s limit is negative."""
    state, summary = spec_loop(w, state, sp, rule_F, cfg=cfg, k=k, window=window, greedy=greedy,
                               max_new_tokens=max_new_tokens)
    go = rule_F[RULE_LIMIT] < 0
    step = functools.partial(baseline_step, cfg=cfg, greedy=greedy, max_new_tokens=max_new_tokens)
    plain = jax.lax.while_loop(lambda s: go & jnp.any(~s.done), lambda s: step(w, s, sp), to_plain(state))
    state = state.replace(target_cache=plain.target_cache, pending=plain.pending, done=plain.done,
                          generated=plain.generated, out_tokens=plain.out_tokens, key=plain.key)
    return state, summary


def tailed_specs(spec_cfg, sw, state, steps: tuple[int, ...], window: int):
    """`per_call_specs` with every K >= 1 loop followed by its plain tail."""
    specs = per_call_specs(spec_cfg, sw, state, steps, window)
    for i, k in enumerate(steps):
        if k > 0:
            fn = functools.partial(spec_loop_then_plain, cfg=spec_cfg, k=k, window=window, greedy=True,
                                   max_new_tokens=MAX_NEW)
            specs[i] = (lambda w, s, r, fn=fn: fn(w, s, {}, r), (sw, state, never_leaving(0)), (1,))
    return specs


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.plain_tail_compile", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 61])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help="small dimensions (a CPU smoke run)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.k < 1 or min(args.layers) < 3:
        p.error("--k must be >= 1 and --layers >= 3 (the draft taps three distinct target layers)")
    jax.config.update("jax_enable_compilation_cache", False)
    steps, window = PerCallPolicy().compiled(args.k)
    rows = []
    for layers in args.layers:
        spec_cfg, sw, state = abstract_pair(bench_config(layers, args.tiny), args.tiny)
        row = dict(layers=layers, fixed_s=timed_compile([fixed_loop_spec(spec_cfg, sw, state, args.k)]),
                   per_call_s=timed_compile(per_call_specs(spec_cfg, sw, state, steps, window)),
                   tailed_s=timed_compile(tailed_specs(spec_cfg, sw, state, steps, window)))
        rows.append(row)
        print(f"{layers} layers: fixed K={args.k} {row['fixed_s']:.2f} s; by call {row['per_call_s']:.2f} s "
              f"({row['per_call_s'] / row['fixed_s']:.2f}x); with plain tails {row['tailed_s']:.2f} s "
              f"({row['tailed_s'] / row['fixed_s']:.2f}x)", flush=True)
    dev = jax.devices()[0]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"plain-tail-compile-{dev.platform}-{date}.json").write_text(json.dumps(dict(
        device=dev.device_kind, jax=jax.__version__, k=args.k, steps=list(steps), cpus=os.cpu_count(), rows=rows),
        indent=1))


if __name__ == "__main__":
    main()
