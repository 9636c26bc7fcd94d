"""The bytes a step must move, by component (REFERENCE.md section 8), and the time floor they imply.

Weights are counted from the very arrays the step reads; routed experts count only the unique experts
the step's router selected in each layer; the KV cache counts the visible slots of each sequence.
"""

from __future__ import annotations

import jax
import numpy as np

from model.decoder import KimiWeights
from model.moe import MoEWeights

HBM_TBS = 4.3  # H200 device-to-device copy through PyTorch, REFERENCE.md section 9


def nbytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(tree)))


def unique_experts_per_layer(ids_LTK: np.ndarray) -> list[int]:
    """[moe layers, tokens, K] router ids -> distinct experts per layer."""
    return [int(np.unique(ids).size) for ids in np.asarray(ids_LTK)]


def step_bytes(w: KimiWeights, cfg, batch: int, tokens: int, context: int, unique_per_layer: list[int],
               logits_rows: int | None = None) -> dict[str, int]:
    """Bytes for one target forward of `tokens` new tokens per sequence written at positions context.."""
    parts = dict(attention=0, dense=0, shared=0, router=0, routed=0, kv_cache=0)
    moe_layers = [lw for lw in w.layers if isinstance(lw.mlp, MoEWeights)]
    if len(unique_per_layer) != len(moe_layers):
        raise ValueError(f"{len(unique_per_layer)} unique counts for {len(moe_layers)} MoE layers")
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    cache_itemsize = 2
    for lw in w.layers:
        parts["attention"] += nbytes(lw.attn) + nbytes((lw.input_norm, lw.post_attention_norm))
        parts["kv_cache"] += batch * (context + tokens) * latent * cache_itemsize
        if isinstance(lw.mlp, MoEWeights):
            parts["router"] += nbytes((lw.mlp.router, lw.mlp.router_bias))
            parts["shared"] += nbytes(lw.mlp.shared) if lw.mlp.shared is not None else 0
        else:
            parts["dense"] += nbytes(lw.mlp)
    for lw, unique in zip(moe_layers, unique_per_layer):
        parts["routed"] += unique * nbytes(lw.mlp.experts) // lw.mlp.experts.num_experts
    rows = batch * tokens if logits_rows is None else logits_rows
    parts["lm_head"] = nbytes((w.lm_head, w.final_norm))
    parts["embed_rows"] = batch * tokens * w.embed.shape[1] * w.embed.dtype.itemsize
    parts["logits_write"] = rows * w.lm_head.shape[0] * 4
    parts["total"] = sum(parts.values())
    return parts


def draft_bytes(dw, dcfg, batch: int, tokens: int, context: int) -> int:
    """One draft forward over `tokens` positions: all draft weights but the (target-shared) embedding, its cache."""
    weights = nbytes(dw) - (nbytes(dw.embed) if dw.embed is not None else 0)
    if dcfg.attention == "mla":  # one latent + rope key per slot, shared by the heads
        kv = batch * (context + tokens) * (dcfg.kv_lora_rank + dcfg.qk_rope_head_dim) * 2
    else:
        kv = 2 * batch * (context + tokens) * dcfg.num_key_value_heads * dcfg.head_dim * 2
    return weights + kv


def floor_ms(total_bytes: int, tbs: float) -> float:
    return total_bytes / (tbs * 1e12) * 1e3
