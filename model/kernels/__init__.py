"""GPU kernels, each beside the plain-XLA reference it is tested against; the engine picks per backend.

`routed_experts_for_backend` has the signature of `model.moe.routed_experts`: on a GPU it runs the fused
Pallas MoE when the shapes fit, elsewhere the plain reference paths `model.moe.experts_gather` /
`experts_dense`. Which kernel (`moe_kernel_for`):
- INT4 experts on Hopper up to WGMMA_MAX_TOKENS tokens (decode, verify): moe_wgmma.py, Mosaic GPU, weight
  tiles streamed into shared memory by TMA, products on tensor cores;
- otherwise up to PAIRS_MAX_TOKENS: moe_gemv.py, Triton, one slot per (token, choice) on CUDA cores;
- above: moe_gather.py, Triton, tensor-core dots over the unique experts.
Not dispatched, measured: moe_wgmma_grouped.py (the experts' tiles read once per group of tokens sharing them),
moe_wgmma_fused.py (decode's gate_up through down in one kernel), moe_wgmma_blocked_down.py (the down kernel over
contiguous F-blocked tiles): slower at one token, bench/results/README.md run 19; moe_wgmma_chained.py (gate_up's and
down's programs in one launch, down's waiting on semaphores): slower at one token, run 20. moe_wgmma's
`choice_groups` (each group of a token's choices its own gate_up -> down chain, overlapped by the CUDA graph) and
`model.moe.shared_expert`'s stream: no faster, run 21; both left off.
"""

from __future__ import annotations

import jax

from model.kernels import moe_wgmma
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
# INT4 prefill buckets of 64 / 128 tokens (moe-lab-gpu-20261130-0312): at 64 pairs 3.70 ms, mma 12.66 (one stage
# 15.58), XLA's dense path 23.81 (floor 1.58); at 128 the mma tiles do not compile (286720 bytes of shared
# memory asked for, 232448 there: x's 8 nibble parts of 128 tokens, two stages), XLA's dense path 24.42 ms
# (floor 2.01). So INT4 takes pairs up to MAX_KERNEL_TOKENS.
PAIRS_MAX_TOKENS = {"int4": 128, "bf16": 4}


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


# INT4 decode / verify on Hopper through moe_wgmma.py. One K2.5 layer on the H200 (`python -m bench.moe_wgmma_lab`,
# bench/results/moe-wgmma-lab-gpu-20261130-0107.json, -0114, -0129), against the Triton gemv in the same run:
# T=2 149 vs 151 us (floor 92), T=4 235 vs 269-270 (179), T=8 430 vs 494 (340), T=16 852 vs 973 (640); at T=1
# within the runs' spread, 81-108 vs 87-105 (46). Batch 8 verifies 16-40 tokens (K = 1..4): -0945 and -0950
# measured T=24 1232 vs 1418 us (floor 864), T=32 1638 / 1600 vs 1923 / 1873 (1078), T=40 2055 vs 2375 (1204);
# -1000 T=64 (batch 8 verifying 8 tokens) 3229 vs 3802 (1579). Above 64 tokens it has not been measured, so the
# Triton kernels keep those (prefill buckets of 65-128 tokens).
WGMMA_MAX_TOKENS = 64


def _is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


# gate_up splits of H: 7 (K2's 28 tiles in 4-tile shares) against the earlier 4, one K2.5 layer, medians of
# round-robin rounds in one call (bench/results/moe-wgmma-lab-gpu-20261130-1438, -1446, -1447; us): T=1 64.4 vs 71.0 and 69.0 vs 70.0, T=2 112.3 vs 121.7, T=4 213.6 vs 216.9, T=8 409.2 vs 429.7.
# Above 8 tokens (batch-8 verify) 4 stays: T=16 879.2 vs 863.2, T=32 1755.6 vs 1709.4 (-1503).
SEVEN_SPLITS_MAX_TOKENS = 8


def wgmma_config_for(experts, choices: int, tokens: int = 1) -> dict:
    """moe_wgmma's splits for these shapes: gate_up the first of 7, 4, 2, 1 that divides H's tiles (7 only up to
    SEVEN_SPLITS_MAX_TOKENS tokens), down as many as divide the choices up to the measured 8; h laid out before
    SiLU (one launch a layer fewer, the same device time).

    One K2.5 layer, one call as the difference of two chain lengths, medians of 3 round-robin rounds
    (bench/results/moe-wgmma-lab-gpu-20261130-0545, -0548, -0553; us): h after / before SiLU T=1 71.5 / 72.9,
    T=4 217.4 / 217.6. Four down stages instead of two: T=1 73.2 vs 74.0 and 73.6 vs 75.5, T=2 123.2 vs 125.7
    and 120.8 vs 120.7, T=4 226.7 vs 237.5 and 224.1 vs 220.3, T=8 436.9 vs 431.6: no difference beyond the
    rounds' spread, so the down kernel keeps the gate_up kernel's two. At one token the down kernel also splits F
    in two (`down_k_splits`): its 896 programs made 1.36 waves of 8 steps, 1792 make 2.72 of 4. Nsight Compute
    (bench/results/ncu/ncu-1505-t1-splits.txt, ncu-1507-t1-down-splits.txt): down 22.3 us against 24.9-25.1,
    gate_up split 7 39.3-40.6 against 42.1; the lab: 67.5 against 69.0 us a layer call (-1446, inside the rounds'
    spread); the step's MoE row 65.2 us (bench/results/step-gpu-20261130-1508). At 2 / 4 / 8 tokens the F split
    measured 114.2 / 214.3 / 412.6 against 112.3 / 213.6 / 409.2 (-1447): not taken there."""
    tiles = experts.gate.shape[-1] // moe_wgmma.TILE_K
    candidates = (7, 4, 2, 1) if tokens <= SEVEN_SPLITS_MAX_TOKENS else (4, 2, 1)
    return dict(stages=moe_wgmma.STAGES, gate_up_splits=next(s for s in candidates if tiles % s == 0),
                down_splits=next(s for s in (8, 4, 2, 1) if choices % s == 0), permute_h="before",
                down_k_splits=2 if tokens == 1 and (experts.down.shape[-1] // moe_wgmma.TILE_K) % 2 == 0 else 1)


def moe_kernel_for(tokens: int, experts) -> str:
    """'wgmma' (moe_wgmma.py) or the Triton variant that `kernel_config_for` picks ('gemv' / 'mma')."""
    if tokens <= WGMMA_MAX_TOKENS and moe_wgmma.supports(experts) and _is_hopper():
        return "wgmma"
    return kernel_config_for(tokens, experts).variant


def fused_moe_applies(x_TH: jax.Array, experts) -> bool:
    if jax.default_backend() != "gpu" or isinstance(experts.gate, Fp8Weight):
        return False
    if x_TH.shape[0] > MAX_KERNEL_TOKENS:
        return False
    if moe_kernel_for(x_TH.shape[0], experts) == "wgmma":
        return True
    try:
        check_shapes(experts, kernel_config_for(x_TH.shape[0], experts))
    except ValueError:
        return False
    return True


def fused_routed_experts(x_TH: jax.Array, experts, ids_TK: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """The Pallas kernel with the H200-tuned tiles for this token count (call when `fused_moe_applies`)."""
    if moe_kernel_for(x_TH.shape[0], experts) == "wgmma":
        return moe_wgmma.routed_experts_wgmma(x_TH, experts, ids_TK, weights_TK,
                                              **wgmma_config_for(experts, ids_TK.shape[1], x_TH.shape[0]))
    return routed_experts_pallas(x_TH, experts, ids_TK, weights_TK, cfg=kernel_config_for(x_TH.shape[0], experts))


def routed_experts_for_backend(x_TH: jax.Array, experts, ids_TK: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """Fused Pallas MoE on GPU, plain XLA reference elsewhere; [T, H] -> [T, H]."""
    if fused_moe_applies(x_TH, experts):
        return fused_routed_experts(x_TH, experts, ids_TK, weights_TK)
    from model.moe import plain_routed_experts  # lazy: model.moe calls into this module

    return plain_routed_experts(x_TH, experts, ids_TK, weights_TK)


__all__ = [
    "PAIRS_MAX_TOKENS",
    "MAX_KERNEL_TOKENS",
    "WGMMA_MAX_TOKENS",
    "MoEKernelConfig",
    "fused_moe_applies",
    "fused_routed_experts",
    "kernel_config_for",
    "moe_kernel_for",
    "routed_experts_for_backend",
    "routed_experts_pallas",
    "token_tile",
    "wgmma_config_for",
]
