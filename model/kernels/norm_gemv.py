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


def config_for(out_features: int, hidden: int) -> NormGemvConfig | None:
    """The tiles for a [out_features, hidden] weight: the default blocks, or the largest powers of two below them
    that divide it (Triton's blocks are powers of two); None where a block would hold fewer than 16 columns."""
    base = NormGemvConfig()
    block_h = _pow2_divisor(hidden, base.block_h)
    if block_h < 16:
        return None
    return dataclasses.replace(base, block_o=_pow2_divisor(out_features, base.block_o), block_h=block_h)


def _kernel(x_ref, norm_ref, w_ref, y_ref, *, hidden, block_o, block_h, eps):
    rows = pl.ds(pl.program_id(0) * block_o, block_o)
    steps = hidden // block_h

    def squares(i, acc):
        x = x_ref[0, pl.ds(i * block_h, block_h)].astype(jnp.float32)
        return acc + jnp.sum(x * x)

    inv_rms = jax.lax.rsqrt(jax.lax.fori_loop(0, steps, squares, jnp.float32(0.0)) / hidden + eps)

    def products(i, acc_O):
        cols = pl.ds(i * block_h, block_h)
        x = x_ref[0, cols]
        normed = norm_ref[cols] * (x.astype(jnp.float32) * inv_rms).astype(x.dtype)  # rms_norm's roundings
        w_OK = w_ref[rows, cols]
        return acc_O + jnp.sum(w_OK.astype(jnp.float32) * normed.astype(jnp.float32)[None, :], axis=1)

    acc_O = jax.lax.fori_loop(0, steps, products, jnp.zeros((block_o,), jnp.float32))
    y_ref[0, rows] = acc_O.astype(y_ref.dtype)


def norm_gemv(x_TH: jax.Array, norm_H: jax.Array, weight_OH: jax.Array, eps: float, *,
              cfg: NormGemvConfig | None = None, interpret: bool = False) -> jax.Array:
    """linear(rms_norm(x, norm, eps), weight) for one token: x [1, W], weight [O, H] -> [1, O] in x's dtype, the
    norm over x's first H columns (W >= H: x may be a wider projection's output, read in place). `cfg`: the tiles
    (None: `config_for` the weight's shape)."""
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
    kernel = functools.partial(_kernel, hidden=hidden, block_o=cfg.block_o, block_h=cfg.block_h, eps=eps)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((1, out_features), x_TH.dtype),
        grid=(out_features // cfg.block_o,),
        compiler_params=pl_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="norm_gemv",
    )(x_TH, norm_H.astype(x_TH.dtype), weight_OH.astype(x_TH.dtype))


def norm_gemv_reference(x_TH: jax.Array, norm_H: jax.Array, weight_OH: jax.Array, eps: float) -> jax.Array:
    """The plain XLA form the kernel is held to (and what runs where it does not)."""
    return linear(rms_norm(x_TH, norm_H, eps), weight_OH)
