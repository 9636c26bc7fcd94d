"""`python -m bench.labs.plain_program_compile`: what the by-call set's K = 0 program costs to build for a GPU, on a
machine without one (jax's CUDA plugin compiles for an H200 target: `bench.labs.gpu_census`): the fixed engine's K =
4 loop, plain decoding's own loop (`plain_loop`, K = 0 without probes), the plain loop that keeps the draft current
(`probe_loop`, K = 0 with them) and the by-call K = 4 loop, each compiled alone and cold (trace, lower, XLA), in
--rounds rounds; with --parts, what the probe loop is made of: its plain step (`jaxspec.adaptive.plain_decode` over
the speculative state) in one loop, and the same in two nested loops (blocks) without the catch-up. Kimi-K2.5 shapes
from `bench.compile_adaptive` (INT4 experts, batch 1, 1k context). One program at a time: the seconds add up as a
one-core build would, where the engine compiles its set side by side.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from bench.compile_adaptive import MAX_NEW, abstract_pair, fixed_loop_spec, per_call_specs
from bench.labs.gpu_census import compile_for, gpu_device
from bench.step import bench_config
from jaxspec.adaptive import empty_backlog, plain_decode
from jaxspec.adaptive_calls import PerCallPolicy


def plain_steps_spec(spec_cfg, sw, state, nested: bool, width: int = 32):
    """(fn, args, donate): `plain_decode` steps over the speculative state until a limit, in one loop or in blocks of
    `width` (a loop of loops, as `probe_loop` runs them, without its catch-up)."""
    b = state.pending.shape[0]
    aux = len(spec_cfg.target.aux_layer_ids) * spec_cfg.target.hidden_size

    def fn(w, s, n):
        empty = empty_backlog(b, width, aux, s.draft_hidden.dtype)

        def step(c):
            return plain_decode(w, spec_cfg, c[0], c[1], {}, greedy=True, max_new_tokens=MAX_NEW)

        def steps(s, until):
            return jax.lax.while_loop(lambda c: jnp.any(~c[0].done) & (c[0].cycles < until), step, (s, empty))[0]

        if not nested:
            return steps(s, n)
        return jax.lax.while_loop(lambda x: jnp.any(~x.done) & (x.cycles < n),
                                  lambda x: steps(x, jnp.minimum(x.cycles + width, n)), s)

    return fn, (sw, state, jax.ShapeDtypeStruct((), jnp.int32)), (1,)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.plain_program_compile", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 61])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--parts", action="store_true", help="also the probe loop's plain steps, in one loop and nested")
    args = p.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    dev = gpu_device()
    policy = PerCallPolicy()
    steps, window, tails = policy.compiled(4)
    for layers in args.layers:
        spec_cfg, sw, state = abstract_pair(bench_config(layers, False), False)
        probed = per_call_specs(spec_cfg, sw, state, steps, window, tails, policy.probe_every)
        unprobed = per_call_specs(spec_cfg, sw, state, steps, window, tails, 0)
        rows = {"fixed K = 4 loop": fixed_loop_spec(spec_cfg, sw, state, 4), "plain_loop": unprobed[0],
                "probe_loop": probed[0], "by-call K = 4 loop": probed[-1]}
        if args.parts:
            rows["plain_decode, one loop"] = plain_steps_spec(spec_cfg, sw, state, nested=False)
            rows["plain_decode, nested loops"] = plain_steps_spec(spec_cfg, sw, state, nested=True)
        seconds = {name: [] for name in rows}
        for _ in range(args.rounds):
            for name, (fn, fn_args, donate) in rows.items():
                jax.clear_caches()
                t0 = time.perf_counter()
                compile_for(fn, fn_args, donate, dev)
                seconds[name].append(time.perf_counter() - t0)
        for name, s in seconds.items():
            print(f"{layers} layers, {name}: {statistics.median(s):.1f} s (rounds: "
                  f"{', '.join(f'{x:.1f}' for x in s)})", flush=True)


if __name__ == "__main__":
    main()
