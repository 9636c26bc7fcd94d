"""`python -m bench.labs.set_program_compile`: what each program of adaptive by call's set costs to build for a GPU,
on a machine without one (jax's CUDA plugin compiles for an H200 target: `bench.labs.gpu_census`), split into trace,
lowering and XLA's compile: the fixed engine's K = 4 loop, then the by-call set's loops (`probe_loop` for K = 0, the
K loops), K = 1's loop also with its plain tail. One program at a time, cold (no autotuning on this path), Kimi-K2.5
shapes from `bench.compile_adaptive` (INT4 experts, batch 1, 1k context). The engine builds its set side by side,
one thread a program, so the set's build follows its slowest program: this lab says which that is.
"""

from __future__ import annotations

import argparse
import time

import jax

from bench.compile_adaptive import abstract_pair, fixed_loop_spec, per_call_specs
from bench.labs.gpu_census import HOPPER, gpu_device
from bench.step import bench_config
from jaxspec.adaptive_calls import PerCallPolicy
from model.kernels.target import compiling_for


def program_specs(layers: int) -> dict:
    """{name: (fn, args, donate)}: the fixed K = 4 loop, the by-call set's loops untailed, K = 1's with its tail."""
    policy = PerCallPolicy()
    steps, window, tails = policy.compiled(4)
    spec_cfg, sw, state = abstract_pair(bench_config(layers, False), False)
    specs = {"fixed K = 4 loop": fixed_loop_spec(spec_cfg, sw, state, 4)}
    untailed = per_call_specs(spec_cfg, sw, state, steps, window, (), policy.probe_every)
    specs.update({("probe_loop" if k == 0 else f"K = {k} loop"): spec for k, spec in zip(steps, untailed)})
    tailed = per_call_specs(spec_cfg, sw, state, steps, window, tails, policy.probe_every)
    specs.update({f"K = {k} loop with its plain tail": tailed[steps.index(k)] for k in tails})
    return specs


def timed_build(fn, args, donate, device) -> tuple[float, float, float]:
    """(trace, lower, compile) seconds of `fn` for `device` from abstract `args`."""
    jax.clear_caches()
    sharding = jax.sharding.SingleDeviceSharding(device)
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), args)
    t0 = time.perf_counter()
    with compiling_for("gpu", HOPPER):
        traced = jax.jit(fn, donate_argnums=donate).trace(*shapes)
        t1 = time.perf_counter()
        lowered = traced.lower(lowering_platforms=("cuda",))
    t2 = time.perf_counter()
    lowered.compile()
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.set_program_compile", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=61)
    args = p.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    device = gpu_device()
    for name, (fn, fn_args, donate) in program_specs(args.layers).items():
        trace_s, lower_s, compile_s = timed_build(fn, fn_args, donate, device)
        print(f"{args.layers} layers, {name}: trace {trace_s:.1f} s, lower {lower_s:.1f} s, XLA {compile_s:.1f} s",
              flush=True)


if __name__ == "__main__":
    main()
