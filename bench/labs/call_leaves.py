"""`python -m bench.labs.call_leaves`: what a device call costs the host per argument array (issue 53).

`bench.labs.call_price` found a call that runs no cycle of the K loop costing 1.1 ms at 4 layers and 4.0 ms at 61
(H200, run 1915), and one more call of a by-call generation 1.9 / 4.0 ms. A call's arguments are the weights and the
state as separate arrays: about 21 a layer, ~1450 at 61 layers. This lab times calls that do next to nothing on one
small array while taking N other arrays (kept as arguments, unread), for N in --leaves, so the price per argument
array is the slope; beside them the same N arrays packed into one (what stacking per-layer weights would pass), and
a call whose body is an empty `while` loop over the state (a loop's entry and its first predicate, as the empty K
loop runs them). Per row: the median and spread over --calls of the call dispatched and waited for, and of its
dispatch alone (the host's part while an earlier call may still run). Writes call-leaves-<device>-<date>.json and
.md to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.report import run_stamp


def programs(n: int, width: int):
    """{variant: (compiled program, its arguments)} for N argument arrays of `width` float32 each."""
    leaves = [jnp.full((width,), i, jnp.float32) for i in range(n)]
    packed = jnp.stack(leaves) if n else jnp.zeros((0, width), jnp.float32)
    state = jnp.zeros((width,), jnp.float32)

    def touch(w, s):  # the arrays are arguments the program keeps, not inputs it reads
        return s + 1.0

    def empty_loop(w, s):
        return jax.lax.while_loop(lambda c: c[0] < 0, lambda c: (c[0] + 1, c[1] + 1.0), (jnp.int32(0), s))[1]

    out = {}
    for name, fn, w in (("separate", touch, leaves), ("packed", touch, packed), ("separate_empty_loop", empty_loop,
                                                                                 leaves)):
        compiled = jax.jit(fn, keep_unused=True, donate_argnums=1).lower(w, state).compile()
        out[name] = (compiled, w)
    return out, state


def time_calls(compiled, w, state, calls: int) -> dict:
    """Median and range (us) of `calls` calls each dispatched and waited for, and of the dispatch alone."""
    s = jax.block_until_ready(compiled(w, jnp.copy(state)))
    waited, dispatched = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        s = compiled(w, s)
        t1 = time.perf_counter()
        jax.block_until_ready(s)
        t2 = time.perf_counter()
        dispatched.append(1e6 * (t1 - t0))
        waited.append(1e6 * (t2 - t0))
    return dict(call_us=statistics.median(waited), call_us_range=[min(waited), max(waited)],
                dispatch_us=statistics.median(dispatched), dispatch_us_range=[min(dispatched), max(dispatched)])


def markdown(result: dict) -> str:
    lines = [f"# A call's price per argument array: {result['device']}, jax {result['jax']}, {result['date']}", "",
             f"Calls of a program that adds 1 to a [{result['width']}] array while taking N other arrays; median of "
             f"{result['calls']} calls (bench/labs/call_leaves.py). us.", "",
             "| N | separate: call | dispatch | packed into one: call | dispatch | empty while loop: call | dispatch |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        cells = [f"{row[v]['call_us']:.1f} | {row[v]['dispatch_us']:.1f}"
                 for v in ("separate", "packed", "separate_empty_loop")]
        lines.append(f"| {row['leaves']} | " + " | ".join(cells) + " |")
    if result.get("slope_us_per_array") is not None:
        lines += ["", f"Slope of the separate arrays' call over N: {result['slope_us_per_array']:.2f} us an array."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.call_leaves", description=__doc__.split("\n")[0])
    p.add_argument("--leaves", type=int, nargs="+", default=[0, 100, 400, 1500])
    p.add_argument("--width", type=int, default=256, help="elements of each argument array")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if min(args.leaves) < 0 or args.width < 1 or args.calls < 1:
        p.error("--leaves must be >= 0, --width and --calls >= 1")
    rows = []
    for n in args.leaves:
        progs, state = programs(n, args.width)
        row = {"leaves": n}
        for name, (compiled, w) in progs.items():
            row[name] = time_calls(compiled, w, state, args.calls)
        rows.append(row)
        print(f"N={n}: " + ", ".join(f"{v} {row[v]['call_us']:.1f} us (dispatch {row[v]['dispatch_us']:.1f})"
                                     for v in progs), flush=True)
    slope = None
    if len(rows) > 1:
        slope = float(np.polyfit([r["leaves"] for r in rows], [r["separate"]["call_us"] for r in rows], 1)[0])
    stamp = run_stamp()
    result = dict(**stamp.fields, width=args.width, calls=args.calls, rows=rows, slope_us_per_array=slope)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"call-leaves-{stamp.suffix}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
