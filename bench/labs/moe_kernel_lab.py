"""`python -m bench.labs.moe_kernel_lab`: the routed-experts kernel variants of one Kimi-K2.5 INT4 MoE layer, side by side.

For tuning model/kernels/__init__.py: each candidate (variant, tiles, scale loading, prefetch, down splits)
at each token count, the time of one call in a chain (bench.moe_layer.time_moe), its error against the
plain reference path (`model.moe.plain_routed_experts`), and the byte floor of the unique experts it reads. `--profile CFG:T`
instead runs one candidate a few times for Nsight Compute (`ncu --kernel-name regex:moe_ ...`).
Writes moe-lab-<device>-<date>.json to --out.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.bytes_floor import HBM_TBS, floor_ms, nbytes  # noqa: E402
from bench.moe_layer import _rel_err, time_moe  # noqa: E402
from bench.report import run_stamp, write_json  # noqa: E402
from model.configs import known_config  # noqa: E402
from model.init import _Draw, _int4  # noqa: E402
from model.kernels.moe_gather import MoEKernelConfig, routed_experts_pallas  # noqa: E402
from model.moe import ExpertWeights, plain_routed_experts  # noqa: E402
from model.quant import Int4Weight, dequantize  # noqa: E402
from model.router import route  # noqa: E402

_G = dict(variant="gemv", scales="gather")
_P = dict(variant="gemv", scales="gather", slots="pairs")
_M = dict(variant="mma", scales="gather")
# Earlier candidates and their times: bench/results/moe-lab-gpu-20261129-*.json
CANDIDATES = {  # name -> (config, token counts it is tried at)
    "gemv_32_s8": (MoEKernelConfig(block_f=32, block_h=32, block_k=64, num_warps=4, down_splits=8, **_G), (1, 2)),
    # per-group scales + join was faster at T=1 before the one-LOP3 dequantization (146 vs 165 us, lab 1011)
    "gemv_32_join_s8": (MoEKernelConfig(block_f=32, block_h=32, block_k=64, num_warps=4, down_splits=8, variant="gemv",
                                        scales="join"), (1, 2)),
    # one slot per (token, choice): one token of arithmetic per byte at any T, no slot bookkeeping
    "pairs_32_s8": (MoEKernelConfig(block_f=32, block_h=32, block_k=64, num_warps=4, down_splits=8, **_P),
                    (1, 2, 4, 8, 16)),
    # fewer values per thread (registers: ncu-2258 has the engine's tiles at 96-128, 25-31% occupancy)
    "pairs_32_k32_s8": (MoEKernelConfig(block_f=32, block_h=32, block_k=32, num_warps=4, down_splits=8, **_P), (1, 4)),
    "pairs_64_k32_s8": (MoEKernelConfig(block_f=64, block_h=64, block_k=32, num_warps=4, down_splits=8, **_P), (1, 4)),
    "pairs_32_s4": (MoEKernelConfig(block_f=32, block_h=32, block_k=64, num_warps=4, down_splits=4, **_P), (4, 8, 16)),
    "pairs_32_s2": (MoEKernelConfig(block_f=32, block_h=32, block_k=64, num_warps=4, down_splits=2, **_P), (8, 16)),
    "pairs_64_s8": (MoEKernelConfig(block_f=64, block_h=64, block_k=64, num_warps=8, down_splits=8, **_P), (1, 4)),
    "pairs_32_join_s8": (MoEKernelConfig(block_f=32, block_h=32, block_k=64, num_warps=4, down_splits=8,
                                         variant="gemv", scales="join", slots="pairs"), (1, 4)),
    "pairs_16_k32_s8": (MoEKernelConfig(block_f=16, block_h=16, block_k=32, num_warps=2, down_splits=8, **_P), (1, 4)),
    "mma_64_k64_s8": (MoEKernelConfig(block_f=64, block_h=64, block_k=64, num_warps=4, num_stages=2, down_splits=8,
                                      **_M), (4, 8, 16)),
    # prefill buckets of 65-128 tokens: the two-stage tiles above ask for 286 KB of shared memory at 128 tokens
    "mma_64_k64_s8_1stage": (MoEKernelConfig(block_f=64, block_h=64, block_k=64, num_warps=4, num_stages=1,
                                             down_splits=8, **_M), (64, 128)),
}
# bf16 experts (the HF-peer comparison): gemv tiles step over 256 elements, as model.kernels.dispatch.triton_config_for
BF16_BLOCK_K = {"gemv": 256, "mma": 64}


def moe_layer(cfg, key):
    """One MoE layer's routed experts (INT4, bf16 group scales) and router, random, on device."""
    draw = _Draw(key)
    e, f, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    g = cfg.quant.group_size
    experts = ExpertWeights(_int4(draw, (e, f, h), g), _int4(draw, (e, f, h), g), _int4(draw, (e, h, f), g))
    router = draw.normal((e, h)) * h**-0.5
    bias = 0.01 * draw.normal((e,))
    return experts, router, bias


def inputs(cfg, router, bias, t, key):
    x_TH = jax.random.normal(key, (t, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    weights_TK, ids_TK = route(x_TH, router, bias, cfg)
    return x_TH, ids_TK, weights_TK


def run_for_profiler(fn, cfg, router, bias, experts, t: int, label: str, log=print) -> None:
    """`fn` (a layer's routed experts) at T tokens, three times, for Nsight Compute (bench/scripts/h200_profile.sh)."""
    fn = jax.jit(fn)
    x_TH, ids_TK, weights_TK = inputs(cfg, router, bias, t, jax.random.PRNGKey(t))
    for _ in range(3):
        jax.block_until_ready(fn(x_TH, experts, ids_TK, weights_TK))
    log(f"profiled {label} at T={t}: {int(np.unique(np.asarray(ids_TK)).size)} unique experts")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--only", help="comma-separated candidate names (default all)")
    p.add_argument("--profile", help="NAME:T: run that candidate at T tokens 3 times (for ncu) and exit")
    p.add_argument("--budget-s", type=float, default=400.0)
    p.add_argument("--tiny", action="store_true", help="bench.step.TINY_DIMS, kernels in interpret mode (CPU check)")
    p.add_argument("--tokens", type=int, nargs="+", help="token counts to try (default: each candidate's own)")
    p.add_argument("--unrolled", action="store_true",
                   help="chain the 20 timed calls written out in one program instead of a device loop (run 9: 95 vs 90 us)")
    p.add_argument("--with-reference", action="store_true",
                   help="also time the plain XLA path the engine takes where no kernel applies (model.moe)")
    p.add_argument("--bf16", action="store_true", help="bf16 experts (dequantized), as in the HF-peer comparison")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    log = functools.partial(print, flush=True)
    cfg = known_config("kimi-k2.5")
    if args.tiny:
        from bench.step import TINY_DIMS

        cfg = cfg.replace(**{**TINY_DIMS, "moe_intermediate_size": 256})
        tiny = dict(block_f=16, block_h=16, block_k=8, num_warps=4)
        for name, (c, ts) in list(CANDIDATES.items()):
            CANDIDATES[name] = (MoEKernelConfig(**{**c.__dict__, **tiny}), ts)
    kernel = functools.partial(routed_experts_pallas, interpret=args.tiny)
    experts, router, bias = jax.jit(moe_layer, static_argnums=0)(cfg, jax.random.PRNGKey(0))
    if args.bf16:
        experts = jax.jit(lambda e: jax.tree.map(lambda m: dequantize(m, jnp.bfloat16), e,
                                                 is_leaf=lambda m: isinstance(m, Int4Weight)))(experts)
        for name, (c, ts) in list(CANDIDATES.items()):
            if not args.tiny:
                CANDIDATES[name] = (dataclasses.replace(c, block_k=BF16_BLOCK_K[c.variant]), ts)
    jax.block_until_ready(experts)
    per_expert = nbytes(experts) // experts.num_experts
    if args.profile:
        name, t = args.profile.split(":")
        run_for_profiler(functools.partial(kernel, cfg=CANDIDATES[name][0]), cfg, router, bias, experts, int(t), name,
                         log)
        return
    stamp = run_stamp()
    result = dict(**stamp.fields, experts="bf16" if args.bf16 else "int4", rows=[])
    names = args.only.split(",") if args.only else list(CANDIDATES)
    t_start = time.time()
    for t in args.tokens or sorted({t for n in names for t in CANDIDATES[n][1]}):
        x_TH, ids_TK, weights_TK = inputs(cfg, router, bias, t, jax.random.PRNGKey(t))
        unique = int(np.unique(np.asarray(ids_TK)).size)
        floor = floor_ms(unique * per_expert + 2 * x_TH.nbytes, HBM_TBS)
        # the plain path the engine takes without a kernel (experts_gather's per-pair weight copies are 84 GB at
        # 128 tokens, so past one pick per expert it is experts_dense)
        ref = jax.jit(plain_routed_experts)(x_TH, experts, ids_TK, weights_TK)
        if args.with_reference:
            ms = time_moe(plain_routed_experts, x_TH, experts, ids_TK, weights_TK, chain_ids=True)["ms"]
            result["rows"].append(dict(name="xla_plain", tokens=t, unique_experts=unique, floor_ms=floor, ms=ms,
                                       ratio=ms / floor))
            log(f"T={t} {'xla_plain':16s} {ms * 1e3:8.1f} us  floor {floor * 1e3:6.1f} us  x{ms / floor:.2f}")
        for name in names:
            kcfg, tokens = CANDIDATES[name]
            if (t not in tokens and not args.tokens) or time.time() - t_start > args.budget_s:
                continue
            row = dict(name=name, tokens=t, unique_experts=unique, floor_ms=floor, config=kcfg.__dict__)
            try:
                fn = functools.partial(kernel, cfg=kcfg)
                row["rel_err"] = _rel_err(jax.jit(fn)(x_TH, experts, ids_TK, weights_TK), ref)
                row["ms"] = time_moe(fn, x_TH, experts, ids_TK, weights_TK, unrolled=args.unrolled)["ms"]
                row["ratio"] = row["ms"] / floor
                log(f"T={t} {name:16s} {row['ms'] * 1e3:8.1f} us  floor {floor * 1e3:6.1f} us  x{row['ratio']:.2f}"
                    f"  rel_err {row['rel_err']:.1e}")
            except Exception as e:  # a config Triton rejects must not end the run
                row["error"] = f"{type(e).__name__}: {e}"[:800]
                log(f"T={t} {name:16s} failed: {row['error'][:300]}")
            result["rows"].append(row)
    fmt = "-bf16" if args.bf16 else ""
    path = write_json(result, Path(args.out), f"moe-lab{fmt}-{stamp.suffix}")
    log(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
