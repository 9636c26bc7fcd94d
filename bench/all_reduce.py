"""`XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python -m bench.all_reduce`: the all-reduce
an 8-device Kimi-K2.5 step pays per layer, counted in the engine's sharded program and timed on the CPU mesh.

Issue 36 asks for the 61-layer model on 8 devices "on paper", with an all-reduce latency measured on the CPU mesh.
Two figures:
- all-reduces per MoE layer: the engine's decode forward (`model.decoder.forward`, T tokens) with a K2.5-shaped
  config scaled down (hidden 256, 8 heads, 16 experts; every sharded dimension divides by 8) compiled for a 1 x 8
  mesh with the partition rules of model/sharding.py; the optimized HLO's all-reduce ops, counted for 3 and 2
  layers, differ by one MoE layer's;
- the latency of one all-reduce of a [T, 7168] float32 activation over the 8 CPU devices: a device loop of N
  dependent psums, timed at two N, the slope. One process's 8 host "devices" exchange through shared memory, so
  this is a CPU figure, stated as such; NVLink's latency is a property of the machine it runs on.
Writes all-reduce-<date>.json to --out and prints both.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from bench.report import write_json
from bench.timing import median_ms
from model.config import load_text_config
from model.decoder import forward
from model.init import init_kimi_weights
from model.kv_cache import init_latent_cache
from model.sharding import make_mesh, mesh_context, shardings_for

K25_CONFIG = Path(__file__).resolve().parent.parent / "model" / "configs" / "kimi-k2.5.json"
DEVICES = 8


def scaled_config(layers: int):
    """Kimi-K2.5's config with every dimension small and divisible by 8 (the same layer structure and sharding)."""
    return load_text_config(K25_CONFIG).replace(
        vocab_size=1024, hidden_size=256, num_hidden_layers=layers, num_attention_heads=8, q_lora_rank=64,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, intermediate_size=128,
        moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4, aux_layer_ids=None)


def all_reduces_in_forward(layers: int, tokens: int, mesh) -> int:
    """all-reduce ops in the optimized HLO of the sharded forward over `tokens` new tokens (batch 1)."""
    cfg = scaled_config(layers)
    weights = jax.eval_shape(lambda k: init_kimi_weights(cfg, k, jnp.bfloat16, experts="int4"), jax.random.key(0))
    cache = jax.eval_shape(lambda: init_latent_cache(cfg, 1, 64))
    tokens_BT = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    rep = NamedSharding(mesh, P())
    step = functools.partial(forward, cfg=cfg)
    with mesh_context(mesh):
        lowered = jax.jit(lambda w, t, p, c: step(w, tokens_BT=t, positions_BT=p, cache=c).logits,
                          in_shardings=(shardings_for(weights, mesh), rep, rep, rep)).lower(
            weights, tokens_BT, tokens_BT, cache)
    hlo = lowered.compile().as_text()
    return len(re.findall(r"\sall-reduce(-start)?\(", hlo))  # a combined one returns a tuple: match the op alone


def all_reduce_ms(tokens: int, hidden: int, mesh, iters: int) -> dict:
    """ms of one psum of a [tokens, hidden] float32 array over the mesh: the slope between loops of 16 and 64."""
    def loop(n):
        def per_device(x):
            return jax.lax.fori_loop(0, n, lambda _, v: jax.lax.psum(v, ("data", "model")) * (1.0 / DEVICES), x)
        return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P(("data", "model")),
                                     out_specs=P(("data", "model")), check_vma=False))

    x = jax.device_put(jnp.ones((DEVICES * tokens, hidden), jnp.float32), NamedSharding(mesh, P(("data", "model"))))
    short, long = (median_ms(lambda f=loop(n): f(x), warmup=2, iters=iters) for n in (16, 64))
    return {"ms": (long["median_ms"] - short["median_ms"]) / 48, "short": short, "long": long}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    if jax.device_count() < DEVICES:
        raise SystemExit(f"bench.all_reduce: needs {DEVICES} devices, found {jax.device_count()} (run it with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES} JAX_PLATFORMS=cpu)")
    mesh = make_mesh((1, DEVICES))
    rows = []
    for t in args.tokens:
        per_layer = all_reduces_in_forward(3, t, mesh) - all_reduces_in_forward(2, t, mesh)
        latency = all_reduce_ms(t, 7168, mesh, args.iters)
        rows.append({"tokens": t, "all_reduces_per_moe_layer": per_layer, "all_reduce_us": 1e3 * latency["ms"],
                     "timing": latency})
        print(f"T={t}: {per_layer} all-reduces per MoE layer; one [{t}, 7168] f32 all-reduce over {DEVICES} "
              f"{jax.devices()[0].platform} devices {1e3 * latency['ms']:.1f} us", flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    write_json({"date": stamp.isoformat(timespec="seconds"), "platform": jax.devices()[0].platform,
                "devices": DEVICES, "jax": jax.__version__, "rows": rows}, args.out,
               f"all-reduce-{jax.devices()[0].platform}-{stamp.strftime('%Y%m%d-%H%M')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
