"""Tile configuration of the Triton routed-experts kernels (moe_gather.py, moe_gemv.py) and the checks both share."""

from __future__ import annotations

import dataclasses

import jax

from model.quant import Int4Weight

MIN_TOKEN_TILE = 16  # Triton's dot needs every dimension >= 16


@dataclasses.dataclass(frozen=True)
class MoEKernelConfig:
    block_f: int = 32  # gate_up: rows of F per program
    block_h: int = 32  # down: rows of H per program
    block_k: int = 64  # words (int4) or elements (bf16) of the contracted dim per loop step and part
    num_warps: int = 4
    num_stages: int = 3
    variant: str = "mma"  # "mma": tensor-core dots (any T <= 128); "gemv": CUDA-core FMAs, moe_gemv.py
    scales: str = "gather"  # int4 group scales: "gather" one per word by index, "join" per group then repeated
    prefetch: bool = False  # gemv: issue the next step's loads before this step's arithmetic
    down_splits: int = 1  # down kernel: programs per block of H rows, each over a share of the slots
    slots: str = "unique"  # gemv: "unique" one slot per distinct expert, "pairs" one per (token, choice)


def token_tile(t: int) -> int:
    return max(MIN_TOKEN_TILE, 1 << (t - 1).bit_length())


def parts_of(w) -> int:
    return 8 if isinstance(w, Int4Weight) else 1


def weight_arrays(w) -> tuple[jax.Array, ...]:
    return (w.packed, w.scale) if isinstance(w, Int4Weight) else (w,)


def words_per_group(w) -> int:
    return w.group_size // 8 if isinstance(w, Int4Weight) else 1


def check_shapes(experts, cfg: MoEKernelConfig) -> None:
    """Raise ValueError when the tiles do not divide these expert shapes."""
    e, f, h = experts.gate.shape
    parts = parts_of(experts.gate)
    wpg = words_per_group(experts.gate)
    if wpg & (wpg - 1):
        raise ValueError(f"group size {experts.gate.group_size} must be 8 * a power of two")
    for name, n, b in (("F/parts", f // parts, cfg.block_f), ("F/parts", f // parts, cfg.block_k),
                       ("H/parts", h // parts, cfg.block_k), ("H", h, cfg.block_h)):
        if n % b or b % wpg:
            raise ValueError(f"{name}={n} is not a multiple of block {b} (or block not of whole groups)")
    if parts_of(experts.down) != parts:
        raise ValueError("gate/up and down must share one storage format")
