"""One MoE layer's routed experts alone: the fused Pallas kernel vs the plain XLA reference vs the byte floor.

Also the GPU correctness check of the kernel (relative error against `experts_gather` on the same inputs)
and a small sweep of tile configurations; the fastest valid one is used by the step benchmark.
"""

from __future__ import annotations

import functools
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.bytes_floor import HBM_TBS, floor_ms, nbytes
from bench.timing import median_ms
from model.kernels.dispatch import fused_routed_experts, moe_kernel_for, triton_config_for
from model.kernels.moe_gather import routed_experts_pallas
from model.kernels.moe_tiles import MoEKernelConfig, check_shapes
from model.moe import ExpertWeights, MoEWeights, experts_gather, moe
from model.quant import dequantize
from model.router import route

CANDIDATES = (  # the engine's configs first (model.kernels.dispatch.triton_config_for), then earlier choices
    MoEKernelConfig(block_f=32, block_h=32, block_k=64, num_warps=4, variant="gemv", down_splits=8, slots="pairs"),
    MoEKernelConfig(block_f=64, block_h=64, block_k=64, num_warps=8, variant="gemv", down_splits=8, slots="pairs"),
    MoEKernelConfig(block_f=32, block_h=32, block_k=64, num_warps=4, variant="gemv", down_splits=8),
    MoEKernelConfig(block_f=64, block_h=64, block_k=64, num_warps=4, num_stages=2, variant="mma", down_splits=8),
)
REPS = 20  # layer calls chained inside one jit, so per-call host dispatch does not count
# A jitted chain also pays a fixed cost per run, before and after its loop's first iteration, that a layer inside a
# model never pays. So a call is timed as the difference of a chain of LONG_REPS calls and one of
# REPS, divided by the extra calls.
LONG_REPS = 3 * REPS


def _chained(fn, reps: int, unrolled: bool = False, chain_ids: bool = False, calls_per_iteration: int = 1):
    """Run fn `reps` times on device, each call fed by the previous output (no hoisting, no host gaps).

    `chain_ids` makes the router ids depend on the previous output too: the plain reference gathers weights by
    ids alone, which XLA would otherwise hoist out of the chain. The kernels read x before any weight, so they
    need no such chain, and it would cost them one extra launch per call (a select on the ids) that a model
    layer does not have (bench/results/README.md, run 12).

    By default the calls run in a device loop, `calls_per_iteration` of them written out in each iteration (so
    the loop's own per-iteration cost, ~1.4 us, is shared); `unrolled=True` writes all of them out one after
    another in one program instead (run 9: 95.3 against the loop's 90.3 us at one token). Either way a run of the
    chain pays a fixed start-up (run 13's trace: ~0.3 ms, most of it around the loop's first iteration), which
    `per_call_ms` cancels by timing two chain lengths."""

    def body(x, ids, experts, weights_TK):
        x = (x + 1e-3 * fn(x, experts, ids, weights_TK)).astype(x.dtype)
        if chain_ids:  # ids depend on x (never actually change), so XLA cannot hoist the reference's gathers
            ids = jnp.where(x[0, 0] == 12345.0, (ids + 1) % experts.num_experts, ids)
        return x, ids

    if reps % calls_per_iteration:
        raise ValueError(f"calls_per_iteration={calls_per_iteration} must divide reps={reps}")

    def iteration(_, carry, experts, weights_TK):
        for _ in range(calls_per_iteration):
            carry = body(*carry, experts, weights_TK)
        return carry

    def run(x_TH, experts, ids_TK, weights_TK):
        if not unrolled:
            return jax.lax.fori_loop(0, reps // calls_per_iteration,
                                     functools.partial(iteration, experts=experts, weights_TK=weights_TK),
                                     (x_TH, ids_TK))[0]
        x, ids = x_TH, ids_TK
        for _ in range(reps):
            x, ids = body(x, ids, experts, weights_TK)
        return x

    return jax.jit(run)


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def chain_pair(fn, unrolled: bool = False, chain_ids: bool = False, calls_per_iteration: int = 1) -> tuple:
    """The chains of REPS and LONG_REPS calls of `fn` whose difference times one call (`per_call_ms`)."""
    return tuple(_chained(fn, n, unrolled, chain_ids, calls_per_iteration) for n in (REPS, LONG_REPS))


def per_call_ms(chains: tuple, args: tuple, iters: int = 10, reps: int = REPS) -> dict:
    """ms of one call: (median of the long chain - median of the short one) / (LONG_REPS - REPS), each a median of
    `iters` synchronised runs after warm-up (`reps`: chains of reps and 3 x reps calls instead). `chained_ms` is the
    short chain's median / REPS (the per-call figure of runs 1-12, which includes the chain's fixed cost),
    `spread_ms` the short chain's max - min / REPS."""
    short, long = (median_ms(lambda c=c: c(*args), warmup=2, iters=iters) for c in chains)
    return {"ms": (long["median_ms"] - short["median_ms"]) / (2 * reps),
            "chained_ms": short["median_ms"] / reps, "spread_ms": (short["max_ms"] - short["min_ms"]) / reps}


def time_moe(fn, x_TH, experts, ids_TK, weights_TK, unrolled: bool = False, chain_ids: bool = False,
             iters: int = 10) -> dict:
    """Per-call ms of `fn` (`per_call_ms`); `chain_ids=True` for the plain reference (see `_chained`)."""
    return per_call_ms(chain_pair(fn, unrolled, chain_ids), (x_TH, experts, ids_TK, weights_TK), iters)


def moe_block_bytes(layer: MoEWeights, unique: int, x_TH) -> int:
    """What the whole MoE block must read: router, shared expert, the unique routed experts, x in and out."""
    per_expert = nbytes(layer.experts) // layer.experts.num_experts
    return nbytes((layer.router, layer.router_bias, layer.shared)) + unique * per_expert + 2 * x_TH.nbytes


def _moe_block(x_TH, layer: MoEWeights, ids_TK, weights_TK, *, cfg):
    """The whole block as a decoder layer calls it (`model.moe.moe`: routing, routed experts, shared expert); it
    routes x itself, so the chain's ids and weights go unused."""
    del ids_TK, weights_TK
    y_BTH, _ = moe(x_TH[None], layer, cfg)
    return y_BTH[0]


def time_moe_block(layer: MoEWeights, cfg, x_TH, ids_TK, weights_TK, iters: int = 10) -> dict:
    """Per-call ms of the whole MoE block (`per_call_ms`, the same chains as the routed experts')."""
    return per_call_ms(chain_pair(functools.partial(_moe_block, cfg=cfg)), (x_TH, layer, ids_TK, weights_TK), iters)


def bench_moe_layer(layer: MoEWeights, cfg, tokens_list=(1, 4), key=jax.random.PRNGKey(7), copy_tbs=None,
                    candidates=CANDIDATES, log=print, iters: int = 10) -> dict:
    experts = layer.experts
    per_expert = nbytes(experts) // experts.num_experts
    rows, sweep, step_inputs = [], {}, {}
    engine_configs = dict.fromkeys(triton_config_for(t, experts) for t in tokens_list)  # ordered: stable cfg numbers
    candidates = tuple(candidates) + tuple(c for c in engine_configs if c not in candidates)
    for t in tokens_list:
        key, kx = jax.random.split(key)
        x_TH = jax.random.normal(kx, (t, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
        weights_TK, ids_TK = route(x_TH, layer.router, layer.router_bias, cfg)
        unique = int(np.unique(np.asarray(ids_TK)).size)
        floor_bytes = unique * per_expert + 2 * x_TH.nbytes
        ref_out = jax.jit(experts_gather)(x_TH, experts, ids_TK, weights_TK)
        step_inputs[t] = (x_TH, ids_TK, weights_TK, ref_out)
        ref = time_moe(experts_gather, x_TH, experts, ids_TK, weights_TK, chain_ids=True, iters=iters)
        row = dict(tokens=t, unique_experts=unique, bytes=floor_bytes, floor_ms_4p3=floor_ms(floor_bytes, HBM_TBS),
                   reference_ms=ref["ms"])
        if copy_tbs:
            row["floor_ms_copy"] = floor_ms(floor_bytes, copy_tbs)
        for i, c in enumerate(candidates):
            try:
                check_shapes(experts, c)
                fn = functools.partial(routed_experts_pallas, cfg=c)
                err = _rel_err(jax.jit(fn)(x_TH, experts, ids_TK, weights_TK), ref_out)
                timing = time_moe(fn, x_TH, experts, ids_TK, weights_TK, iters=iters)
                sweep.setdefault(i, {"config": c.__dict__})[f"T{t}"] = dict(ms=timing["ms"], rel_err=err)
                log(f"  moe T={t} cfg{i} {c}: {timing['ms']:.4f} ms  rel_err {err:.2e}")
            except Exception as e:  # a config Triton rejects must not end the run
                sweep.setdefault(i, {"config": c.__dict__})[f"T{t}"] = dict(error=f"{type(e).__name__}: {e}"[:500])
                log(f"  moe T={t} cfg{i} failed: {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc(limit=2)
        rows.append(row)
    # the row's kernel figures are those of the engine's own dispatch (model.kernels.dispatch): the
    # Mosaic GPU kernel where it applies (its Triton counterpart stays in the sweep), else a Triton config
    engine_ok = True
    for row in rows:
        t = row["tokens"]
        x_TH, ids_TK, weights_TK, ref_out = step_inputs[t]  # the same inputs (and reference) as the sweep's row
        variant = moe_kernel_for(t, experts, cfg.kernels)
        triton = triton_config_for(t, experts)
        engine_kernel = functools.partial(fused_routed_experts, kernel=variant)
        row.update(kernel_variant=variant, kernel_slots=triton.slots if variant == "gemv" else None,
                   triton_config=candidates.index(triton))
        try:
            err = _rel_err(jax.jit(engine_kernel)(x_TH, experts, ids_TK, weights_TK), ref_out)
            ms = time_moe(engine_kernel, x_TH, experts, ids_TK, weights_TK, iters=iters)["ms"]
        except Exception as e:
            row["kernel_error"] = f"{type(e).__name__}: {e}"[:800]
            log(f"  moe T={t} engine kernel ({variant}) failed: {row['kernel_error'][:300]}")
            engine_ok = False
            continue
        log(f"  moe T={t} engine kernel ({variant}): {ms:.4f} ms  rel_err {err:.2e}")
        if err >= 2e-2:
            engine_ok = False
        row.update(kernel_ms=ms, kernel_rel_err=err, kernel_ratio_4p3=ms / row["floor_ms_4p3"],
                   reference_ratio_4p3=row["reference_ms"] / row["floor_ms_4p3"])
        if layer.shared is not None:  # the block around them: router, routed experts and shared expert in one call
            block_bytes = moe_block_bytes(layer, row["unique_experts"], x_TH)
            block_floor = floor_ms(block_bytes, HBM_TBS)
            block_ms = time_moe_block(layer, cfg, x_TH, ids_TK, weights_TK, iters=iters)["ms"]
            row.update(block_bytes=block_bytes, block_floor_ms_4p3=block_floor, block_ms=block_ms,
                       block_ratio_4p3=block_ms / block_floor)
            log(f"  moe T={t} whole block (router, routed, shared expert): {block_ms * 1e3:.1f} us, floor "
                f"{row['block_floor_ms_4p3'] * 1e3:.1f} us (x{row['block_ratio_4p3']:.2f})")
    return {"rows": rows, "sweep": sweep}, engine_ok


def bf16_subset(experts: ExpertWeights, num: int) -> ExpertWeights:
    """The first `num` experts dequantized to bf16 (the full bf16 set of one layer is 34 GB)."""
    return ExpertWeights(*(dequantize(m[:num], jnp.bfloat16) for m in (experts.gate, experts.up, experts.down)))


def bench_bf16_kernel(layer: MoEWeights, cfg, num_experts: int = 64,
                      tokens_list=(1, 4), key=jax.random.PRNGKey(11), log=print, iters: int = 10) -> list[dict]:
    """The bf16 variant on a subset of experts (routing restricted to that subset)."""
    experts = bf16_subset(layer.experts, num_experts)
    small_cfg = cfg.replace(n_routed_experts=num_experts)
    per_expert = nbytes(experts) // num_experts
    rows = []
    for t in tokens_list:
        key, kx = jax.random.split(key)
        x_TH = jax.random.normal(kx, (t, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
        weights_TK, ids_TK = route(x_TH, layer.router[:num_experts], layer.router_bias[:num_experts], small_cfg)
        unique = int(np.unique(np.asarray(ids_TK)).size)
        floor_bytes = unique * per_expert
        kernel_cfg = triton_config_for(t, experts)  # what the engine's dispatch runs
        fn = functools.partial(routed_experts_pallas, cfg=kernel_cfg)
        row = dict(kernel_config=kernel_cfg.__dict__, tokens=t, experts_in_layer=num_experts, unique_experts=unique, bytes=floor_bytes,
                   floor_ms_4p3=floor_ms(floor_bytes, HBM_TBS))
        try:
            ref_out = jax.jit(experts_gather)(x_TH, experts, ids_TK, weights_TK)
            row["reference_ms"] = time_moe(experts_gather, x_TH, experts, ids_TK, weights_TK, chain_ids=True,
                                           iters=iters)["ms"]
            row["kernel_rel_err"] = _rel_err(jax.jit(fn)(x_TH, experts, ids_TK, weights_TK), ref_out)
            row["kernel_ms"] = time_moe(fn, x_TH, experts, ids_TK, weights_TK, iters=iters)["ms"]
            row["kernel_ratio_4p3"] = row["kernel_ms"] / row["floor_ms_4p3"]
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        log(f"  bf16 moe T={t}: {row}")
        rows.append(row)
    return rows
