"""`python -m bench.labs.cond_cost`: what a data-dependent `lax.cond` costs per layer inside the on-device loop.

Issue 36 asks for an MoE path chosen at run time inside the program (by the step's count of unique experts). On a
GPU a conditional is either a node of the step's CUDA graph (the device picks the branch) or a thunk outside it
(the host reads the predicate, then launches the branch: a device-to-host wait per conditional). This lab times
programs of `--layers` links, each link one GEMV over its own [D, D] bf16 weight (distinct weights, so each link
reads HBM), `--iters` iterations a call, arranged as:
- top: one while loop (fixed-K generation's shape);
- cond_per_layer: the same with each link x = lax.cond(x[0, 0] > 0, x @ W_l, x @ V_l) (the predicate is data, the
  branches cost the same): the per-conditional price, against top;
- while_in_while: two runs of iters / 2 iterations inside an outer while loop;
- while_in_switch: the same runs each under a data-dependent lax.switch (the adaptive program's shape: the switch
  picks K, the branch loops over its cycles);
- guarded_whiles: a while loop per branch in sequence, each looping only while the choice names it (no conditional).
Reports the median of synchronised calls and the time per iteration, and whether the compiled program holds its
conditionals inside a command buffer (the optimized HLO's command_buffer computations). XLA_FLAGS are read at
start: run it once per flag set (bench/scripts/h200_cond_cost.sh).
Writes cond-cost-<platform>-<date>.json to --out.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import bench  # noqa: F401  (the engine's XLA flags)
from bench.report import write_json
from bench.timing import median_ms


def _links(weights_LDD, alt_LDD, cond: bool):
    """One iteration's work: each layer's GEMV (under a data-dependent conditional when `cond`)."""
    def link(x_1D, w_DD, v_DD):
        if not cond:
            return (x_1D @ w_DD).astype(x_1D.dtype)
        return jax.lax.cond(x_1D[0, 0] > 0, lambda x: (x @ w_DD).astype(x.dtype),
                            lambda x: (x @ v_DD).astype(x.dtype), x_1D)

    def body(x_1D):
        for layer in range(weights_LDD.shape[0]):
            x_1D = link(x_1D, weights_LDD[layer], alt_LDD[layer])
            x_1D = x_1D / (1e-3 + jnp.max(jnp.abs(x_1D)))  # keep the values finite over the iterations
        return x_1D

    return body


def _counted(body, n):
    """`body` n times in a while loop (the count is data: a loop, not an unrolled program)."""
    def run(x_1D, n=n):
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, body(c[1])), (jnp.int32(0), x_1D))[1]
    return run


def program(weights_LDD, alt_LDD, iters: int, structure: str):
    """The call: `iters` iterations of the links, arranged as `structure` (STRUCTURES)."""
    plain, conditioned = _links(weights_LDD, alt_LDD, False), _links(weights_LDD, alt_LDD, True)
    outer, inner = 2, iters // 2
    if structure == "top":  # fixed-K generation: one while loop
        run = _counted(plain, iters)
    elif structure == "cond_per_layer":
        run = _counted(conditioned, iters)
    elif structure == "while_in_while":  # runs of one kind inside an outer loop
        run = _counted(_counted(plain, inner), outer)
    elif structure == "while_in_switch":  # adaptive: the switch picks a branch, the branch loops over cycles
        def pick(x_1D):
            return jax.lax.switch((x_1D[0, 0] > 0).astype(jnp.int32), [_counted(plain, inner)] * 2, x_1D)
        run = _counted(pick, outer)
    elif structure == "guarded_whiles":  # a while loop per branch, in sequence; the unchosen exits at once
        def pick(x_1D):
            choice = (x_1D[0, 0] > 0).astype(jnp.int32)
            for branch in range(2):
                x_1D = jax.lax.while_loop(lambda c, b=branch: (c[0] < inner) & (c[2] == b),
                                          lambda c: (c[0] + 1, plain(c[1]), c[2]),
                                          (jnp.int32(0), x_1D, choice))[1]
            return x_1D
        run = _counted(pick, outer)
    else:
        raise ValueError(f"unknown structure {structure!r}")
    return jax.jit(run)


STRUCTURES = ("top", "cond_per_layer", "while_in_while", "while_in_switch", "guarded_whiles")


def conditionals_in_command_buffers(hlo_text: str) -> dict:
    """Counts of conditional instructions in the optimized HLO, and of those inside computations whose name says
    they are command buffers (XLA names them command_buffer*)."""
    total = len(re.findall(r"\bconditional\(", hlo_text))
    inside = 0
    for block in re.split(r"\n(?=\S)", hlo_text):
        if block.startswith("%command_buffer") or block.startswith("command_buffer"):
            inside += len(re.findall(r"\bconditional\(", block))
    return {"conditionals": total, "inside_command_buffers": inside,
            "command_buffer_computations": len(re.findall(r"^%?command_buffer\S*", hlo_text, re.M))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=32, help="while-loop iterations per call")
    ap.add_argument("--structures", nargs="+", default=list(STRUCTURES), choices=STRUCTURES)
    ap.add_argument("--label", default="default", help="names the flag set in the results")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    scale = args.dim ** -0.5
    w = (jax.random.normal(k1, (args.layers, args.dim, args.dim), jnp.float32) * scale).astype(jnp.bfloat16)
    v = (jax.random.normal(k2, (args.layers, args.dim, args.dim), jnp.float32) * scale).astype(jnp.bfloat16)
    x = jax.random.normal(k3, (1, args.dim), jnp.float32).astype(jnp.bfloat16)
    rows = {}
    for structure in args.structures:
        run = program(w, v, args.iters, structure)
        hlo = run.lower(x).compile().as_text()
        timing = median_ms(lambda: run(x), warmup=3, iters=15)
        rows[structure] = {**timing, **conditionals_in_command_buffers(hlo),
                           "per_iteration_us": timing["median_ms"] * 1e3 / args.iters}
        print(f"{args.label} {structure}: {timing['median_ms']:.3f} ms a call (min {timing['min_ms']:.3f}, max "
              f"{timing['max_ms']:.3f}), {rows[structure]['per_iteration_us']:.2f} us an iteration; "
              f"conditionals {rows[structure]['conditionals']}", flush=True)
    links = args.layers * args.iters
    per_cond_us = link_us = None
    if "top" in rows and "cond_per_layer" in rows:
        per_cond_us = (rows["cond_per_layer"]["median_ms"] - rows["top"]["median_ms"]) * 1e3 / links
        link_us = rows["top"]["median_ms"] * 1e3 / links
        print(f"{args.label}: {per_cond_us:.2f} us per conditional over a {link_us:.2f} us link "
              f"({links} conditionals a call)")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    write_json({
        "device": str(jax.devices()[0]), "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "label": args.label, "structures": args.structures, "layers": args.layers, "dim": args.dim,
        "iters": args.iters, "rows": rows,
        "per_conditional_us": per_cond_us, "per_link_us": link_us},
        args.out, f"cond-cost-{jax.default_backend()}-{args.label}-{stamp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
