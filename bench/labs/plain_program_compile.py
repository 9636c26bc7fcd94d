"""`python -m bench.labs.plain_program_compile`: what the by-call set's K = 0 program costs to build for a GPU, on a
machine without one (jax's CUDA plugin compiles for an H200 target: `bench.labs.gpu_census`): the fixed engine's
K = 4 loop, plain decoding's own loop (`plain_loop`, K = 0 without probes), the plain loop that keeps the draft
current (`probe_loop`, K = 0 with them) and the by-call K = 4 loop, each compiled alone and cold (trace, lower,
XLA), in --rounds rounds. Kimi-K2.5 shapes from `bench.compile_adaptive` (INT4 experts, batch 1, 1k context). One
program at a time: the seconds add up as a one-core build would, where the engine compiles its set side by side.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from bench.compile_adaptive import abstract_pair, fixed_loop_spec, per_call_specs
from bench.labs.gpu_census import compile_for, gpu_device
from bench.step import bench_config
from jaxspec.adaptive_calls import PerCallPolicy


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.plain_program_compile", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 61])
    p.add_argument("--rounds", type=int, default=2)
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
