"""`python -m bench.labs.mla_query_rows`: the MLA decode kernels where a device's query rows are fewer than the
kernel's block (one device of the 8-way mesh: 8 heads at one token, 16-row blocks), against the plain attention.

On a GPU the kernel loads such a block with the missing rows masked (model/kernels/mla_decode.py); the CPU tests
hold its arithmetic in Pallas' interpreter, which pads the query instead, so only a device runs the masked loads.
This runs them at Kimi-K2.5's latent and rope widths over a 1k cache, for 8 and 16 heads (the masked block and a
whole one), at T = 1 and 2, and prints each one's max relative error against `attend_reference` (XLA, float32).

    python -m bench.labs.mla_query_rows            # on the GPU
    python -m bench.labs.mla_query_rows --interpret --context 64   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from model.kernels.mla_decode import mla_decode_attention
from model.kv_cache import visible_slots

C, R, V = 512, 64, 128  # Kimi-K2.5's latent, rope-key and value widths


def attend_reference(q_lat, q_rope, latent, k_rope, positions, w_uv, scale):
    """softmax(q_lat . latent + q_rope . k_rope) . latent . w_uv^T over the visible slots, in float32."""
    f32 = jnp.float32
    s = jnp.einsum("btnc,bsc->bnts", q_lat.astype(f32), latent.astype(f32))
    s += jnp.einsum("btnr,bsr->bnts", q_rope.astype(f32), k_rope.astype(f32))
    s = jnp.where(visible_slots(positions, latent.shape[1])[:, None], s * scale, -jnp.inf)
    ctx = jnp.einsum("bnts,bsc->btnc", jax.nn.softmax(s, axis=-1), latent.astype(f32))
    return jnp.einsum("btnc,nvc->btnv", ctx, w_uv.astype(f32))


def check(heads: int, tokens: int, context: int, interpret: bool, seed: int = 0) -> float:
    """Max relative error of the kernels' output against `attend_reference` (bf16 inputs)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    capacity = -(-(context + 64) // 64) * 64  # the kernels take caches in whole blocks of slots
    bf = jnp.bfloat16
    q_lat = jax.random.normal(ks[0], (1, tokens, heads, C)).astype(bf)
    q_rope = jax.random.normal(ks[1], (1, tokens, heads, R)).astype(bf)
    latent = jax.random.normal(ks[2], (1, capacity, C)).astype(bf)
    k_rope = jax.random.normal(ks[3], (1, capacity, R)).astype(bf)
    w_uv = (jax.random.normal(ks[4], (heads, V, C)) * C ** -0.5).astype(bf)
    positions = (context + jnp.arange(tokens, dtype=jnp.int32))[None]
    got = jax.jit(lambda *a: mla_decode_attention(*a, 0.05, interpret=interpret))(
        q_lat, q_rope, latent, k_rope, positions, w_uv)
    want = attend_reference(q_lat, q_rope, latent, k_rope, positions, w_uv, 0.05)
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m bench.labs.mla_query_rows", description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--interpret", action="store_true", help="Pallas' interpreter (a CPU smoke run)")
    args = p.parse_args(argv)
    rows = []
    for heads in (8, 16):
        for tokens in (1, 2):
            err = check(heads, tokens, args.context, args.interpret)
            rows.append(dict(heads=heads, tokens=tokens, max_rel_err=err))
            print(f"{jax.devices()[0].device_kind}: {heads} heads, T = {tokens}: max rel err {err:.2e} "
                  f"({'a block' if heads * tokens >= 16 else 'masked rows'})", flush=True)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
