"""`python -m bench.labs.ep_slots`: one device's routed experts under 8-way expert parallelism, with the slots
of other devices' experts skipped (the engine) or computed at weight 0 (before).

Under `model.moe_parallel` each device sees all T x K routing choices; a choice of an expert another device holds
keeps router weight 0 and points at a local expert. moe_wgmma skips such slots (its programs read the slot's
weight); before, it converted and multiplied that local expert's tiles once more per such slot. This lab builds
one device's share of a K2.5 layer (384 / `--devices` experts of INT4 K2.5 shapes, random weights), routes T
tokens over all 384 experts at random, keeps device 0's choices (`local_choices`), and times the engine's routed
experts (`model.moe.routed_experts`) as they are and with the other devices' slots given a weight of 1e-30
instead of 0 (the same work as before the skip, the same result to float precision). Each is held to the plain
reference on the same inputs. A third arm, `global_ids`, gives the kernels the router's global ids and the
device's first expert (`routed_experts(first_expert=)`, as `model.moe_parallel` calls it): moe_wgmma keeps to
the device's experts itself, other paths restrict the choices first. The device is the one whose experts start at
each of --first-experts. Timing: bench.moe_layer's chained device loop (per call, two chain lengths).
Writes ep-slots-<platform>-<date>.json to --out.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import bench  # noqa: F401  (the engine's XLA flags)
from bench.moe_layer import _rel_err, time_moe
from bench.report import write_json
from model.moe import ExpertWeights, experts_gather, routed_experts
from model.moe_parallel import local_choices
from model.quant import Int4Weight

EXPERTS, CHOICES, F, H = 384, 8, 2048, 7168


def local_experts(num: int, f: int, h: int, key) -> ExpertWeights:
    def int4(k, out, inp):
        packed = jax.random.bits(k, (num, out, inp // 8), jnp.uint32)
        return Int4Weight(packed, jnp.full((num, out, inp // 32), (inp ** -0.5) / 4.6, jnp.bfloat16))

    kg, ku, kd = jax.random.split(key, 3)
    return ExpertWeights(int4(kg, f, h), int4(ku, f, h), int4(kd, h, f))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--f", type=int, default=F, help="expert rows (small values for a CPU smoke run)")
    ap.add_argument("--h", type=int, default=H)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--first-experts", type=int, nargs="+", default=[0, 240],
                    help="the modelled device's first expert (a multiple of 384 / --devices)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    num = EXPERTS // args.devices
    experts = local_experts(num, args.f, args.h, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    rows = []
    for t in args.tokens:
        ids = jnp.asarray(np.stack([rng.permutation(EXPERTS)[:CHOICES] for _ in range(t)]), jnp.int32)
        weights = jnp.asarray(rng.uniform(0.05, 0.3, (t, CHOICES)), jnp.float32)
        x = jax.random.normal(jax.random.PRNGKey(t), (t, args.h), jnp.float32).astype(jnp.bfloat16)
        for first in args.first_experts:
            local_ids, local_w = local_choices(ids, weights, first, num)
            ref = jax.jit(experts_gather)(x, experts, local_ids, local_w)
            row = {"tokens": t, "first_expert": first, "local_slots": int((np.asarray(local_w) != 0).sum()),
                   "slots": t * CHOICES,
                   "local_unique_experts": int(np.unique(np.asarray(local_ids)[np.asarray(local_w) != 0]).size)}
            arms = {"skip": (local_ids, local_w, None),
                    "weight_1e-30": (local_ids, jnp.where(local_w == 0, 1e-30, local_w), None),
                    "global_ids": (ids, weights, jnp.int32(first))}
            for name, (arm_ids, arm_w, first_expert) in arms.items():
                fn = functools.partial(routed_experts, first_expert=first_expert)
                out = jax.jit(fn)(x, experts, arm_ids, arm_w)
                timing = time_moe(fn, x, experts, arm_ids, arm_w, iters=args.iters)
                row[name] = {"ms": timing["ms"], "chained_ms": timing["chained_ms"],
                             "spread_ms": timing["spread_ms"], "rel_err": _rel_err(out, ref)}
            print(f"T={t}, experts from {first}: {row['local_slots']} of {row['slots']} slots local "
                  f"({row['local_unique_experts']} experts); "
                  + "; ".join(f"{n} {row[n]['ms'] * 1e3:.1f} us (rel err {row[n]['rel_err']:.1e})" for n in arms),
                  flush=True)
            rows.append(row)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    write_json({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "devices_modelled": args.devices,
                "local_experts": num, "f": args.f, "h": args.h, "rows": rows},
               args.out, f"ep-slots-{jax.default_backend()}-{stamp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
