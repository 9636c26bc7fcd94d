"""`python -m bench.labs.attention_lab`: MLA attention over the latent cache alone, XLA's absorbed path vs the Pallas kernels.

K2.5 shapes (64 heads, latent 512, rope 64, v 128), random bf16 queries, cache and w_uv; the cache's capacity is
rounded up as the engine rounds it. For each batch, context and token count: the median time of everything after
the query absorption (scores, softmax, context, w_uv projection), as REPS calls unrolled inside one jit (a device
loop would add its own per-iteration cost), each fed by the last; the bytes it must read (the visible latent +
rope-key slots, w_uv, the queries) and the floor at 4.3 TB/s; the kernels' error against XLA's. Writes
attention-lab-<device>-<date>.json to --out. `--tiny` runs small shapes in interpret mode (a CPU check).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.bytes_floor import HBM_TBS, floor_ms  # noqa: E402
from bench.report import run_stamp, write_json  # noqa: E402
from bench.timing import median_ms  # noqa: E402
from model.kernels.mla_decode import MLAKernelConfig, mla_decode_attention  # noqa: E402
from model.kv_cache import round_capacity, visible_slots  # noqa: E402

REPS = 10
# `--sweep`: kernel tilings tried side by side (name -> config); the default run times MLAKernelConfig() only
SWEEP = {f"q{q}_s{bs}_x{sp}_w{w}": MLAKernelConfig(block_q=q, block_s=bs, splits=sp, num_warps=w)
         for q, bs, sp, w in [(16, 64, 8, 4), (16, 64, 32, 4), (16, 64, 64, 4), (32, 64, 16, 4), (32, 64, 32, 4),
                              (32, 64, 64, 4), (64, 64, 16, 8), (64, 64, 32, 8), (64, 64, 64, 8), (64, 32, 64, 8),
                              (16, 64, 128, 4), (32, 64, 128, 4)]}


def xla_attention(q_lat, q_rope, latent, k_rope, positions, w_uv, scale):
    """model.attention_mla.attend_absorbed after the query absorption, as XLA runs it."""
    s = jnp.einsum("btnc,bsc->bnts", q_lat, latent, preferred_element_type=jnp.float32)
    s += jnp.einsum("btnr,bsr->bnts", q_rope, k_rope, preferred_element_type=jnp.float32)
    s = jnp.where(visible_slots(positions, latent.shape[1])[:, None], s * scale, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(q_lat.dtype)
    return jnp.einsum("btnc,nvc->btnv", jnp.einsum("bnts,bsc->btnc", p, latent), w_uv)


def chained(fn, reps):
    """`reps` calls unrolled in one jit, each query nudged by the last output (so none can be hoisted or merged)."""
    def run(q_lat, *rest):
        q = q_lat
        for _ in range(reps):
            q = (q + 1e-3 * fn(q, *rest)[..., :1]).astype(q.dtype)
        return q
    return jax.jit(run)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--sweep", action="store_true", help="time every tiling in SWEEP, not only the default")
    p.add_argument("--configs", nargs="+", choices=sorted(SWEEP), help="time these tilings of SWEEP (implies --sweep)")
    args = p.parse_args(argv)
    n, c, r, v = (4, 32, 16, 8) if args.tiny else (64, 512, 64, 128)
    tiny = dict(block_q=16, block_s=16, block_c=16, splits=4)
    kcfg = MLAKernelConfig(**tiny) if args.tiny else MLAKernelConfig()
    configs = {"kernel": kcfg}
    if args.sweep or args.configs:
        chosen = args.configs or sorted(SWEEP)
        configs.update({name: dataclasses.replace(SWEEP[name], **(tiny if args.tiny else {})) for name in chosen})
    stamp = run_stamp()
    result = dict(**stamp.fields,
                  kernel_config=kcfg.__dict__, configs={k: v.__dict__ for k, v in configs.items()}, rows=[])
    scale = 0.1
    for b in args.batches:
        for ctx in args.contexts:
            for t in args.tokens:
                keys = jax.random.split(jax.random.PRNGKey(ctx + t + b), 5)
                cap = round_capacity(ctx + 16)  # the cache's capacity exceeds the context, as in the engine
                q_lat = jax.random.normal(keys[0], (b, t, n, c), jnp.bfloat16)
                q_rope = jax.random.normal(keys[1], (b, t, n, r), jnp.bfloat16)
                latent = jax.random.normal(keys[2], (b, cap, c), jnp.bfloat16)
                k_rope = jax.random.normal(keys[3], (b, cap, r), jnp.bfloat16)
                positions = jnp.broadcast_to(ctx - t + jnp.arange(t, dtype=jnp.int32), (b, t))
                w_uv = (jax.random.normal(keys[4], (n, v, c), jnp.float32) / c ** 0.5).astype(jnp.bfloat16)
                args_ = (q_rope, latent, k_rope, positions, w_uv)
                nbytes = b * ctx * (c + r) * 2 + q_lat.nbytes + q_rope.nbytes + w_uv.nbytes + b * t * n * v * 2
                row = dict(batch=b, context=ctx, tokens=t, bytes=nbytes, floor_ms_4p3=floor_ms(nbytes, HBM_TBS))
                fns = {"xla": functools.partial(xla_attention, scale=scale)}
                fns.update({name: functools.partial(mla_decode_attention, cfg=c_, interpret=args.tiny, scale=scale)
                            for name, c_ in configs.items()})
                for name, fn in fns.items():
                    try:
                        run = chained(fn, REPS)  # compiled once; the timed calls reuse it
                        stats = median_ms(lambda run=run: run(q_lat, *args_), warmup=2, iters=10)
                        row[f"{name}_ms"] = stats["median_ms"] / REPS
                        row[f"{name}_ratio"] = row[f"{name}_ms"] / row["floor_ms_4p3"]
                    except Exception as e:  # the kernel has not run on this device before: record, go on
                        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:600]
                ref = np.asarray(xla_attention(q_lat, *args_, scale), np.float64)
                for name in configs:
                    if f"{name}_ms" in row:
                        out = np.asarray(fns[name](q_lat, *args_), np.float64)
                        row[f"{name}_rel_err"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                print(row, flush=True)
                result["rows"].append(row)
    path = write_json(result, Path(args.out), f"attention-lab-{stamp.suffix}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
