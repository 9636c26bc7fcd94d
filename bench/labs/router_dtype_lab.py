"""Lab: the router (logits and top-k, `model.router.route` as the engine dispatches it) with its [E, H] weight in
bf16, as Kimi's checkpoints store it, against the float32 copy the converter used to widen it to, at T = 1, 4, 8 in
a device loop.

Why: the logits are float32 from either (a bf16 value widens exactly), so the choices must be identical; the bf16
weight is half the bytes (5.5 MB a layer at K2.5's 384 x 7168). This times what that is worth beside the byte floor.
Run: `python -m bench.labs.router_dtype_lab --out DIR` (`--tiny` on a CPU: a smoke run, not a timing).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import bench  # noqa: F401  (the engine's XLA flags)
from bench.bytes_floor import HBM_TBS, floor_ms
from bench.report import write_json
from bench.timing import device_loop_ms
from model.configs import known_config
from model.router import route

TINY = dict(hidden_size=256, n_routed_experts=16, num_experts_per_tok=4)


def make_loop(router_EH, bias_E, cfg):
    """n routings in one jitted loop; each step's x takes a zero-weighted term of the last step's weights, so XLA
    can neither hoist the routing out of the loop nor drop it."""
    @jax.jit
    def loop(x_TH, n):
        def body(_, x):
            weights_TK, _ = route(x, router_EH, bias_E, cfg)
            return x + (weights_TK[:, :1] * 0).astype(x.dtype)
        return jax.lax.fori_loop(0, n, body, x_TH)
    return loop


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.labs.router_dtype_lab", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="small dims (a CPU smoke run)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    if args.steps < 1 or args.iters < 1 or min(args.tokens) < 1:
        raise SystemExit("--steps, --iters and --tokens must be >= 1")
    cfg = known_config("kimi-k2.5")
    if args.tiny:
        cfg = cfg.replace(**TINY)
    e, h = cfg.n_routed_experts, cfg.hidden_size
    k_w, k_b, k_x = jax.random.split(jax.random.PRNGKey(0), 3)
    router_bf16 = (jax.random.normal(k_w, (e, h)) * h ** -0.5).astype(jnp.bfloat16)
    routers = {"bfloat16": router_bf16, "float32": router_bf16.astype(jnp.float32)}  # the same values, widened
    bias_E = 0.01 * jax.random.normal(k_b, (e,))
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "date": now.isoformat(timespec="seconds"),
              "experts": e, "hidden": h, "steps": args.steps, "floor_tbs": HBM_TBS, "rows": []}
    for t in args.tokens:
        x_TH = jax.random.normal(jax.random.fold_in(k_x, t), (t, h)).astype(jnp.bfloat16)
        outs = {name: jax.jit(lambda x, w: route(x, w, bias_E, cfg))(x_TH, w) for name, w in routers.items()}
        same_ids = bool(jnp.array_equal(outs["bfloat16"][1], outs["float32"][1]))
        weight_err = float(jnp.max(jnp.abs(outs["bfloat16"][0] - outs["float32"][0])))
        for name, w in routers.items():
            loop = make_loop(w, bias_E, cfg)
            timing = device_loop_ms(lambda n, loop=loop: loop(x_TH, jnp.int32(n)), args.steps, args.iters)
            floor_us = 1e3 * floor_ms(w.nbytes + bias_E.nbytes, HBM_TBS)
            row = {"tokens": t, "router_dtype": name, "floor_us": floor_us, "same_ids": same_ids,
                   "max_weight_diff": weight_err, **timing}
            result["rows"].append(row)
            print(f"T={t} router {name:8s} {1e3 * row['device_loop_ms']:7.2f} us a routing  floor {floor_us:5.2f} us  "
                  f"ids identical {same_ids}  max weight diff {weight_err:.1e}", flush=True)
    path = write_json(result, args.out, f"router-dtype-{jax.default_backend()}-{now.strftime('%Y%m%d-%H%M')}")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
