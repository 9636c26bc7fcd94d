"""An RMSNorm and the projection after it, for a few tokens (decode, verify), in one Pallas (Triton) kernel.

Plain reference: `norm_gemv_reference` (model.norms.rms_norm, then model.quant.linear), which is what runs
everywhere the kernel does not. Why: at one token XLA runs RMSNorm and a [O, H] projection after it as a chain of
four launches (the sum of squares, the scale, a split-K GEMM and the sum of its splits), three of which read next to
nothing; on one device of the 8-way mesh a layer is a chain of such launches (docs/performance.md, "Counting a GPU
program's kernels without a GPU"). Here each program takes `block_o` rows of the weight: it sums x's squares itself
(x is a few rows, read from L2 by every program), then streams its rows block by block against the normed x, each
weight block read once for all the tokens.

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
# the products of several tokens are a [tokens, rows, columns] block in registers: at most this many a step
PRODUCT_ELEMENTS = 8192
MAX_TOKENS = 8  # rows of x (batch x tokens): decode at batch 1 to 8, verify of up to 8 tokens at batch 1


def config_for(out_features: int, hidden: int, rows: tuple[int, ...] = (), tokens: int = 1) -> NormGemvConfig | None:
    """The tiles for a [out_features, hidden] weight (or weights of `rows` rows, `out_features` in all) and
    `tokens` rows of x: blocks of rows and columns that divide it (each of them; powers of two, as Triton's blocks
    are); None where a step would hold fewer than 16 columns, or for more than MAX_TOKENS tokens."""
    if not 1 <= tokens <= MAX_TOKENS:
        return None
    base = NormGemvConfig()
    block_o = min(_pow2_divisor(r, base.block_o) for r in (rows or (out_features,)))
    while block_o > MIN_BLOCK_O and out_features // block_o < MIN_PROGRAMS:
        block_o //= 2
    widest = max(base.block_h, TILE_ELEMENTS // block_o) if tokens == 1 else PRODUCT_ELEMENTS // (tokens * block_o)
    block_h = min(_pow2_divisor(hidden, TILE_ELEMENTS), 1 << (widest.bit_length() - 1))  # a power of two
    if block_h < 16:
        return None
    return dataclasses.replace(base, block_o=block_o, block_h=block_h)


def _kernel(*refs, hidden, block_o, block_h, eps, residual, interpret, weight_rows, tokens, rows_held):
    x_ref, r_ref = refs[0], refs[1:1 + residual]
    norm_ref, w_refs, y_ref = refs[1 + residual], refs[2 + residual:-1], refs[-1]
    program = pl.program_id(0)
    steps = hidden // block_h
    dt = x_ref.dtype
    # Triton's blocks are powers of two: `tokens` rows are computed, the first `rows_held` exist (3 of 4 at a verify
    # of 3); on a GPU the rows past them load as zeros (their sums of squares 0, their outputs finite and not
    # stored), in the interpreter, which cannot slice past an array's end, x arrives padded instead
    real_T1 = (jnp.arange(tokens) < rows_held)[:, None] if tokens > rows_held and not interpret else None

    def load(ref, cols):
        if real_T1 is None:
            return ref[:, cols]
        return pl_triton.load(ref.at[pl.ds(0, tokens), cols], mask=real_T1, other=0.0)

    def x_at(cols):  # float32 x [T, K], or x + residual rounded to x's dtype (XLA's add of the two)
        x = load(x_ref, cols).astype(jnp.float32)
        return rounded(x + load(r_ref[0], cols).astype(jnp.float32), dt, interpret) if residual else x

    def squares(i, acc_T):
        x = x_at(pl.ds(i * block_h, block_h))
        return acc_T + jnp.sum(x * x, axis=1)

    sums_T = jax.lax.fori_loop(0, steps, squares, jnp.zeros((tokens,), jnp.float32))
    inv_rms_T1 = jax.lax.rsqrt(sums_T / hidden + eps)[:, None]

    def project(w_ref, row0, out0):  # rows row0.. of w_ref into y's columns out0 + row0..
        def products(i, acc_TO):
            cols = pl.ds(i * block_h, block_h)
            # rms_norm's roundings: the normed x to x's dtype, then its product with the norm's weight
            normed_TK = rounded(x_at(cols) * inv_rms_T1, dt, interpret)
            normed_TK = rounded(norm_ref[cols].astype(jnp.float32)[None, :] * normed_TK, dt, interpret)
            w_OK = w_ref[pl.ds(row0, block_o), cols].astype(jnp.float32)
            return acc_TO + jnp.sum(normed_TK[:, None, :] * w_OK[None, :, :], axis=2)

        acc_TO = jax.lax.fori_loop(0, steps, products, jnp.zeros((tokens, block_o), jnp.float32))
        out_cols = pl.ds(out0 + row0, block_o)
        if real_T1 is None:
            y_ref[:, out_cols] = acc_TO.astype(y_ref.dtype)
        else:
            pl_triton.store(y_ref.at[pl.ds(0, tokens), out_cols], acc_TO.astype(y_ref.dtype), mask=real_T1)

    if len(w_refs) == 1:
        project(w_refs[0], program * block_o, 0)
        return
    first_program = first_row = 0  # the weights' programs one after another, each weight's rows in whole blocks
    for w_ref, rows in zip(w_refs, weight_rows):
        programs = rows // block_o

        @pl.when((program >= first_program) & (program < first_program + programs))
        def _(w_ref=w_ref, first_program=first_program, first_row=first_row):
            project(w_ref, (program - first_program) * block_o, first_row)

        first_program, first_row = first_program + programs, first_row + rows


def norm_gemv(x_TH: jax.Array, norm_H: jax.Array, weight_OH, eps: float, *, residual_TH=None,
              out_dtype=None, cfg: NormGemvConfig | None = None, interpret: bool = False) -> jax.Array:
    """linear(rms_norm(x, norm, eps), weight) for up to MAX_TOKENS rows: x [T, W], weight [O, H] -> [T, O] in x's
    dtype, the norm over x's first H columns (W >= H: x may be a wider projection's output, read in place).
    `weight_OH` may be a tuple of weights [O_i, H] (the shared expert's gate and up): one launch, their outputs side
    by side. `residual_TH` [T, H]: the norm is of x + residual (in x's dtype), the sum a residual stream adds
    before its norm; `out_dtype`: the output's (float32: the products summed in float32 and kept, as the router's
    logits); `cfg`: the tiles (None: `config_for` the weights' shapes and T)."""
    weights = tuple(weight_OH) if isinstance(weight_OH, (tuple, list)) else (weight_OH,)
    t, width = x_TH.shape
    hidden = weights[0].shape[1]
    rows = tuple(w.shape[0] for w in weights)
    out_features = sum(rows)
    if not 1 <= t <= MAX_TOKENS:
        raise ValueError(f"norm_gemv takes 1 to {MAX_TOKENS} rows of x, got {t}")
    if width < hidden or norm_H.shape != (hidden,) or any(w.shape[1] != hidden for w in weights):
        raise ValueError(f"norm_gemv: x {x_TH.shape}, norm {norm_H.shape} and weights "
                         f"{[w.shape for w in weights]} disagree")
    cfg = cfg or config_for(out_features, hidden, rows, t)
    if cfg is None or any(r % cfg.block_o for r in rows) or hidden % cfg.block_h:
        raise ValueError(f"norm_gemv: weights {[w.shape for w in weights]} are not in whole blocks of rows and "
                         f"columns ({cfg or 'no tiles'})")
    if not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a Python number (it is baked into the kernel), got {type(eps).__name__}")
    if residual_TH is not None and residual_TH.shape != (t, hidden):
        raise ValueError(f"norm_gemv: residual {residual_TH.shape} is not [{t}, {hidden}]")
    tokens = 1 << (t - 1).bit_length()  # the rows computed: a power of two (`_kernel`)
    residual = () if residual_TH is None else (residual_TH.astype(x_TH.dtype),)
    held = t
    if interpret and tokens > t:  # the interpreter's slices stay inside an array: x padded to the rows computed
        pad = lambda a: jnp.pad(a, ((0, tokens - t), (0, 0)))  # noqa: E731
        x_TH, residual, held = pad(x_TH), tuple(pad(r) for r in residual), tokens
    kernel = functools.partial(_kernel, hidden=hidden, block_o=cfg.block_o, block_h=cfg.block_h, eps=eps,
                               residual=residual_TH is not None, interpret=interpret, weight_rows=rows,
                               tokens=tokens, rows_held=held)
    y_TO = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((held, out_features), out_dtype or x_TH.dtype),
        grid=(out_features // cfg.block_o,),
        compiler_params=pl_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="norm_gemv",
    )(x_TH, *residual, norm_H.astype(x_TH.dtype), *(w.astype(x_TH.dtype) for w in weights))
    return y_TO[:t]


def norm_gemv_reference(x_TH: jax.Array, norm_H: jax.Array, weight_OH, eps: float, *, residual_TH=None,
                        out_dtype=None) -> jax.Array:
    """The plain XLA form the kernel is held to (and what runs where it does not): float32 products summed in
    float32 where `out_dtype` is float32 (as `model.router.router_logits`), `model.quant.linear` otherwise; a tuple
    of weights, their outputs side by side."""
    weights = tuple(weight_OH) if isinstance(weight_OH, (tuple, list)) else (weight_OH,)
    hidden = weights[0].shape[1]
    x = x_TH[:, :hidden] if residual_TH is None else x_TH[:, :hidden] + residual_TH.astype(x_TH.dtype)
    normed = rms_norm(x, norm_H, eps)
    if out_dtype is not None and jnp.dtype(out_dtype) == jnp.float32:
        return jnp.concatenate([jnp.einsum("th,oh->to", normed.astype(jnp.float32), w.astype(jnp.float32),
                                           precision=jax.lax.Precision.HIGHEST) for w in weights], axis=1)
    return jnp.concatenate([linear(normed, w).astype(out_dtype or x_TH.dtype) for w in weights], axis=1)
