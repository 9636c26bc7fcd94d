"""RMSNorms of a few rows, each with the residual add before it, in one Pallas (Triton) launch: one program per row.

Plain reference: `model.norms.add_rms_norm` (x + addend in x's dtype, then `model.norms.rms_norm`). Why: at decode
and verify a norm reads a few KB per row, and XLA runs it as two launches (the mean of squares, then the scale),
with the residual add before it as a third and MLA's two LoRA norms (q_a, kv_a) as three: each launch costs its
fixed latency, not its bytes. Here one program holds its row's pieces in registers, so the sum, its mean of squares
and the scaled output come from one read; several norms of the same rows share the launch.

A norm job is (rows x [X, I], addend [X, I] or None, weight [W]): the first W columns of each row are normalised
(MLA's kv_a output carries the rope key after its C latent columns). Rows are split into power-of-two pieces
(Triton blocks), so no width needs padding. Differentiable: the backward pass is the reference's.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from model.kernels.triton_ops import pow2_chunks
from model.norms import add_rms_norm

NUM_WARPS = 4


class NormJob(NamedTuple):
    x_XI: jax.Array
    addend_XI: jax.Array | None  # added to x first (in x's dtype); the sum is an output too
    weight_W: jax.Array  # W = the weight's length: the leading columns normalised


def _kernel(*refs, jobs, eps):
    """`jobs`: per norm job (has_addend, width, out_dtype); refs: the inputs job by job (x, [addend], weight), then
    the outputs job by job ([sum], normed)."""
    n_in = sum(2 + has_addend for has_addend, _, _ in jobs)
    ins, outs = iter(refs[:n_in]), iter(refs[n_in:])
    row = pl.program_id(0)
    for has_addend, width, out_dtype in jobs:
        x_ref = next(ins)
        add_ref = next(ins) if has_addend else None
        w_ref = next(ins)
        sum_ref = next(outs) if has_addend else None
        out_ref = next(outs)
        pieces = pow2_chunks(width)
        xs = [x_ref[row, pl.ds(off, size)] for off, size in pieces]  # every load issued before the first use
        if has_addend:
            xs = [x + add_ref[row, pl.ds(off, size)] for x, (off, size) in zip(xs, pieces)]
            for x, (off, size) in zip(xs, pieces):
                sum_ref[row, pl.ds(off, size)] = x
            for off, size in pow2_chunks(x_ref.shape[1] - width):  # columns past the norm's width
                off += width
                sum_ref[row, pl.ds(off, size)] = x_ref[row, pl.ds(off, size)] + add_ref[row, pl.ds(off, size)]
        squares = functools.reduce(jnp.add, [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in xs])
        scale = jax.lax.rsqrt(squares / width + eps)
        for x, (off, size) in zip(xs, pieces):
            normed = (x.astype(jnp.float32) * scale).astype(x.dtype)
            out_ref[row, pl.ds(off, size)] = (w_ref[pl.ds(off, size)] * normed).astype(out_dtype)


def _fused(jobs: tuple[NormJob, ...], eps: float, interpret: bool):
    rows = jobs[0].x_XI.shape[0]
    static, args, out_shape = [], [], []
    for j in jobs:
        width = j.weight_W.shape[0]
        if j.x_XI.shape[0] != rows or j.weight_W.ndim != 1 or not 0 < width <= j.x_XI.shape[1]:
            raise ValueError(f"fused_rms_norms: rows {j.x_XI.shape} with weight {j.weight_W.shape} do not fit "
                             f"the first job's {rows} rows")
        out_dtype = jnp.result_type(j.weight_W.dtype, j.x_XI.dtype)
        static.append((j.addend_XI is not None, width, out_dtype))
        args += [j.x_XI] + ([j.addend_XI.astype(j.x_XI.dtype)] if j.addend_XI is not None else []) + [j.weight_W]
        if j.addend_XI is not None:
            out_shape.append(jax.ShapeDtypeStruct(j.x_XI.shape, j.x_XI.dtype))
        out_shape.append(jax.ShapeDtypeStruct((rows, width), out_dtype))
    outs = iter(pl.pallas_call(
        functools.partial(_kernel, jobs=tuple(static), eps=float(eps)),
        out_shape=tuple(out_shape),
        grid=(rows,),
        compiler_params=pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="rms_norm_rows",
    )(*args))
    return tuple((next(outs) if j.addend_XI is not None else None, next(outs)) for j in jobs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def fused_rms_norms(jobs: tuple[NormJob, ...], eps: float, interpret: bool = False):
    """Per job (sum [X, I] or None, normed [X, W]), as `model.norms.add_rms_norm` computes them (None where the job
    has no addend)."""
    return _fused(jobs, eps, interpret)


def _reference(jobs, eps):
    return tuple(add_rms_norm(j.x_XI, j.addend_XI, j.weight_W, eps) for j in jobs)


def _fwd(jobs, eps, interpret):
    return _fused(jobs, eps, interpret), jobs


def _bwd(eps, interpret, jobs, cotangents):
    _, pullback = jax.vjp(lambda js: _reference(js, eps), jobs)
    return pullback(cotangents)


fused_rms_norms.defvjp(_fwd, _bwd)
