"""Host-side (numpy) dequantization of the checkpoint formats, used while converting.

Conversion never touches an accelerator: dequantizing through JAX would copy every tensor to the default
device. The block size of FP8 comes from the config, not from the scale's shape, so edge blocks of a
dimension that the block does not divide (ceil-div scale grids) are handled exactly.
"""

from __future__ import annotations

import numpy as np


def dequantize_fp8_block(weight_XI: np.ndarray, scale_inv_oi: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float8_e4m3fn [out, in] with one scale per [bo, bi] block -> float32 [out, in]."""
    out, inp = weight_XI.shape
    bo, bi = block
    scale_XI = np.repeat(np.repeat(scale_inv_oi.astype(np.float32), bo, axis=0), bi, axis=1)[:out, :inp]
    return weight_XI.astype(np.float32) * scale_XI


def unpack_int4_words(packed_XW: np.ndarray) -> np.ndarray:
    """[out, in/8] int32 / uint32 words -> [out, in] int8 in [-8, 7]; element c in bits [4*(c%8), +4) of word c//8."""
    words = packed_XW.view(np.uint32)
    shifts = np.arange(8, dtype=np.uint32) * 4
    nibbles = (words[..., None] >> shifts) & np.uint32(0xF)
    return (nibbles.astype(np.int8) - np.int8(8)).reshape(*packed_XW.shape[:-1], packed_XW.shape[-1] * 8)


def dequantize_int4_group(packed_XW: np.ndarray, scale_XG: np.ndarray) -> np.ndarray:
    """compressed-tensors pack-quantized (symmetric, group along `in`, no zero point) -> float32 [out, in]."""
    q_XI = unpack_int4_words(packed_XW).astype(np.float32)
    out, inp = q_XI.shape
    groups = scale_XG.shape[-1]
    q_XGI = q_XI.reshape(out, groups, inp // groups)
    return (q_XGI * scale_XG.astype(np.float32)[..., None]).reshape(out, inp)
