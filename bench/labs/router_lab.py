"""`python -m bench.labs.router_lab`: one Kimi-K2.5 MoE layer's routing, XLA's path vs the kernels, on this device.

Routing = router logits ([T, 7168] x [384, 7168] float32) + noaux_tc top-8. `topk="xla"` is XLA's split-K
GEMM and its top-k; `topk="kernel"` is model/kernels/router_gemv.py (2 <= T <= 8) + router_topk.py, with the
engine's tiles and with VARIANTS of the GEMV's steps per program and the top-k's warps (T <= 8). Each is timed
as LOOP calls chained in one device loop (each call's input depends on the last call's weights), median of
synchronised repeats / LOOP, against the router's byte floor at 4.3 TB/s. Also the GPU check of the kernels:
the chosen ids must equal XLA's and the weights agree. Writes router-lab-<device>-<date>.json to --out.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.bytes_floor import HBM_TBS, floor_ms
from bench.report import write_json
from bench.timing import median_ms
from model.configs import known_config
from model.kernels import router_gemv, router_topk
from model.router import route

LOOP = 50
# (router_gemv.STEPS, router_topk.NUM_WARPS) timed beside the engine's (1, 4); "steps2_warps4": the first version
VARIANTS = {"steps2_warps4": (2, 4), "steps1_warps1": (1, 1), "steps2_warps1": (2, 1)}


def _chained(cfg, topk: str):
    def body(_, x_TH, router_EH, bias_E):
        w_TK, ids_TK = route(x_TH, router_EH, bias_E, cfg, topk=topk)
        # the next call's input depends on this call's output: no hoisting, no overlap
        return (x_TH + 1e-6 * (w_TK.sum() + ids_TK.sum()).astype(x_TH.dtype)).astype(x_TH.dtype)

    return jax.jit(lambda x, r, b: jax.lax.fori_loop(0, LOOP, lambda i, x: body(i, x, r, b), x))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16], help="outside router_gemv's MIN_TOKENS.."
                   "MAX_TOKENS both paths take XLA's logits")
    p.add_argument("--tiny", action="store_true", help="small dims, kernels in interpret mode (CPU check)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    cfg = known_config("kimi-k2.5")
    if args.tiny:
        cfg = cfg.replace(hidden_size=512, n_routed_experts=48)
    e, h = cfg.n_routed_experts, cfg.hidden_size
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    router_EH = jax.random.normal(keys[0], (e, h), jnp.float32) * h**-0.5
    bias_E = 0.01 * jax.random.normal(keys[1], (e,), jnp.float32)
    floor = floor_ms(router_EH.nbytes, HBM_TBS)
    dev = jax.devices()[0]
    now = datetime.datetime.now(datetime.timezone.utc)
    result = dict(device=dev.device_kind, jax=jax.__version__, date=now.isoformat(timespec="seconds"),
                  loop=LOOP, router_floor_ms=floor, rows=[])
    for t in args.tokens:
        x_TH = jax.random.normal(jax.random.fold_in(keys[2], t), (t, h), jnp.float32).astype(jnp.bfloat16)
        w_ref, ids_ref = jax.jit(lambda x: route(x, router_EH, bias_E, cfg, topk="xla"))(x_TH)
        w, ids = jax.jit(lambda x: route(x, router_EH, bias_E, cfg, topk="kernel"))(x_TH)
        row = dict(tokens=t, ids_equal=bool(np.array_equal(np.asarray(ids), np.asarray(ids_ref))),
                   weights_max_abs_diff=float(np.max(np.abs(np.asarray(w) - np.asarray(w_ref)))))
        engine = (router_gemv.STEPS, router_topk.NUM_WARPS)
        for name, topk, (steps, warps) in (("xla", "xla", engine), ("kernel", "kernel", engine),
                                           *((n, "kernel", v) for n, v in VARIANTS.items())):
            router_gemv.STEPS, router_topk.NUM_WARPS = steps, warps  # read when the chain is traced
            try:
                fn = _chained(cfg, topk)
                row[f"{name}_us"] = median_ms(lambda: fn(x_TH, router_EH, bias_E), iters=10)["median_ms"] * 1e3 / LOOP
            finally:
                router_gemv.STEPS, router_topk.NUM_WARPS = engine
        row["kernel_ratio_to_floor"] = row["kernel_us"] / (floor * 1e3)
        result["rows"].append(row)
        others = "  ".join(f"{n} {row[f'{n}_us']:6.1f}" for n in VARIANTS)
        print(f"T={t:2d} xla {row['xla_us']:6.1f} us  kernels {row['kernel_us']:6.1f} us  ({others})  floor "
              f"{floor * 1e3:.1f} us  ids equal {row['ids_equal']}  weights diff {row['weights_max_abs_diff']:.1e}",
              flush=True)
    path = write_json(result, Path(args.out), f"router-lab-{dev.platform}-{now.strftime('%Y%m%d-%H%M')}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
