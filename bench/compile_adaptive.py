"""`python -m bench.compile_adaptive`: what adaptive speculation by call costs to build against the fixed-K engine,
by depth. The fixed-K engine compiles one device loop of K-draft cycles; adaptive by call compiles one loop per K of
its set (`jaxspec.adaptive_calls.spec_loop`, and for K = 0 `probe_loop`, plain decoding that keeps the draft
current) side by side, as `Engine.generate` does
(`jaxspec.sharded.compile_programs`: one thread a program). Kimi-K2.5 shapes with INT4 experts at batch 1 over a 1k
context, built from shapes alone (nothing is drawn or run), JAX's persistent cache off so every compile is cold.
Writes compile-adaptive-<device>-<date>.json and .md to --out.

    python -m bench.compile_adaptive --layers 4 61
    python -m bench.compile_adaptive --tiny --layers 3 --out /tmp/ca      # a CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.compile_depth import CONTEXT, abstract_target
from bench.cycle import initial_state, spec_configs, spec_pair
from bench.report import fmt, write_report
from bench.step import bench_config
from jaxspec.adaptive_calls import PerCallPolicy, plain_loop, plain_to_the_end, probe_loop, spec_loop, to_plain
from jaxspec.adaptive_calls_run import never_leaving
from jaxspec.models import SpecWeights
from jaxspec.sharded import compile_programs
from jaxspec.spec_step import speculative_cycle
from jaxspec.state import on_host, progress
from model.kv_cache import round_capacity

MAX_NEW = 128


def abstract_pair(cfg, tiny: bool):
    """(SpecConfig, abstract SpecWeights, abstract SpecState) at `cfg`'s depth."""
    w = abstract_target(cfg)
    spec_cfg, dcfg = spec_configs(cfg, tiny)
    sw = SpecWeights(target=w, draft=jax.eval_shape(lambda: spec_pair(w, cfg, tiny)[2].draft))
    capacity = round_capacity(CONTEXT + MAX_NEW + 16)
    state = jax.eval_shape(lambda: initial_state(cfg, dcfg, 1, CONTEXT, capacity, jax.random.PRNGKey(0)))
    return spec_cfg, sw, state


def fixed_loop_spec(spec_cfg, sw, state, k: int):
    """The fixed-K engine's device loop (`Engine.generate`'s `loop_spec`), greedy, as (fn, args, donate)."""
    cycle = functools.partial(speculative_cycle, cfg=spec_cfg, k=k, greedy=True, max_new_tokens=MAX_NEW)

    def loop(w, s):
        s = jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: cycle(w, s, {}), s)
        return s, on_host(progress(s))

    return loop, (sw, state), (1,)


def per_call_specs(spec_cfg, sw, state, steps: tuple[int, ...], window: int, tails: tuple[int, ...],
                   probe_every: int):
    """Adaptive by call's programs for the K set `steps` (the K in `tails` with their plain tail; K = 0 the plain
    loop that keeps the draft current, or with `probe_every` 0 plain decoding's own loop), as
    `jaxspec.adaptive_calls_run._programs` builds them for the EAGLE-3 draft."""
    specs = []
    for k in steps:
        if k == 0 and probe_every > 0:
            fn = functools.partial(probe_loop, cfg=spec_cfg, greedy=True, max_new_tokens=MAX_NEW, width=probe_every)
            specs.append((lambda w, s, f, fn=fn: fn(w, s, {}, f), (sw, state, plain_to_the_end(0)), (1,)))
        elif k == 0:
            fn = functools.partial(plain_loop, cfg=spec_cfg, greedy=True, max_new_tokens=MAX_NEW)
            specs.append((lambda w, s, n, fn=fn: fn(w, s, {}, n), (sw, jax.eval_shape(to_plain, state),
                                                                    jax.ShapeDtypeStruct((), jnp.int32)), (1,)))
        else:
            fn = functools.partial(spec_loop, cfg=spec_cfg, k=k, window=window, greedy=True, max_new_tokens=MAX_NEW,
                                   plain_tail=k in tails)
            specs.append((lambda w, s, r, fn=fn: fn(w, s, {}, r), (sw, state, never_leaving(0)), (1,)))
    return specs


def timed_compile(specs) -> float:
    jax.clear_caches()  # JAX keeps what it traced and compiled in memory too
    t0 = time.perf_counter()
    compile_programs(specs)
    return time.perf_counter() - t0


def markdown(result: dict) -> str:
    lines = [f"# Building adaptive by call against fixed K: {result['device']}, jax {result['jax']}, {result['date']}",
             "", f"Kimi-K2.5 shapes, INT4 experts, batch 1, {result['context']}-token context, greedy, from shapes; "
             f"cold compiles (trace + lower + XLA), seconds. Fixed: one loop of K = {result['k']} cycles; by call: "
             f"the loops of K set {result['steps']} compiled side by side on {result['cpus']} host cores.", "",
             "| layers | fixed K loop | by call, all loops | by call / fixed | slowest by-call loop alone |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['layers']} | {fmt(r['fixed_s'], 2)} | {fmt(r['per_call_s'], 2)} | "
                     f"{fmt(r['per_call_s'] / r['fixed_s'], 2)} | {fmt(r.get('slowest_alone_s'), 2)} |")
    for e in result["errors"]:
        lines.append(f"\nerror: {e}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.compile_adaptive", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 61])
    p.add_argument("--k", type=int, default=4, help="the fixed engine's K and the by-call set's largest")
    p.add_argument("--alone", action="store_true", help="also compile the by-call set's largest-K loop alone")
    p.add_argument("--tiny", action="store_true", help="small dimensions (a CPU smoke run)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    if args.k < 1 or min(args.layers) < 3:
        p.error("--k must be >= 1 and --layers >= 3 (the draft taps three distinct target layers)")
    jax.config.update("jax_enable_compilation_cache", False)
    dev = jax.devices()[0]
    policy = PerCallPolicy()
    steps, window, tails = policy.compiled(args.k)
    result = dict(device=dev.device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(),
                  context=CONTEXT, k=args.k, steps=list(steps), cpus=os.cpu_count(), rows=[], errors=[])
    stem = f"compile-adaptive-{dev.platform}-{result['date']}"
    for layers in args.layers:
        try:
            spec_cfg, sw, state = abstract_pair(bench_config(layers, args.tiny), args.tiny)
            row = dict(layers=layers, fixed_s=timed_compile([fixed_loop_spec(spec_cfg, sw, state, args.k)]))
            specs = per_call_specs(spec_cfg, sw, state, steps, window, tails, policy.probe_every)
            row["per_call_s"] = timed_compile(specs)
            if args.alone:
                row["slowest_alone_s"] = timed_compile(specs[-1:])
            result["rows"].append(row)
            print(f"{layers:3d} layers: fixed K={args.k} {row['fixed_s']:.2f} s, by call {row['per_call_s']:.2f} s "
                  f"({row['per_call_s'] / row['fixed_s']:.2f}x)", flush=True)
        except Exception as e:  # noqa: BLE001 - one depth's failure is reported, the others still run
            result["errors"].append(f"{layers} layers: {type(e).__name__}: {e}"[:2000])
            print(result["errors"][-1], flush=True)
        write_report(result, Path(args.out), stem, markdown)  # a run cut short keeps what it measured
    return result


if __name__ == "__main__":
    main()
