"""`python -m bench.labs.dispatch_args`: what one call of a compiled program costs the host for the weights' arguments
alone, at a depth: an empty program (x + 1) over the random K2.5-shaped weights of --layers layers (`--tiny` dims
on a CPU), called as a jitted function and as the engine's ahead-of-time compiled program
(`jaxspec.sharded.compile_programs`), synchronised; median of --calls calls after 20 warm-up calls. It separates
the host's argument handling from the rest of a device loop call's fixed price (the cost table's intercept).
`--trace N`: N more calls of the compiled program under jax.profiler.trace, and the host's events of at least 2 us
grouped by name (the Python thread's call, XLA's execution and its steps, the driver's calls): where a call's host
time goes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from bench.step import bench_config, draw_weights
from jaxspec.sharded import compile_programs


def call_us(call, w, calls: int) -> float:
    x = jnp.zeros((), jnp.int32)
    for _ in range(20):
        x = call(w, x)
    jax.block_until_ready(x)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        x = call(w, x)
        jax.block_until_ready(x)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.dispatch_args", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--tiny", action="store_true", help="small dims (a CPU run): the argument count is the same")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--trace", type=int, default=0, help="this many more calls traced (host events); 0: none")
    args = p.parse_args(argv)
    w = draw_weights(bench_config(args.layers, args.tiny), args.tiny, moe_layers="repeated")

    def empty(w, x):
        return x + 1

    jitted = jax.jit(empty, donate_argnums=1)
    compiled = compile_programs([(empty, (w, jnp.zeros((), jnp.int32)), (1,))])[0]
    leaves = len(jax.tree_util.tree_leaves(w))
    print(f"{jax.devices()[0].device_kind}, {args.layers} layers, {leaves} weight arrays: jitted "
          f"{call_us(jitted, w, args.calls):.0f} us, compiled {call_us(compiled, w, args.calls):.0f} us a call "
          f"(median of {args.calls})", flush=True)
    if args.trace:
        traced_host_time(compiled, w, args.trace)


def traced_host_time(compiled, w, calls: int) -> None:
    """`calls` synchronised calls under the profiler; prints the host events of >= 2 us grouped by name, a call."""
    from bench.labs.step_profile import _traced, by_kernel, host_events

    def run():
        x = jnp.zeros((), jnp.int32)
        for _ in range(calls):
            x = jax.block_until_ready(compiled(w, x))
        return x

    events, wall_ms = _traced(run, lambda path: host_events(path, min_us=2.0))
    print(f"traced: {calls} calls in {wall_ms:.2f} ms; host events of >= 2 us, a call:")
    for g in by_kernel(events, tag="line")[:25]:
        print(f"  {g['ns'] / 1e3 / calls:9.1f} us  {g['count'] / calls:6.1f}x  max {g['max_ns'] / 1e3:8.1f} us  "
              f"{g['line'][:24]:24s}  {g['kernel'][:70]}", flush=True)


if __name__ == "__main__":
    main()
