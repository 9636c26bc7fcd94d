"""Absorbed MLA attention over the latent cache for few query tokens: a Pallas (Triton) flash-decoding kernel.

Plain reference: the score / softmax / context part of `model.attention_mla.attend_absorbed` (tests hold this
to it in interpret mode on CPU). Why: XLA's version materialises the [B, N, T, S] scores in float32, reads
the cache twice and reads every slot of the cache's capacity, not only the visible ones; the H200 run
measured the extra 32k context at ~14x its bytes (bench/results/README.md).

Rows are (token, head) pairs: q_lat [B, T*N, C] and q_rope [B, T*N, R] against the cache's latent [B, S, C]
and roped key [B, S, R]. Grid (batch, block of rows, split of the cache): each program runs an online
softmax over its share of the cache in blocks of `block_s` slots, stops at the last slot its rows may see,
and writes an unnormalised partial context with its running max and sum; XLA combines the splits
(`combine_splits`). The latent block is the key (scores) and the value (context) at once, so each cache
byte is read once per block of rows.

Measured on the H200 (`python -m bench.attention_lab`, bench/results/attention-lab-gpu-20261129-1259.json): it
agrees with XLA but is slower in 7 of 8 shapes, so the engine keeps XLA's path unless `JAXSPEC_MLA_KERNEL=1`
(model/attention_mla.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from model.kernels.index_math import even_splits

_NEG = -1e30  # finite "minus infinity": a fully masked block must not produce inf - inf


@dataclasses.dataclass(frozen=True)
class MLAKernelConfig:
    block_q: int = 64  # rows ((token, head) pairs) per program; >= 16 for Triton's dot
    block_s: int = 32  # cache slots per loop step
    splits: int = 32  # programs along the cache per (batch, block of rows)
    num_warps: int = 8
    num_stages: int = 2


def _kernel(maxpos_ref, pos_ref, q_ref, qr_ref, lat_ref, kr_ref, o_ref, m_ref, l_ref, *, block_q, block_s,
            blocks_per_split, scale):
    b, qb, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(qb * block_q, block_q)
    q = q_ref[b, rows, :]  # [bq, C]
    qr = qr_ref[b, rows, :]  # [bq, R]
    pos = pos_ref[b, rows]  # [bq]
    first = sp * blocks_per_split
    # the last block any row of this program may see; blocks past it are never read
    last = jnp.minimum(first + blocks_per_split, maxpos_ref[b, qb] // block_s + 1)

    def step(i, carry):
        acc, m, l = carry
        s0 = i * block_s
        lat = lat_ref[b, pl.ds(s0, block_s), :]  # [bs, C]: the keys and the values
        kr = kr_ref[b, pl.ds(s0, block_s), :]  # [bs, R]
        s = jnp.dot(q, lat.T, preferred_element_type=jnp.float32)
        s += jnp.dot(qr, kr.T, preferred_element_type=jnp.float32)
        visible = (s0 + jnp.arange(block_s, dtype=jnp.int32))[None, :] <= pos[:, None]
        s = jnp.where(visible, s * scale, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(lat.dtype), lat, preferred_element_type=jnp.float32)
        return acc, m_new, l * alpha + jnp.sum(p, axis=1)

    c = q_ref.shape[-1]
    init = (jnp.zeros((block_q, c), jnp.float32), jnp.full((block_q,), _NEG, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(first, jnp.maximum(last, first), step, init)
    o_ref[b, sp, rows, :] = acc
    m_ref[b, sp, rows] = m
    l_ref[b, sp, rows] = l


def combine_splits(o_BXRC, m_BXR, l_BXR) -> jax.Array:
    """Partial contexts of the cache splits -> the normalised context [B, R, C] (float32)."""
    m_BR = jnp.max(m_BXR, axis=1)
    w_BXR = jnp.exp(m_BXR - m_BR[:, None])
    return jnp.einsum("bxr,bxrc->brc", w_BXR, o_BXRC) / jnp.sum(w_BXR * l_BXR, axis=1)[..., None]


def mla_decode_context(q_lat_BTNC, q_rope_BTNR, latent_BSC, k_rope_BSR, positions_BT, scale: float, *,
                       cfg: MLAKernelConfig = MLAKernelConfig(), interpret: bool = False) -> jax.Array:
    """softmax(q_lat . latent + q_rope . k_rope) . latent over the visible slots -> [B, T, N, C] in q's dtype."""
    if not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python number (it is baked into the kernel), got {type(scale).__name__}")
    b, t, n, c = q_lat_BTNC.shape
    s, r = latent_BSC.shape[1], k_rope_BSR.shape[-1]
    if s % cfg.block_s:
        raise ValueError(f"cache capacity {s} is not a multiple of block_s {cfg.block_s}")
    rows = t * n
    rows_p = -(-rows // cfg.block_q) * cfg.block_q
    pad = ((0, 0), (0, rows_p - rows), (0, 0))
    q_BRC = jnp.pad(q_lat_BTNC.reshape(b, rows, c), pad)
    qr_BRR = jnp.pad(q_rope_BTNR.reshape(b, rows, r).astype(q_lat_BTNC.dtype), pad)
    # row t * N + n is token t; padding rows see slot 0 only and are dropped below
    pos_BR = jnp.pad(jnp.repeat(positions_BT.astype(jnp.int32), n, axis=1), ((0, 0), (0, rows_p - rows)))
    maxpos_BQ = jnp.max(pos_BR.reshape(b, rows_p // cfg.block_q, cfg.block_q), axis=-1)
    n_blocks = s // cfg.block_s
    splits, blocks_per_split = even_splits(n_blocks, cfg.splits)
    kernel = functools.partial(_kernel, block_q=cfg.block_q, block_s=cfg.block_s, blocks_per_split=blocks_per_split,
                               scale=scale)
    o, m, l = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b, splits, rows_p, c), jnp.float32),
                   jax.ShapeDtypeStruct((b, splits, rows_p), jnp.float32),
                   jax.ShapeDtypeStruct((b, splits, rows_p), jnp.float32)),
        grid=(b, rows_p // cfg.block_q, splits),
        compiler_params=pl_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="mla_decode",
    )(maxpos_BQ, pos_BR, q_BRC, qr_BRR, latent_BSC.astype(q_lat_BTNC.dtype), k_rope_BSR.astype(q_lat_BTNC.dtype))
    ctx_BRC = combine_splits(o, m, l)[:, :rows]
    return ctx_BRC.reshape(b, t, n, c).astype(q_lat_BTNC.dtype)
