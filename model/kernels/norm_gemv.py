"""A decoder layer's input norm and the projection after it, for one token, in one Pallas (Triton) kernel.

Plain reference: `norm_gemv_reference` (model.norms.rms_norm, then model.quant.linear), which is what runs
everywhere the kernel does not. Why: at one token XLA runs RMSNorm and a [O, H] projection after it as a chain of
four launches (the sum of squares, the scale, a split-K GEMM and the sum of its splits), three of which read next to
nothing; on one device of the 8-way mesh a layer is a chain of such launches (docs/performance.md, "Counting a GPU
program's kernels without a GPU"). Here each program takes `block_o` rows of the weight: it sums x's squares itself
(x is one row, read from L2 by every program), then streams its rows block by block against the normed x.

The norm rounds as Hugging Face's does (the normed x to the activation dtype, then times the norm weight in it), so
the products are the reference's; only the order of the f32 summation differs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from model.kernels.triton_ops import rounded
from model.norms import rms_norm
from model.quant import linear


@dataclasses.dataclass(frozen=True)
class NormGemvConfig:
    block_o: int = 16  # weight rows per program: 2112 rows (Kimi's q_a + kv_a) are 132 programs, one per SM
    block_h: int = 512  # columns per loop step
    num_warps: int = 4
    num_stages: int = 3  # loads in flight ahead of the products


def _pow2_divisor(n: int, most: int) -> int:
    """The largest power of two up to `most` that divides n."""
    return min(n & -n, most)


# a weight of few rows is split into narrower blocks down to MIN_BLOCK_O rows until it makes this many programs (the
# router's 384 rows: 96 programs of 4), and each block then takes wider steps (up to TILE_ELEMENTS weights a step),
# so the loads in flight stay enough to stream the weight
MIN_PROGRAMS = 96
MIN_BLOCK_O = 4
TILE_ELEMENTS = 8192


def config_for(out_features: int, hidden: int) -> NormGemvConfig | None:
    """The tiles for a [out_features, hidden] weight: blocks of rows and columns that divide it (powers of two, as
    Triton's blocks are); None where a step would hold fewer than 16 columns."""
    base = NormGemvConfig()
    block_o = _pow2_divisor(out_features, base.block_o)
    while block_o > MIN_BLOCK_O and out_features // block_o < MIN_PROGRAMS:
        block_o //= 2
    block_h = min(_pow2_divisor(hidden, TILE_ELEMENTS), max(base.block_h, TILE_ELEMENTS // block_o))
    if block_h < 16:
        return None
    return dataclasses.replace(base, block_o=block_o, block_h=block_h)


def _kernel(*refs, hidden, block_o, block_h, eps, residual, interpret):
    x_ref, *r_ref, norm_ref, w_ref, y_ref = refs
    rows = pl.ds(pl.program_id(0) * block_o, block_o)
    steps = hidden // block_h
    dt = x_ref.dtype

    def x_at(cols):  # float32 x, or x + residual rounded to x's dtype (XLA's add of the two)
        x = x_ref[0, cols].astype(jnp.float32)
        return rounded(x + r_ref[0][0, cols].astype(jnp.float32), dt, interpret) if residual else x

    def squares(i, acc):
        x = x_at(pl.ds(i * block_h, block_h))
        return acc + jnp.sum(x * x)

    inv_rms = jax.lax.rsqrt(jax.lax.fori_loop(0, steps, squares, jnp.float32(0.0)) / hidden + eps)

    def products(i, acc_O):
        cols = pl.ds(i * block_h, block_h)
        # rms_norm's roundings: the normed x to x's dtype, then its product with the norm's weight
        normed = rounded(x_at(cols) * inv_rms, dt, interpret)
        normed = rounded(norm_ref[cols].astype(jnp.float32) * normed, dt, interpret)
        w_OK = w_ref[rows, cols]
        return acc_O + jnp.sum(w_OK.astype(jnp.float32) * normed[None, :], axis=1)

    acc_O = jax.lax.fori_loop(0, steps, products, jnp.zeros((block_o,), jnp.float32))
    y_ref[0, rows] = acc_O.astype(y_ref.dtype)


def norm_gemv(x_TH: jax.Array, norm_H: jax.Array, weight_OH: jax.Array, eps: float, *, residual_TH=None,
              out_dtype=None, cfg: NormGemvConfig | None = None, interpret: bool = False) -> jax.Array:
    """linear(rms_norm(x, norm, eps), weight) for one token: x [1, W], weight [O, H] -> [1, O] in x's dtype, the
    norm over x's first H columns (W >= H: x may be a wider projection's output, read in place).
    `residual_TH` [1, H]: the norm is of x + residual (in x's dtype), the sum a residual stream adds before its
    norm; `out_dtype`: the output's (float32: the products summed in float32 and kept, as the router's logits);
    `cfg`: the tiles (None: `config_for` the weight's shape)."""
    t, width = x_TH.shape
    out_features, hidden = weight_OH.shape
    if t != 1:
        raise ValueError(f"norm_gemv takes one token, got {t}")
    if width < hidden or norm_H.shape != (hidden,):
        raise ValueError(f"norm_gemv: x {x_TH.shape}, norm {norm_H.shape} and weight {weight_OH.shape} disagree")
    cfg = cfg or config_for(out_features, hidden)
    if cfg is None or out_features % cfg.block_o or hidden % cfg.block_h:
        raise ValueError(f"norm_gemv: weight {weight_OH.shape} is not in whole blocks of rows and columns "
                         f"({cfg or 'no tiles'})")
    if not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a Python number (it is baked into the kernel), got {type(eps).__name__}")
    if residual_TH is not None and residual_TH.shape != (1, hidden):
        raise ValueError(f"norm_gemv: residual {residual_TH.shape} is not [1, {hidden}]")
    kernel = functools.partial(_kernel, hidden=hidden, block_o=cfg.block_o, block_h=cfg.block_h, eps=eps,
                               residual=residual_TH is not None, interpret=interpret)
    residual = () if residual_TH is None else (residual_TH.astype(x_TH.dtype),)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((1, out_features), out_dtype or x_TH.dtype),
        grid=(out_features // cfg.block_o,),
        compiler_params=pl_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="norm_gemv",
    )(x_TH, *residual, norm_H.astype(x_TH.dtype), weight_OH.astype(x_TH.dtype))


def norm_gemv_reference(x_TH: jax.Array, norm_H: jax.Array, weight_OH: jax.Array, eps: float, *, residual_TH=None,
                        out_dtype=None) -> jax.Array:
    """The plain XLA form the kernel is held to (and what runs where it does not): float32 products summed in
    float32 where `out_dtype` is float32 (as `model.router.router_logits`), `model.quant.linear` otherwise."""
    hidden = weight_OH.shape[1]
    x = x_TH[:, :hidden] if residual_TH is None else x_TH[:, :hidden] + residual_TH.astype(x_TH.dtype)
    normed = rms_norm(x, norm_H, eps)
    if out_dtype is not None and jnp.dtype(out_dtype) == jnp.float32:
        return jnp.einsum("th,oh->to", normed.astype(jnp.float32), weight_OH.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
    return linear(normed, weight_OH).astype(out_dtype or x_TH.dtype)
