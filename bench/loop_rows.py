"""`python -m bench.loop_rows`: the device-loop rows of record alone (decode, verify of T tokens, the cycle of K
drafts at batch 1 over a 1k context, Kimi-K2.5-shaped with INT4 experts and random weights), each one program and
its compile. `bench.step` times a step three ways and every cycle K; this times only what the rows of record quote,
so a before/after of a change at 61 layers fits one device call. It uses only what bench.step and bench.cycle have
long had, so it also runs against an older checkout of the code: `cd OLD && python -m bench.loop_rows ...` with this
file copied there.

    python -m bench.loop_rows --layers 61 --rows decode --moe-layers repeated --out $OUT/after.json

`--moe-kernel`, `--mla-kernel` and `--router-kernel` set the config's kernel choices (`model.config.Kernels`), so
two choices of one tree compare in one call: `--router-kernel off` against the default "auto".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.bytes_floor import HBM_TBS, floor_ms, step_bytes
from bench.cycle import initial_state, make_cycle_loop, spec_pair
from bench.step import bench_config, draw_weights, make_step_loop, random_cache, step_inputs
from bench.timing import device_loop_ms
from model.config import KERNEL_CHOICES, Kernels
from model.decoder import fuse_attention_inputs
from model.kv_cache import round_capacity

CONTEXT = 1024
LOOP_STEPS = 10


def timed_loop(loop_fn, args_before, carry, args_after, iters: int) -> tuple[float, dict]:
    """(compile and first call seconds, `device_loop_ms` of the loop threading its donated carry)."""
    holder = {"carry": carry}

    def run(n):
        holder["carry"] = loop_fn(*args_before, holder["carry"], *args_after, jnp.int32(n))
        return holder["carry"]

    t0 = time.perf_counter()
    jax.block_until_ready(run(1))
    compile_s = time.perf_counter() - t0
    return compile_s, device_loop_ms(run, LOOP_STEPS, iters)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.loop_rows", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", nargs="+", default=["decode", "verify4", "cycle3"], help="decode, verifyT, cycleK")
    p.add_argument("--moe-layers", choices=("distinct", "repeated"), default="repeated")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="small dimensions (a CPU smoke run)")
    p.add_argument("--label", default="", help="a name for this tree (before, after)")
    for family, allowed in KERNEL_CHOICES.items():
        p.add_argument(f"--{family}-kernel", choices=allowed, default="auto", help=f"model.config.Kernels.{family}")
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = p.parse_args(argv)
    kernels = Kernels(**{family: getattr(args, f"{family}_kernel") for family in KERNEL_CHOICES})
    cfg = bench_config(args.layers, tiny=args.tiny)
    w = fuse_attention_inputs(draw_weights(cfg, args.tiny, moe_layers=args.moe_layers))
    key = jax.random.PRNGKey(1)
    rows = []
    for name in args.rows:
        if name.startswith("cycle"):
            k = int(name[5:])
            spec_cfg, dcfg, sw = spec_pair(w, cfg, args.tiny)
            state = initial_state(cfg, dcfg, 1, CONTEXT, round_capacity(CONTEXT + 4096), key)
            loop = make_cycle_loop(spec_cfg, k, kernels)
            compile_s, stats = timed_loop(lambda st, n: loop(sw, st, n), (), state, (), args.iters)
            floor = None
        else:
            t = 1 if name == "decode" else int(name[6:])
            tokens_BT, positions_BT = step_inputs(cfg, 1, t, CONTEXT, key)
            cache = random_cache(cfg, 1, round_capacity(CONTEXT + 16), CONTEXT, key)
            loop = make_step_loop(cfg, kernels)

            def run(carry, n, loop=loop, positions_BT=positions_BT):
                return loop(w, carry[0], positions_BT, carry[1], n)

            compile_s, stats = timed_loop(run, (), (tokens_BT, cache), (), args.iters)
            floor = floor_ms(step_bytes(w, cfg, 1, t, CONTEXT, [cfg.num_experts_per_tok * t] * (
                cfg.num_hidden_layers - cfg.first_k_dense_replace))["total"], HBM_TBS) if t == 1 else None
        row = dict(label=args.label, layers=args.layers, row=name, kernels=dataclasses.asdict(kernels),
                   compile_s=compile_s, **stats, floor_ms_4p3=floor)
        rows.append(row)
        print(f"{args.label} {args.layers} layers {name}: device loop {stats['device_loop_ms']:.3f} ms"
              + (f" (floor {floor:.3f} ms, x{stats['device_loop_ms'] / floor:.2f})" if floor else "")
              + f", compile {compile_s:.1f} s", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows),
                                       indent=1))


if __name__ == "__main__":
    main()
