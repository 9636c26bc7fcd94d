"""Post-training INT4 quantization of the routed experts into compressed-tensors' pack-quantized layout.

Symmetric, one bf16 scale per group of `group` inputs, no zero point (what Kimi-K2.5 ships). Each
group's scale is chosen among a few clipping ratios by squared error: clipping the largest weight a
little usually lowers the error of all the others.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from model.decoder import KimiWeights
from model.moe import ExpertWeights, MoEWeights
from model.quant import Int4Weight, pack_int4

CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def quantize_int4(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """[.., out, in] float -> (q int8 in [-8, 7] [.., out, in], scale bf16 [.., out, in/group])."""
    w = np.asarray(w, np.float32)
    grouped_XGI = w.reshape(*w.shape[:-1], w.shape[-1] // group, group)
    max_abs = np.abs(grouped_XGI).max(-1, keepdims=True)
    best_err = np.full(max_abs.shape, np.inf, np.float32)
    best_q = np.zeros(grouped_XGI.shape, np.int8)
    best_scale = np.zeros(max_abs.shape, np.float32)
    for ratio in CLIP_RATIOS:
        # round the scale to bf16 first: the codes must be chosen against the scale that is stored
        scale = (np.maximum(max_abs * ratio, 1e-12) / 7.0).astype(ml_dtypes.bfloat16).astype(np.float32)
        q = np.clip(np.rint(grouped_XGI / scale), -8, 7)
        err = ((q * scale - grouped_XGI) ** 2).sum(-1, keepdims=True)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_q = np.where(better, q.astype(np.int8), best_q)
        best_scale = np.where(better, scale, best_scale)
    return best_q.reshape(w.shape), best_scale[..., 0].astype(ml_dtypes.bfloat16)


def to_int4_weight(w: np.ndarray, group: int) -> Int4Weight:
    q, scale = quantize_int4(w, group)
    return Int4Weight(packed=pack_int4(q), scale=scale)


def quantize_experts(w: KimiWeights, group: int) -> KimiWeights:
    """Every routed expert matrix as Int4Weight (numpy leaves); everything else untouched."""
    layers = []
    for lw in w.layers:
        if isinstance(lw.mlp, MoEWeights):
            e = lw.mlp.experts
            experts = ExpertWeights(*(to_int4_weight(np.asarray(m, np.float32), group) for m in (e.gate, e.up, e.down)))
            lw = lw.replace(mlp=lw.mlp.replace(experts=experts))
        layers.append(lw)
    return w.replace(layers=tuple(layers))
