"""GPU kernels, each beside the plain-XLA reference it is tested against; the engine picks per backend.

`routed_experts_for_backend` has the signature of `model.moe.routed_experts`: on a GPU it runs the fused
Pallas MoE when the shapes fit (moe_gemv.py on CUDA cores for 1-2 tokens, moe_gather.py on tensor cores
above), elsewhere the plain reference paths `model.moe.experts_gather` / `experts_dense`.
"""

from __future__ import annotations

import jax

from model.kernels.moe_gather import MoEKernelConfig, check_shapes, routed_experts_pallas, token_tile
from model.quant import Fp8Weight, Int4Weight

# Above this many tokens (prefill buckets) the kernel's per-slot pass stops paying: the plain dense path runs.
MAX_KERNEL_TOKENS = 128


# CUDA-core GEMV up to this many tokens, tensor-core dots above; measured on the H200 with
# `python -m bench.moe_kernel_lab` (bench/results/moe-lab-gpu-20261129-1033.json, one K2.5 INT4 layer):
# INT4 T=1 gemv 95.8 us vs mma 266 us (floor 46.1), T=2 gemv 233 us vs mma 391 us, T=4 gemv 775 us vs mma
# 736 us (floor 179), T=8 mma 1336 us (floor 340). bf16: gemv for one token only (it spills registers at
# 4 tokens, bench/results/README.md).
GEMV_MAX_TOKENS = {"int4": 2, "bf16": 1}


def kernel_config_for(tokens: int, experts) -> MoEKernelConfig:
    """Tile sizes for the H200 (bench/moe_kernel_lab.py times the candidates; results in bench/results/)."""
    int4 = isinstance(experts.gate, Int4Weight)
    if tokens <= GEMV_MAX_TOKENS["int4" if int4 else "bf16"]:
        if int4:
            return MoEKernelConfig(block_f=32, block_h=32, block_k=64, num_warps=4, variant="gemv", down_splits=8)
        return MoEKernelConfig(block_f=32, block_h=32, block_k=256, num_warps=4, variant="gemv", down_splits=8)
    # wgmma tiles of 64 rows; two stages keep the shared memory (dequantized tiles + inputs) under 227 KB
    return MoEKernelConfig(block_f=64, block_h=64, block_k=64, num_warps=4, num_stages=2, variant="mma", down_splits=8)


def fused_moe_applies(x_TH: jax.Array, experts) -> bool:
    if jax.default_backend() != "gpu" or isinstance(experts.gate, Fp8Weight):
        return False
    if x_TH.shape[0] > MAX_KERNEL_TOKENS:
        return False
    try:
        check_shapes(experts, kernel_config_for(x_TH.shape[0], experts))
    except ValueError:
        return False
    return True


def fused_routed_experts(x_TH: jax.Array, experts, ids_TK: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """The Pallas kernel with the H200-tuned tiles for this token count (call when `fused_moe_applies`)."""
    return routed_experts_pallas(x_TH, experts, ids_TK, weights_TK, cfg=kernel_config_for(x_TH.shape[0], experts))


def routed_experts_for_backend(x_TH: jax.Array, experts, ids_TK: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """Fused Pallas MoE on GPU, plain XLA reference elsewhere; [T, H] -> [T, H]."""
    if fused_moe_applies(x_TH, experts):
        return fused_routed_experts(x_TH, experts, ids_TK, weights_TK)
    from model.moe import experts_dense, experts_gather  # lazy: model.moe calls into this module

    plain = experts_dense if ids_TK.size >= experts.num_experts else experts_gather
    return plain(x_TH, experts, ids_TK, weights_TK)


__all__ = [
    "GEMV_MAX_TOKENS",
    "MAX_KERNEL_TOKENS",
    "MoEKernelConfig",
    "fused_moe_applies",
    "fused_routed_experts",
    "kernel_config_for",
    "routed_experts_for_backend",
    "routed_experts_pallas",
    "token_tile",
]
