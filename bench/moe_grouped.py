"""Routed experts under each routing regime: moe_wgmma (one program row per slot) against moe_grouped (each expert
that min_members slots or more chose converted once for all its tokens), on one K2.5 layer of 384 random INT4
experts, each held to the plain reference and to the floor of reading each unique expert once (at HBM_TBS). Run:
`python -m bench.moe_grouped --out DIR` (the H200 call: bench/scripts/h200_grouped.sh)."""

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
from bench.bytes_floor import HBM_TBS, floor_ms, nbytes
from bench.labs.ep_slots import local_experts
from bench.moe_layer import _rel_err, time_moe
from bench.report import write_json
from bench.routes import ROUTINGS, regime_ids
from model.kernels.dispatch import wgmma_config_for
from model.kernels.moe_grouped import routed_experts_grouped
from model.kernels.moe_wgmma import routed_experts_wgmma
from model.moe import experts_gather


def paths(experts, tokens: int, min_members: list[int]) -> dict:
    """name -> routed-experts function at the engine's splits for this many tokens; on CPU the kernels run in
    Pallas' interpreter (a smoke check, not a timing)."""
    splits = wgmma_config_for(experts, 8, tokens)
    interpret = jax.default_backend() != "gpu"
    out = {"slots": functools.partial(routed_experts_wgmma, **splits, interpret=interpret)}
    for m in min_members:
        out[f"grouped_m{m}"] = functools.partial(routed_experts_grouped, **splits, min_members=m, interpret=interpret)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.moe_grouped", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2, 4, 5, 8])
    ap.add_argument("--routing", nargs="+", default=["independent", "neighbour", "shared"], choices=ROUTINGS[1:])
    ap.add_argument("--min-members", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--f", type=int, default=2048)
    ap.add_argument("--h", type=int, default=7168)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    experts = local_experts(args.experts, args.f, args.h, jax.random.PRNGKey(0))
    rows = []
    per_expert = nbytes(experts) // args.experts
    now = datetime.datetime.now(datetime.timezone.utc)
    stamp = now.strftime("%Y%m%d-%H%M")
    doc = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "date": now.isoformat(timespec="seconds"),
           "experts": args.experts, "f": args.f, "h": args.h, "bytes_per_expert": per_expert, "floor_tbs": HBM_TBS,
           "rows": rows, "complete": False}
    for routing in args.routing:
        for t in args.tokens:
            ids = regime_ids(jax.random.PRNGKey(t), 1, t, args.experts, 8, routing)
            w = jnp.asarray(np.random.default_rng(t).uniform(0.05, 0.3, (t, 8)), jnp.float32)
            x = jax.random.normal(jax.random.PRNGKey(100 + t), (t, args.h), jnp.float32).astype(jnp.bfloat16)
            ref = jax.jit(experts_gather)(x, experts, ids, w)
            flat = np.asarray(ids).reshape(-1)
            counts = np.unique(flat, return_counts=True)[1]
            floor_us = 1e3 * floor_ms(int(counts.size) * per_expert + 2 * x.nbytes, HBM_TBS)
            row = {"routing": routing, "tokens": t, "unique_experts": int(counts.size), "floor_us": floor_us,
                   "experts_by_members": {int(m): int((counts == m).sum()) for m in np.unique(counts)}}
            for name, fn in paths(experts, t, args.min_members).items():
                try:
                    out = jax.jit(fn)(x, experts, ids, w)
                    timing = time_moe(fn, x, experts, ids, w, iters=args.iters)
                    row[name] = {"us": 1e3 * timing["ms"], "spread_us": 1e3 * timing["spread_ms"],
                                 "x_floor": 1e3 * timing["ms"] / floor_us, "rel_err": _rel_err(out, ref)}
                except Exception as e:  # a kernel that fails to compile or run is a row, not the end of the bench
                    row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            rows.append(row)
            # written after every row, marked incomplete until the last: a run cut short keeps what it measured
            write_json(doc, args.out, f"moe-grouped-{jax.default_backend()}-{stamp}")
            print(f"{routing} T={t} ({row['unique_experts']} unique, by members {row['experts_by_members']}; floor "
                  f"{floor_us:.1f} us): "
                  + ", ".join(f"{n} {v['us']:.1f} +- {v['spread_us']:.1f} us ({v['x_floor']:.2f}x, rel err "
                              f"{v['rel_err']:.1e})"
                              if "us" in v else f"{n} {v['error']}"
                              for n, v in row.items() if isinstance(v, dict) and ("us" in v or "error" in v)),
                  flush=True)
    doc["complete"] = True
    write_json(doc, args.out, f"moe-grouped-{jax.default_backend()}-{stamp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
