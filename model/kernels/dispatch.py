"""Which implementation runs each kernel family, from (backend, shapes, `model.config.Kernels`).

The model's layers ask here; the answer is a plain Python value at trace time, so a program's kernels follow from
its config and shapes alone. `Kernels(...)="auto"` takes a GPU kernel only where it serves the shapes it was tuned
for on one GPU (the measurements behind each bound are in docs/performance.md); everywhere else, and always with
"off", the plain XLA reference beside each kernel runs. Under a mesh the bounds apply to one device's block: each
device runs the kernels over its own heads, batch rows or experts, inside shard_map (model.shard_local).

Routed experts (`moe_kernel_for`):
- INT4 experts on Hopper up to WGMMA_MAX_TOKENS tokens (decode, verify): moe_wgmma.py, Mosaic GPU, weight tiles
  streamed into shared memory by TMA, products on tensor cores; with `Kernels(moe="grouped")`, verify of 2 to
  moe_grouped.MAX_TOKENS tokens takes moe_grouped.py instead (an expert several slots chose is converted once);
- otherwise up to PAIRS_MAX_TOKENS: moe_gemv.py, Triton, one slot per (token, choice) on CUDA cores;
- above (up to MAX_KERNEL_TOKENS): moe_gather.py, Triton, tensor-core dots over the unique experts;
- prefill buckets beyond MAX_KERNEL_TOKENS: the plain dense path.
"""

from __future__ import annotations

import jax

from model.config import Kernels, TextConfig
from model.kernels import moe_grouped, moe_wgmma, target
from model.kernels.mla_decode import LONG_CACHE_MIN_BATCH, check_config, check_pages, config_for
from model.kernels.moe_gather import routed_experts_pallas
from model.kernels.moe_tiles import MoEKernelConfig, check_shapes
from model.kv_cache import LONG_CAPACITY
from model.quant import Fp8Weight, Int4Weight
from model.shard_local import sharded_mesh
from model.sharding import shard_shape, spec_for

# Above this many tokens (prefill buckets) the kernels' per-slot pass stops paying: the plain dense path runs.
MAX_KERNEL_TOKENS = 128
# One slot per (token, choice) on CUDA cores up to this many tokens, tensor-core dots over the unique experts above
# (INT4 prefill buckets of 64 measured fastest with pairs; at 128 the mma tiles exceed Hopper's shared memory).
PAIRS_MAX_TOKENS = {"int4": 128, "bf16": 4}
# The Mosaic GPU kernel takes decode and every verify up to batch 8 x 8 tokens; beyond, it has not been measured.
WGMMA_MAX_TOKENS = 64
# gate_up splits H 7 ways (Kimi's 28 tiles in 4-tile shares) up to this many tokens, 4 ways above.
SEVEN_SPLITS_MAX_TOKENS = 8

# MLA decode kernels: batch x tokens up to this (larger query blocks ran faster through XLA's batched GEMMs), and
# never beyond MLA_KERNEL_MAX_TOKENS tokens even when forced (prefill never takes them).
MLA_KERNEL_MAX_QUERY_TOKENS = 8
MLA_KERNEL_MAX_TOKENS = 16
# A paged cache's other path gathers every sequence's pages (the whole capacity) per layer and step before XLA's
# attention; over caches longer than this the kernels reading through the table beat it at every batch measured,
# decode and verify (bench.paged_attention at K2.5's dims; docs/performance.md).
PAGED_KERNEL_MIN_CAPACITY = 2048


def local_size(logical: str, size: int, mesh) -> int:
    """One device's share of a dimension of `size` along `logical` (model.sharding's rules)."""
    return shard_shape(spec_for((logical,), (size,), mesh), (size,), mesh)[0]


# --- routed experts --------------------------------------------------------------------------------------------
def triton_config_for(tokens: int, experts) -> MoEKernelConfig:
    """The Triton kernels' tiles for this token count: one slot per (token, choice) on CUDA cores at few tokens,
    tensor-core dots over the unique experts above."""
    int4 = isinstance(experts.gate, Int4Weight)
    if tokens <= PAIRS_MAX_TOKENS["int4" if int4 else "bf16"]:
        return MoEKernelConfig(block_f=32, block_h=32, block_k=64 if int4 else 256, num_warps=4, variant="gemv",
                               down_splits=8, slots="pairs")
    # wgmma tiles of 64 rows; two stages keep the shared memory (dequantized tiles + inputs) under 227 KB
    return MoEKernelConfig(block_f=64, block_h=64, block_k=64, num_warps=4, num_stages=2, variant="mma", down_splits=8)


def wgmma_config_for(experts, choices: int, tokens: int = 1) -> dict:
    """moe_wgmma's splits for these shapes: gate_up the first of 7, 4, 2, 1 that divides H's tiles (7 only up to
    SEVEN_SPLITS_MAX_TOKENS tokens: more programs in flight at few tokens), down as many splits of the choices as
    divide them up to 8; at one token the down kernel also splits F in two (its programs then fill the GPU in
    whole waves)."""
    tiles = experts.gate.shape[-1] // moe_wgmma.TILE_K
    candidates = (7, 4, 2, 1) if tokens <= SEVEN_SPLITS_MAX_TOKENS else (4, 2, 1)
    return dict(stages=moe_wgmma.STAGES, gate_up_splits=next(s for s in candidates if tiles % s == 0),
                down_splits=next(s for s in (8, 4, 2, 1) if choices % s == 0),
                down_k_splits=2 if tokens == 1 and (experts.down.shape[-1] // moe_wgmma.TILE_K) % 2 == 0 else 1)


def _triton_fits(tokens: int, experts) -> bool:
    try:
        check_shapes(experts, triton_config_for(tokens, experts))
    except ValueError:
        return False
    return True


def moe_kernel_for(tokens: int, experts, kernels: Kernels = Kernels()) -> str | None:
    """'wgmma' (moe_wgmma.py), 'grouped' (moe_grouped.py), 'gemv' / 'mma' (the Triton kernels,
    `triton_config_for`), or None for the plain XLA path."""
    if kernels.moe == "off" or isinstance(experts.gate, Fp8Weight) or tokens > MAX_KERNEL_TOKENS:
        return None
    if target.platform() != "gpu":  # under a mesh too: model.moe_parallel runs this per device
        return None
    wgmma_fits = tokens <= WGMMA_MAX_TOKENS and moe_wgmma.supports(experts) and target.on_hopper()
    # "grouped" is "auto" but for verify on Hopper (one token has nothing to share)
    if kernels.moe == "grouped" and wgmma_fits and 2 <= tokens <= moe_grouped.MAX_TOKENS:
        return "grouped"
    if kernels.moe in ("auto", "wgmma", "grouped") and wgmma_fits:
        return "wgmma"
    if kernels.moe in ("auto", "triton", "grouped") and _triton_fits(tokens, experts):
        return triton_config_for(tokens, experts).variant
    return None


def fused_routed_experts(x_TH: jax.Array, experts, ids_TK: jax.Array, weights_TK: jax.Array, kernel: str,
                         first_expert=None) -> jax.Array:
    """The kernel `moe_kernel_for` named, with its tuned tiles for this token count: [T, H] -> [T, H].
    `first_expert` (moe_wgmma only): the ids are global, the experts one device's (`routed_experts_wgmma`)."""
    tokens = x_TH.shape[0]
    if first_expert is not None and kernel != "wgmma":
        raise ValueError(f"the {kernel} routed-experts kernel takes local expert ids, not a first expert")
    if kernel == "wgmma":
        return moe_wgmma.routed_experts_wgmma(x_TH, experts, ids_TK, weights_TK, first_expert=first_expert,
                                              **wgmma_config_for(experts, ids_TK.shape[1], tokens))
    if kernel == "grouped":
        return moe_grouped.routed_experts_grouped(x_TH, experts, ids_TK, weights_TK,
                                                  **wgmma_config_for(experts, ids_TK.shape[1], tokens))
    return routed_experts_pallas(x_TH, experts, ids_TK, weights_TK, cfg=triton_config_for(tokens, experts))


# --- MLA attention ---------------------------------------------------------------------------------------------
def mla_kernel_applies(kernels: Kernels, batch: int, tokens: int, capacity: int, cfg: TextConfig,
                       backend: str | None = None, page_tokens: int | None = None) -> bool:
    """The MLA decode kernels (mla_decode.py) for this absorbed attention step? "auto": on a GPU, batch x tokens
    <= MLA_KERNEL_MAX_QUERY_TOKENS over caches of up to LONG_CAPACITY slots, and decode at batch >=
    LONG_CACHE_MIN_BATCH over longer caches; "on": any batch and capacity up to MLA_KERNEL_MAX_TOKENS tokens,
    on a GPU. Under a mesh, batch and heads are one device's. `page_tokens`: the cache is paged (`capacity` = table
    width x page size) and the kernels read its pages, which their blocks must tile; "auto" then also takes them at
    any batch over caches of PAGED_KERNEL_MIN_CAPACITY to LONG_CAPACITY slots."""
    if kernels.mla == "off" or (backend or target.platform()) != "gpu" or tokens > MLA_KERNEL_MAX_TOKENS:
        return False
    heads = cfg.num_attention_heads
    mesh = sharded_mesh()
    if mesh is not None:  # each device runs the kernels over its block (model.attention_mla.attend_absorbed_kernel)
        if page_tokens is not None and mesh.shape.get("data", 1) > 1:
            return False  # a table's page ids are global: its pools would have to be whole on every device
        batch = local_size("batch", batch, mesh) if page_tokens is None else batch
        heads = local_size("heads", heads, mesh)
    long_cache_decode = tokens == 1 and batch >= LONG_CACHE_MIN_BATCH
    paged_pays = page_tokens is not None and PAGED_KERNEL_MIN_CAPACITY <= capacity <= LONG_CAPACITY
    if kernels.mla == "auto" and not paged_pays and (batch * tokens > MLA_KERNEL_MAX_QUERY_TOKENS
                                                     or (capacity > LONG_CAPACITY and not long_cache_decode)):
        return False
    try:
        tiles = config_for(capacity, cfg.kv_lora_rank, tokens * heads, batch)
        check_config(tiles, capacity, cfg.kv_lora_rank)
        if page_tokens is not None:
            check_pages(tiles, page_tokens)
    except ValueError:
        return False
    return True


# --- routing ---------------------------------------------------------------------------------------------------
def router_kernel_applies(kernels: Kernels, tokens: int, cfg: TextConfig) -> bool:
    """The router's top-k kernel (router_topk.py, with router_gemv.py's logits at 2-8 tokens)? It routes one expert
    group only. "auto": on a GPU for as many tokens as the MoE kernels take (decode, verify); "on": wherever it
    can (off the GPU in Pallas' interpret mode). Under a mesh every device routes every token itself."""
    if kernels.router == "off" or cfg.n_group > 1:
        return False
    if kernels.router == "on":
        return True
    return target.platform() == "gpu" and tokens <= MAX_KERNEL_TOKENS
