"""Absorbed MLA attention over the latent cache for few query tokens: two Pallas (Triton) kernels.

Plain reference: the part of `model.attention_mla.attend_absorbed` after the query absorption (scores, softmax,
context, the w_uv projection); tests hold the kernels to it in interpret mode on CPU.

Why: XLA runs that part as ~12 kernels per layer (two score GEMMs, mask, max, exp, sum, pads, the context GEMM,
its reduction, the w_uv GEMM), each a launch of 1-5 us for a sub-microsecond floor at 1k context, and it reads
every slot of the cache's capacity, not only the visible ones.

1. `mla_partial` (flash decoding): rows are (token, head) pairs, row t * N + n, of q_lat [B, T*N, C] and
   q_rope [B, T*N, R] against the cache's latent [B, S, C] and roped key [B, S, R]. Grid (batch, block of rows,
   split): the visible slots of a block of rows (up to its largest position) are shared evenly by the splits, so
   a short sequence in a large cache reads only its own slots and all splits stay busy. Each program runs an
   online softmax over its blocks of `block_s` slots and writes an unnormalised partial context with its
   running max and sum. The latent block is the key (scores) and the value (context) at once, so each cache
   byte is read once per block of rows.
2. `mla_combine`: grid (batch, block of rows, block of C): combines the splits and normalises, one launch
   instead of XLA's several; XLA's GEMM then projects the context out through w_uv [N, V, C].

A paged cache (model.kv_cache: per layer a pool of pages [N, P, C|R] and a block table [B, M]) is read in place:
kernel 1 finds each block of `block_s` slots in the pool page its sequence's table names (`block_s` divides P, so
a block never straddles two pages). Gathering the pages into a contiguous cache first would copy every layer's
whole capacity each step, far more than the visible slots the kernel reads.

Kernel 1 reads each cache block once per block of rows and walks its share block by block, which pays at short
caches and few query rows but not over long caches or many rows, where XLA's batched GEMMs win: the dispatch
(model/kernels/dispatch.py, `mla_kernel_applies`) bounds where the kernels run (docs/performance.md has the
measurements). Tiles by shape: `config_for`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from model.kernels.triton_ops import div, rem
from model.kv_cache import LONG_CAPACITY

_NEG = -1e30  # finite "minus infinity": a fully masked block must not produce inf - inf


@dataclasses.dataclass(frozen=True)
class MLAKernelConfig:
    block_q: int = 16  # rows ((token, head) pairs) per program; >= 16 for Triton's dot
    block_s: int = 64  # cache slots per loop step; the cache's capacity must be a multiple
    splits: int = 16  # programs sharing one block of rows' visible slots (a power of two)
    num_warps: int = 4
    num_stages: int = 2
    combine_rows: int = 4  # rows per combine program
    block_c: int = 128  # latent features per combine program
    combine_warps: int = 4


def check_config(cfg: MLAKernelConfig, capacity: int, latent_dim: int) -> None:
    if cfg.splits & (cfg.splits - 1) or cfg.splits < 1:
        raise ValueError(f"MLAKernelConfig.splits must be a power of two, not {cfg.splits}")
    if capacity % cfg.block_s:
        raise ValueError(f"cache capacity {capacity} is not a multiple of block_s {cfg.block_s}")
    if latent_dim % cfg.block_c or cfg.block_q % cfg.combine_rows:
        raise ValueError(f"latent dim {latent_dim} is not a multiple of block_c {cfg.block_c}, or block_q "
                         f"{cfg.block_q} of combine_rows {cfg.combine_rows}")


def _pow2_divisor(n: int, cap: int) -> int:
    d = cap
    while d > 1 and n % d:
        d //= 2
    return d


LONG_CACHE_MIN_BATCH = 8  # beyond LONG_CAPACITY slots, decode takes the kernels (32-row blocks) from this batch on


def config_for(capacity: int, latent_dim: int, rows: int = 1, batch: int = 1) -> MLAKernelConfig:
    """The tiles for `rows` = tokens x heads query rows per sequence over a cache of `capacity` slots at `batch`
    sequences, shrunk to powers of two that divide these shapes (small test models).

    Decode (rows <= 64, K2.5's 64 heads at one token) keeps the defaults, but for long caches at batch >= 8
    takes 32-row blocks, which read the cache half as often. Verify steps (more than 64 rows) take 8 splits over
    short caches and 32-row blocks over longer ones: the fastest tiles measured for each (docs/performance.md)."""
    base = MLAKernelConfig()
    if rows <= 64 and batch >= LONG_CACHE_MIN_BATCH and capacity > LONG_CAPACITY:
        base = dataclasses.replace(base, block_q=32)
    if rows > 64:
        base = dataclasses.replace(base, splits=8) if capacity <= 2048 else dataclasses.replace(base, block_q=32)
    return dataclasses.replace(base, block_s=max(16, _pow2_divisor(capacity, base.block_s)),
                               block_c=_pow2_divisor(latent_dim, base.block_c))


def _partial_kernel(*refs, heads, tokens, block_q, block_s, splits, scale, page_tokens, query_rows):
    """One program of `mla_partial`. `page_tokens` None: the cache refs are [B, S, C|R]; otherwise they are page pools
    [N, P, C|R] and a block table [B, M] comes after the positions (a static choice: the contiguous cache's program
    holds nothing of the paged one). `query_rows`: the rows the query refs hold where fewer than the blocks cover
    (None: whole blocks); the rows past them load as zeros, as padding rows would."""
    if page_tokens is None:
        pos_ref, q_ref, qr_ref, lat_ref, kr_ref, o_ref, m_ref, l_ref = refs
    else:
        pos_ref, pages_ref, q_ref, qr_ref, lat_ref, kr_ref, o_ref, m_ref, l_ref = refs
    b, qb, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row0 = qb * block_q
    rows = pl.ds(row0, block_q)
    token_Q = jnp.minimum(div(row0 + jnp.arange(block_q, dtype=jnp.int32), heads), tokens - 1)  # padding rows
    pos_Q = pos_ref[b, token_Q]
    if query_rows is None:
        q_QC = q_ref[b, rows, :]
        qr_QR = qr_ref[b, rows, :]
    else:  # a block wider than the query: Triton's dot takes 16 rows at least, more than a device's 8 heads
        real_Q1 = (row0 + jnp.arange(block_q, dtype=jnp.int32) < query_rows)[:, None]
        q_QC = pl_triton.load(q_ref.at[b, rows, :], mask=real_Q1, other=0.0)
        qr_QR = pl_triton.load(qr_ref.at[b, rows, :], mask=real_Q1, other=0.0)
    # the visible blocks of these rows, shared evenly by the splits
    blocks = div(jnp.max(pos_Q), block_s) + 1
    per_split = div(blocks + (splits - 1), splits)
    first = sp * per_split
    last = jnp.maximum(jnp.minimum(first + per_split, blocks), first)

    def step(i, carry):
        acc_QC, m_Q, l_Q = carry
        s0 = i * block_s
        if page_tokens is None:
            lat_SC = lat_ref[b, pl.ds(s0, block_s), :]  # the keys and the values
            kr_SR = kr_ref[b, pl.ds(s0, block_s), :]
        else:  # block_s divides the page: the block lies in one page
            # A table entry N (no page held) and a position past the table would load out of bounds: both are
            # clamped, to the table's last column and the pool's last page, whose values are finite. A live
            # sequence holds the pages of every position it can see, so it never reaches such a block; an idle
            # slot (its table row cleared) does, and its output is discarded.
            column = jnp.minimum(div(s0, page_tokens), pages_ref.shape[1] - 1)
            page = jnp.minimum(pages_ref[b, column], lat_ref.shape[0] - 1)
            in_page = pl.ds(rem(s0, page_tokens), block_s)
            lat_SC = lat_ref[page, in_page, :]  # the keys and the values
            kr_SR = kr_ref[page, in_page, :]
        s_QS = jnp.dot(q_QC, lat_SC.T, preferred_element_type=jnp.float32)
        s_QS += jnp.dot(qr_QR, kr_SR.T, preferred_element_type=jnp.float32)
        visible_QS = (s0 + jnp.arange(block_s, dtype=jnp.int32))[None, :] <= pos_Q[:, None]
        s_QS = jnp.where(visible_QS, s_QS * scale, _NEG)
        m_new = jnp.maximum(m_Q, jnp.max(s_QS, axis=1))
        p_QS = jnp.where(visible_QS, jnp.exp(s_QS - m_new[:, None]), 0.0)
        alpha_Q = jnp.exp(m_Q - m_new)
        acc_QC = acc_QC * alpha_Q[:, None] + jnp.dot(p_QS.astype(lat_SC.dtype), lat_SC,
                                                     preferred_element_type=jnp.float32)
        return acc_QC, m_new, l_Q * alpha_Q + jnp.sum(p_QS, axis=1)

    init = (jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32), jnp.full((block_q,), _NEG, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    acc_QC, m_Q, l_Q = jax.lax.fori_loop(first, last, step, init)
    o_ref[b, sp, rows, :] = acc_QC
    m_ref[b, sp, rows] = m_Q
    l_ref[b, sp, rows] = l_Q


def check_pages(cfg: MLAKernelConfig, page_tokens: int) -> None:
    """A paged cache's blocks of `block_s` slots must each lie in one page."""
    if page_tokens % cfg.block_s:
        raise ValueError(f"block_s {cfg.block_s} does not divide the cache's pages of {page_tokens} positions")


def mla_partial(q_lat_BTNC, q_rope_BTNR, latent_BSC, k_rope_BSR, positions_BT, scale: float, *,
                cfg: MLAKernelConfig, interpret: bool = False, pages_BM=None):
    """Kernel 1 -> unnormalised partial contexts o [B, X, R, C] (float32), running max m and sum l [B, X, R] per
    split X and row R = t * N + n (rows padded to a multiple of block_q).

    With `pages_BM` (a paged cache, model.kv_cache: [B, M] block table) `latent_BSC` / `k_rope_BSR` are the page
    pools [N, P, C] / [N, P, R] and each block of slots is read from its sequence's page where it lies: no
    contiguous copy of the cache is made."""
    if not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python number (it is baked into the kernel), got {type(scale).__name__}")
    page_tokens = None if pages_BM is None else latent_BSC.shape[1]
    if page_tokens is not None:
        check_pages(cfg, page_tokens)
    b, t, n, c = q_lat_BTNC.shape
    r = k_rope_BSR.shape[-1]
    rows = t * n
    rows_p = -(-rows // cfg.block_q) * cfg.block_q
    dt = q_lat_BTNC.dtype
    q_BQC = q_lat_BTNC.reshape(b, rows, c)
    qr_BQR = q_rope_BTNR.reshape(b, rows, r).astype(dt)
    # rows short of a whole block (a device's 8 heads at one token, small test models): on a GPU the kernel loads
    # the block with the missing rows masked to zero, which spares two pad kernels a layer; the interpreter cannot
    # slice past an array's end, so there the query is padded
    query_rows = None if rows_p == rows else rows
    if query_rows is not None and interpret:
        pad = ((0, 0), (0, rows_p - rows), (0, 0))
        q_BQC, qr_BQR = jnp.pad(q_BQC, pad), jnp.pad(qr_BQR, pad)
    kernel = functools.partial(_partial_kernel, heads=n, tokens=t, block_q=cfg.block_q, block_s=cfg.block_s,
                               splits=cfg.splits, scale=scale, page_tokens=page_tokens, query_rows=query_rows)
    table = () if pages_BM is None else (pages_BM.astype(jnp.int32),)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b, cfg.splits, rows_p, c), jnp.float32),
                   jax.ShapeDtypeStruct((b, cfg.splits, rows_p), jnp.float32),
                   jax.ShapeDtypeStruct((b, cfg.splits, rows_p), jnp.float32)),
        grid=(b, rows_p // cfg.block_q, cfg.splits),
        compiler_params=pl_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="mla_partial",
    )(positions_BT.astype(jnp.int32), *table, q_BQC, qr_BQR, latent_BSC.astype(dt), k_rope_BSR.astype(dt))


def _combine_kernel(o_ref, m_ref, l_ref, ctx_ref, *, block_r, block_c, splits):
    b = pl.program_id(0)
    rows = pl.ds(pl.program_id(1) * block_r, block_r)
    cols = pl.ds(pl.program_id(2) * block_c, block_c)
    m_Q = jnp.max(m_ref[b, :, rows], axis=0)
    acc_QC = jnp.zeros((block_r, block_c), jnp.float32)
    l_Q = jnp.zeros((block_r,), jnp.float32)
    for x in range(splits):
        w_Q = jnp.exp(m_ref[b, x, rows] - m_Q)  # an empty split has m = -1e30: weight 0
        acc_QC += w_Q[:, None] * o_ref[b, x, rows, cols]
        l_Q += w_Q * l_ref[b, x, rows]
    ctx_ref[b, rows, cols] = (acc_QC / l_Q[:, None]).astype(ctx_ref.dtype)


def mla_combine(o_BZQC, m_BZQ, l_BZQ, dtype, *, cfg: MLAKernelConfig, interpret: bool = False) -> jax.Array:
    """Kernel 2: combine the splits and normalise -> the context [B, R, C] in `dtype`.

    Grid (batch, block of rows, block of C): each partial is read once. Projecting through w_uv inside this kernel
    (a program per row) reads w_uv once per token; XLA's GEMM after it reads w_uv once."""
    b, x, r, c = o_BZQC.shape
    kernel = functools.partial(_combine_kernel, block_r=cfg.combine_rows, block_c=cfg.block_c, splits=x)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, r, c), dtype),
        grid=(b, r // cfg.combine_rows, c // cfg.block_c),
        compiler_params=pl_triton.CompilerParams(num_warps=cfg.combine_warps, num_stages=1),
        interpret=interpret,
        name="mla_combine",
    )(o_BZQC, m_BZQ, l_BZQ)


def combine_splits(o_BZQC, m_BZQ, l_BZQ) -> jax.Array:
    """Plain XLA combine of kernel 1's splits -> the normalised context [B, R, C] (float32); reference for kernel 2."""
    m_BQ = jnp.max(m_BZQ, axis=1)
    w_BZQ = jnp.exp(m_BZQ - m_BQ[:, None])
    return jnp.einsum("bxr,bxrc->brc", w_BZQ, o_BZQC) / jnp.sum(w_BZQ * l_BZQ, axis=1)[..., None]


def mla_decode_attention(q_lat_BTNC, q_rope_BTNR, latent_BSC, k_rope_BSR, positions_BT, w_uv_NDC, scale: float, *,
                         cfg: MLAKernelConfig | None = None, interpret: bool = False, pages_BM=None) -> jax.Array:
    """softmax(q_lat . latent + q_rope . k_rope) . latent . w_uv^T over the visible slots -> [B, T, N, V].

    With `pages_BM` [B, M] the caches are page pools [N, P, C] / [N, P, R] (model.kv_cache) of capacity M * P per
    sequence, read through the table (`mla_partial`); `cfg.block_s` must divide P."""
    b, t, n, c = q_lat_BTNC.shape
    capacity = latent_BSC.shape[1] if pages_BM is None else pages_BM.shape[1] * latent_BSC.shape[1]
    cfg = cfg or config_for(capacity, c, t * n, b)
    check_config(cfg, capacity, c)
    dt = q_lat_BTNC.dtype
    o, m, l = mla_partial(q_lat_BTNC, q_rope_BTNR, latent_BSC, k_rope_BSR, positions_BT, scale, cfg=cfg,
                          interpret=interpret, pages_BM=pages_BM)
    ctx_BTNC = mla_combine(o, m, l, dt, cfg=cfg, interpret=interpret)[:, : t * n].reshape(b, t, n, c)
    return jnp.einsum("btnc,nvc->btnv", ctx_BTNC, w_uv_NDC.astype(dt))
