"""`python -m bench.labs.graph_launch_lab`: what the host pays to launch one XLA program's CUDA graph, per kernel in it.

A synchronised decode step pays ~0.5 ms more than the same steps queued back to back (bench.step), and run 12's
trace put most of it in the host's `cuGraphLaunch` of the step's one graph (~4 us for each of its 134 kernels).
This lab asks whether that is the price of any kernel node or of some kinds: programs of N links (N from
`--links`), each link a reduction and the elementwise op it feeds (two XLA kernels that XLA cannot fuse), with
optionally one Pallas kernel per `--every` links, Triton or Mosaic GPU (`--kinds`). Per program: the median of
synchronised calls, the mean of queued calls, their difference (the host's part that the device does not hide),
and the kernels one call launches (counted from a profiler trace). The per-kernel cost is the slope over N.
Writes graph-launch-lab-<platform>-<date>.json to --out. On a CPU only the XLA programs run (a smoke check).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import bench  # noqa: F401  (the engine's XLA flags)
from bench.report import run_stamp, write_json
from bench.labs.step_profile import traced_events
from bench.timing import median_ms

KINDS = ("xla", "triton", "mosaic")
SHAPE = (8, 128)  # 1024 floats per array (TMA copies take <= 256 a dimension): every kernel is launch-bound


def _pallas_add_one(kind: str):
    """A one-program Pallas kernel that adds 1 to a SHAPE float32 array: Triton, or Mosaic GPU (TMA in and out,
    as the engine's MoE kernels move their tiles)."""
    from jax.experimental import pallas as pl

    out = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    if kind == "triton":
        from jax.experimental.pallas import triton as pl_triton

        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...] + 1.0

        return pl.pallas_call(body, out_shape=out, compiler_params=pl_triton.CompilerParams(num_warps=4),
                              name="add_one_triton")
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def kernel(x_gmem, o_gmem):
        def scoped(x_smem, o_smem, barrier):
            plgpu.copy_gmem_to_smem(x_gmem, x_smem, barrier)
            plgpu.barrier_wait(barrier)
            o_smem[...] = x_smem[...] + 1.0
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM(SHAPE, jnp.float32), plgpu.SMEM(SHAPE, jnp.float32),
                      plgpu.Barrier(num_arrivals=1))

    return plgpu.kernel(kernel, out_type=out, grid=(1,), grid_names=("one",))


def make_program(links: int, kind: str, every: int):
    """x -> `links` times (x + 1e-3 * sum(x)), with a Pallas add-one after every `every`-th link for kind
    triton / mosaic: 2 x links XLA kernels plus links // every Pallas kernels."""
    pallas = None if kind == "xla" else _pallas_add_one(kind)

    def program(x):
        for i in range(links):
            x = x * 0.5 + 1e-3 * jnp.sum(x)
            if pallas is not None and (i + 1) % every == 0:
                x = pallas(x)
        return x

    return jax.jit(program)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--links", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--every", type=int, default=4, help="one Pallas kernel per this many links")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=str(Path(__file__).parents[1] / "results"))
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.every < 1 or min(args.links) < 1:
        raise SystemExit("--every and --links must be >= 1")
    log = functools.partial(print, flush=True)
    stamp = run_stamp()
    dev = stamp.device
    kinds = [k for k in args.kinds if k == "xla" or dev.platform == "gpu"]  # Pallas GPU kernels need the GPU
    result = dict(**stamp.fields, every=args.every, rows=[], slopes={})
    x = jnp.ones(SHAPE, jnp.float32)
    for kind in kinds:
        for links in args.links:
            run = functools.partial(make_program(links, kind, args.every), x)
            stats = median_ms(run, warmup=5, iters=args.iters)
            events, _ = traced_events(run)
            row = dict(kind=kind, links=links, kernels=len(events), sync_ms=stats["median_ms"],
                       queued_ms=stats["queued_mean_ms"], host_ms=stats["median_ms"] - stats["queued_mean_ms"])
            result["rows"].append(row)
            log(f"{kind:6s} links {links:4d}: {row['kernels']:4d} kernels, sync {row['sync_ms'] * 1e3:8.1f} us, "
                f"queued {row['queued_ms'] * 1e3:8.1f} us, sync - queued {row['host_ms'] * 1e3:8.1f} us")
        rows = [r for r in result["rows"] if r["kind"] == kind]
        if len(rows) > 1:
            k = np.array([r["kernels"] for r in rows], float)
            fit = {m: float(np.polyfit(k, [r[m] for r in rows], 1)[0]) * 1e3 for m in ("sync_ms", "queued_ms")}
            result["slopes"][kind] = {f"{m[:-3]}_us_per_kernel": v for m, v in fit.items()}
            log(f"{kind}: per kernel {fit['sync_ms']:.2f} us synchronised, {fit['queued_ms']:.2f} us queued")
    path = write_json(result, Path(args.out), f"graph-launch-lab-{stamp.suffix}")
    log(f"wrote {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
