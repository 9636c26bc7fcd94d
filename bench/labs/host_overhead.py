"""`python -m bench.labs.host_overhead`: where a synchronised step's time beyond the device's goes (the host round
trip: `bench.step`'s synchronised median minus its queued mean, ~0.45 ms at B=1 1k on the H200).

On a Kimi-K2.5-shaped model of N layers (INT4 experts, random weights), per token count:
- the step synchronised (median) and queued back to back (mean), as bench.step times them;
- an empty program over the same arguments (weights, tokens, positions, cache; returns tokens + 1): what
  dispatching this many arguments and waiting costs with no device work; and the same program over the first
  1, 10, 30, ... of them (`--arg-counts`), so the cost per argument and the fixed cost of a call separate;
- a trace of `--traced` synchronised steps (jax.profiler): per step, the host time from the call to the first
  kernel's start and from the last kernel's end to the return, the device span, and the host events that take
  the most time per step (by name, all threads; nested events both count).
Writes host-overhead-<platform>-<date>.json to --out. On a CPU the device columns are empty (no device plane).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import collections  # noqa: E402
import glob  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from bench.report import run_stamp, write_json  # noqa: E402
from bench.step import make_step, random_cache, random_model, step_inputs  # noqa: E402
from bench.timing import median_ms  # noqa: E402
from model.config import Kernels  # noqa: E402
from model.kv_cache import round_capacity  # noqa: E402

MARK = "host_overhead_step"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--traced", type=int, default=5, help="synchronised steps under the profiler")
    p.add_argument("--top", type=int, default=30, help="host events listed per token count")
    p.add_argument("--tiny", action="store_true", help="small dims (CPU smoke run)")
    p.add_argument("--arg-counts", type=int, nargs="*", default=[1, 10, 30, 60],
                   help="empty programs over this many of the step's arguments (plus one over all of them)")
    p.add_argument("--out", default=str(Path(__file__).parents[1] / "results"))
    return p.parse_args(argv)


def trace_steps(run, n: int) -> dict:
    """`n` synchronised calls of `run()` under the profiler, each inside a TraceAnnotation."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(n):
                with jax.profiler.TraceAnnotation(MARK):
                    jax.block_until_ready(run())
        [path] = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        data = ProfileData.from_file(path)
        host, kernels, marks = collections.defaultdict(lambda: [0.0, 0]), [], []
        for plane in data.planes:
            on_device = plane.name.startswith("/device:") and "CUSTOM" not in plane.name
            for line in plane.lines:
                if on_device and not line.name.startswith("Stream"):
                    continue
                for ev in line.events:
                    if on_device:
                        kernels.append((ev.start_ns, ev.start_ns + ev.duration_ns))
                    elif ev.name == MARK:
                        marks.append((ev.start_ns, ev.start_ns + ev.duration_ns))
                    else:
                        host[ev.name][0] += ev.duration_ns
                        host[ev.name][1] += 1
    steps = []
    for start, end in sorted(marks):
        inside = [k for k in kernels if start <= k[0] <= end]
        row = dict(wall_us=(end - start) / 1e3)
        if inside:
            first, last = min(k[0] for k in inside), max(k[1] for k in inside)
            row.update(call_to_first_kernel_us=(first - start) / 1e3, device_span_us=(last - first) / 1e3,
                       last_kernel_to_return_us=(end - last) / 1e3, kernels=len(inside))
        steps.append(row)
    events = sorted(((name, ns / 1e3 / n, count / n) for name, (ns, count) in host.items()), key=lambda r: -r[1])
    return dict(steps=steps, host_events=[dict(name=nm[:160], us_per_step=us, calls_per_step=c) for nm, us, c in events])


def main(argv=None):
    args = parse_args(argv)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    stamp = run_stamp()
    cfg, w = random_model(args.layers, args.tiny)
    result = dict(**stamp.fields,
                  layers=args.layers, context=args.context, xla_flags=os.environ.get("XLA_FLAGS", ""), rows=[])
    step_fn = make_step(cfg, Kernels())
    empty = jax.jit(lambda w, tokens_BT, positions_BT, cache: tokens_BT + 1)
    for t in args.tokens:
        key = jax.random.PRNGKey(t)
        cache = random_cache(cfg, 1, round_capacity(args.context + 16), args.context, key)
        tokens_BT, positions_BT = step_inputs(cfg, 1, t, args.context, key)
        holder = {"cache": cache}

        def run():
            out, holder["cache"], _ = step_fn(w, tokens_BT, positions_BT, holder["cache"])
            return out

        step = median_ms(run, warmup=3, iters=args.iters)
        nothing = median_ms(lambda: empty(w, tokens_BT, positions_BT, holder["cache"]), warmup=3, iters=args.iters)
        traced = trace_steps(run, args.traced)
        all_leaves = [tokens_BT, *jax.tree_util.tree_leaves((w, positions_BT, holder["cache"]))]
        leaves = len(all_leaves)
        by_count = {}
        for n in sorted({c for c in args.arg_counts if 0 < c < leaves}):
            first_n = jax.jit(lambda *a: a[0] + 1)  # tokens + 1 over the first n arguments
            timing = median_ms(lambda n=n, f=first_n: f(*all_leaves[:n]), warmup=3, iters=args.iters)
            by_count[n] = dict(sync_us=1e3 * timing["median_ms"], queued_us=1e3 * timing["queued_mean_ms"])
        row = dict(tokens=t, arguments=leaves, step_sync_ms=step["median_ms"], step_queued_ms=step["queued_mean_ms"],
                   empty_program_sync_us=1e3 * nothing["median_ms"], empty_program_queued_us=1e3 * nothing["queued_mean_ms"],
                   empty_program_by_arguments=by_count, **traced)
        result["rows"].append(row)
        log(f"T={t}: step {row['step_sync_ms']:.3f} ms synchronised, {row['step_queued_ms']:.3f} queued; empty program "
            f"over the same {leaves} arguments {row['empty_program_sync_us']:.0f} us synchronised, "
            f"{row['empty_program_queued_us']:.0f} queued")
        for n, c in by_count.items():
            log(f"  empty program over {n} arguments: {c['sync_us']:.0f} us synchronised, {c['queued_us']:.0f} queued")
        for i, s in enumerate(row["steps"]):
            log(f"  traced step {i}: " + ", ".join(f"{k} {v:.0f}" for k, v in s.items()))
        for e in row["host_events"][:args.top]:
            log(f"  host {e['us_per_step']:9.1f} us/step  {e['calls_per_step']:6.1f} calls  {e['name'][:110]}")
    path = write_json(result, Path(args.out), f"host-overhead-{stamp.suffix}")
    log(f"wrote {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
