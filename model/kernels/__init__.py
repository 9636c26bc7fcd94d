"""GPU kernels, each beside the plain-XLA reference it is tested against; the engine picks per backend.

`routed_experts_for_backend` has the signature of `model.moe.routed_experts`: on a GPU it runs the fused
Pallas MoE when the shapes fit (moe_gemv.py on CUDA cores, one slot per (token, choice), for decode and
verify; moe_gather.py on tensor cores over the unique experts above PAIRS_MAX_TOKENS), elsewhere the plain
reference paths `model.moe.experts_gather` / `experts_dense`.
"""

from __future__ import annotations

import jax

from model.kernels.moe_gather import MoEKernelConfig, check_shapes, routed_experts_pallas, token_tile
from model.quant import Fp8Weight, Int4Weight

# Above this many tokens (prefill buckets) the kernel's per-slot pass stops paying: the plain dense path runs.
MAX_KERNEL_TOKENS = 128


# One slot per (token, choice) on CUDA cores (moe_gemv.py, slots="pairs") up to this many tokens, tensor-core
# dots over the unique experts above. Measured on the H200 with `python -m bench.moe_kernel_lab [--bf16]`
# (bench/results/moe-lab-gpu-20261129-1250.json and moe-lab-bf16-gpu-20261129-1251.json, one K2.5 layer):
# INT4 pairs T=1 92 us (floor 46), T=2 167 (92), T=4 270 (179), T=8 502 (340), T=16 938 (640); the
# unique-expert mma kernel 757 / 1347 / 2345 us at T=4 / 8 / 16, the unique-expert gemv 247 us at T=2.
# bf16 pairs T=1 204 us (floor 164), T=4 709 (635); mma T=8 1294 vs pairs 1360.
PAIRS_MAX_TOKENS = {"int4": 64, "bf16": 4}


def kernel_config_for(tokens: int, experts) -> MoEKernelConfig:
    """Tile sizes for the H200 (bench/moe_kernel_lab.py times the candidates; results in bench/results/)."""
    int4 = isinstance(experts.gate, Int4Weight)
    if tokens <= PAIRS_MAX_TOKENS["int4" if int4 else "bf16"]:
        # INT4 64-row tiles with 8 warps: 92 / 96 / 96 us at one token over three runs vs 97 / 92 / 94 for these
        # (noise), 290-305 vs 270-277 us at four tokens (bench/results/moe-lab-gpu-20261129-1250 and -1312)
        return MoEKernelConfig(block_f=32, block_h=32, block_k=64 if int4 else 256, num_warps=4, variant="gemv",
                               down_splits=8, slots="pairs")
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
    "PAIRS_MAX_TOKENS",
    "MAX_KERNEL_TOKENS",
    "MoEKernelConfig",
    "fused_moe_applies",
    "fused_routed_experts",
    "kernel_config_for",
    "routed_experts_for_backend",
    "routed_experts_pallas",
    "token_tile",
]
