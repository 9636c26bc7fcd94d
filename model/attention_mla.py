"""Multi-head latent attention (MLA) over the latent cache.

`absorbed` is what runs: the k_nope half of kv_b_proj is folded into the query and the v half into the
output, so attention reads only the cached normalized latent [C] and roped key [R] per token.
`decompressed` expands K and V per head (HF's formulation) and exists as the test reference.
`absorbed_kernel` is `absorbed` with the attention after the query absorption in two Pallas kernels
(model/kernels/mla_decode.py); it runs on GPU for decode and verify.

A paged cache (model.kv_cache, a block table over page pools) is read by the kernels through its table. Every
other path reads each sequence's pages gathered into a contiguous cache first (`read_pages`): a copy of every
layer's whole capacity per step, which the kernels' path does not make.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from model.config import TextConfig
from model.kernels import target
from model.kernels.dispatch import mla_kernel_applies
from model.kernels.mla_decode import mla_decode_attention
from model.kv_cache import read_pages, visible_slots, write_pages, write_slots
from model.norms import rms_norm, sums_of_squares_of_parts
from model.quant import Weight, linear
from model.rope import apply_interleaved
from model.shard_local import axis_of, shard_map_unchecked, sharded_mesh

# HF DeepseekV3 builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps.
LORA_NORM_EPS = 1e-6


@struct.dataclass
class MLAWeights:
    q_a_proj: Weight | None  # [Q, H]; None without q-LoRA (q_lora_rank None, q_a_norm None) or inside qkv_a_proj
    q_a_norm: jax.Array | None  # [Q]; None exactly when the model has no q-LoRA
    q_b_proj: jax.Array  # [N, Dn+R, Q], or [N, Dn+R, H] as q_proj without q-LoRA
    kv_a_proj: Weight | None  # [C+R, H]; None inside qkv_a_proj
    kv_a_norm: jax.Array  # [C]
    # [N, C, Dn]: k_nope rows of kv_b_proj, transposed so the absorbed query contracts Dn along the minor axis
    # (stored [N, Dn, C], XLA would transpose it at every dispatch of a step)
    w_uk: jax.Array
    w_uv: jax.Array  # [N, Dv, C]  v rows of kv_b_proj
    o_proj: jax.Array  # [H, N, Dv]
    # [Q+C+R, H]: q_a_proj's rows over kv_a_proj's, the two input projections as one GEMM (`fuse_input_projections`,
    # done when weights are loaded to run; checkpoints store the two apart, as Hugging Face does). At one token
    # XLA runs the two as a split-K GEMM, its sum and a GEMV (three launches, each short of its bytes' time); one
    # weight is one GEMM.
    qkv_a_proj: Weight | None = None


def fuse_input_projections(w: MLAWeights) -> MLAWeights:
    """`w` with q_a_proj and kv_a_proj concatenated into qkv_a_proj, where both are dense arrays of one dtype (an
    FP8 q_a's block scales do not tile the concatenation) and the model has q-LoRA; otherwise `w` unchanged. The
    result keeps the inputs' sharding (both are replicated under model.sharding.TARGET_RULES)."""
    if w.qkv_a_proj is not None or w.q_a_proj is None:
        return w
    q_a, kv_a = w.q_a_proj, w.kv_a_proj
    if not (isinstance(q_a, (jax.Array, np.ndarray)) and isinstance(kv_a, (jax.Array, np.ndarray))) \
            or q_a.dtype != kv_a.dtype:
        return w
    both = np.concatenate([q_a, kv_a], axis=0) if isinstance(q_a, np.ndarray) else _stack_rows(q_a, kv_a)
    return w.replace(q_a_proj=None, kv_a_proj=None, qkv_a_proj=both)


# one program per shape for every layer and every engine; the output keeps the inputs' (replicated) placement
_stack_rows = jax.jit(lambda a, b: jnp.concatenate([a, b], axis=0))


def split_input_projections(w: MLAWeights) -> MLAWeights:
    """The inverse of `fuse_input_projections`: q_a_proj and kv_a_proj apart, as checkpoints store them."""
    if w.qkv_a_proj is None:
        return w
    q = w.q_a_norm.shape[0]
    return w.replace(q_a_proj=w.qkv_a_proj[:q], kv_a_proj=w.qkv_a_proj[q:], qkv_a_proj=None)


def input_projections(x_BTH, w: MLAWeights, cfg: TextConfig):
    """-> (q_a_proj's output [B, T, q_lora_rank], or None without q-LoRA; kv_a_proj's output [B, T, C+R]; the q_a
    and kv_a norms' sums of squares (q_a's, the latent's), or (None, None)), from the one fused weight where `w` has
    it. With it both norms read one GEMM's output, so one reduction serves them
    (`model.norms.sums_of_squares_of_parts`; on a GPU each reduction is a kernel of its own)."""
    if w.qkv_a_proj is not None:
        both_BTX = linear(x_BTH, w.qkv_a_proj)
        q = w.q_a_norm.shape[0]
        return both_BTX[..., :q], both_BTX[..., q:], sums_of_squares_of_parts(both_BTX, (q, cfg.kv_lora_rank))
    q_a_BTX = None if w.q_a_proj is None else linear(x_BTH, w.q_a_proj)
    return q_a_BTX, linear(x_BTH, w.kv_a_proj), (None, None)


def project_query(x_BTH, q_a_BTX, w: MLAWeights, cfg: TextConfig, cos, sin, norm_eps: float = LORA_NORM_EPS,
                  sum_squares=None):
    """-> q_nope [B, T, N, Dn], roped q_rope [B, T, N, R] from q_a_proj's output (`input_projections`; None
    without q-LoRA, where q_b_proj is q_proj over x). `norm_eps`: the q_a_layernorm's (EAGLE-3 MLA drafters build
    it with their rms_norm_eps); `sum_squares`: q_a's, where computed already (`input_projections`)."""
    q_in = x_BTH if q_a_BTX is None else rms_norm(q_a_BTX, w.q_a_norm, norm_eps, sum_squares)
    q_BTND = jnp.einsum("btq,nkq->btnk", q_in, w.q_b_proj.astype(x_BTH.dtype))
    q_nope, q_rope = q_BTND[..., : cfg.qk_nope_head_dim], q_BTND[..., cfg.qk_nope_head_dim :]
    return q_nope, apply_interleaved(q_rope, cos, sin)


def project_latent(kv_BTX, w: MLAWeights, cfg: TextConfig, cos, sin, norm_eps: float = LORA_NORM_EPS,
                   sum_squares=None):
    """kv_a_proj's output (`input_projections`) -> normalized latent [B, T, C], roped shared key [B, T, R]: what
    the cache stores. `sum_squares`: the latent's, where computed already (`input_projections`)."""
    latent_BTC = rms_norm(kv_BTX[..., : cfg.kv_lora_rank], w.kv_a_norm, norm_eps, sum_squares)
    k_rope_BTR = apply_interleaved(kv_BTX[..., cfg.kv_lora_rank :][:, :, None, :], cos, sin)[:, :, 0, :]
    return latent_BTC, k_rope_BTR


def _softmax_masked(scores_BNTS, positions_BT, scale):
    mask_B1TS = visible_slots(positions_BT, scores_BNTS.shape[-1])[:, None]
    scores = jnp.where(mask_B1TS, scores_BNTS * scale, -jnp.inf)
    return jax.nn.softmax(scores, axis=-1)


def attend_absorbed(q_nope, q_rope, latent_BSC, k_rope_BSR, positions_BT, w: MLAWeights, cfg: TextConfig):
    dt = q_nope.dtype
    q_lat_BTNC = jnp.einsum("btnd,ncd->btnc", q_nope, w.w_uk.astype(dt))
    scores_BNTS = jnp.einsum("btnc,bsc->bnts", q_lat_BTNC, latent_BSC, preferred_element_type=jnp.float32)
    scores_BNTS += jnp.einsum("btnr,bsr->bnts", q_rope, k_rope_BSR, preferred_element_type=jnp.float32)
    probs_BNTS = _softmax_masked(scores_BNTS, positions_BT, cfg.softmax_scale).astype(dt)
    ctx_BTNC = jnp.einsum("bnts,bsc->btnc", probs_BNTS, latent_BSC.astype(dt))
    return jnp.einsum("btnc,nvc->btnv", ctx_BTNC, w.w_uv.astype(dt))


def attend_decompressed(q_nope, q_rope, latent_BSC, k_rope_BSR, positions_BT, w: MLAWeights, cfg: TextConfig):
    dt = q_nope.dtype
    k_nope_BSND = jnp.einsum("bsc,ncd->bsnd", latent_BSC.astype(dt), w.w_uk.astype(dt))
    v_BSND = jnp.einsum("bsc,nvc->bsnv", latent_BSC.astype(dt), w.w_uv.astype(dt))
    n = k_nope_BSND.shape[2]
    k_rope_BSNR = jnp.broadcast_to(k_rope_BSR[:, :, None, :].astype(dt), (*k_rope_BSR.shape[:2], n, k_rope_BSR.shape[-1]))
    k_BSND = jnp.concatenate([k_nope_BSND, k_rope_BSNR], axis=-1)
    q_BTND = jnp.concatenate([q_nope, q_rope], axis=-1)
    scores_BNTS = jnp.einsum("btnk,bsnk->bnts", q_BTND, k_BSND, preferred_element_type=jnp.float32)
    probs_BNTS = _softmax_masked(scores_BNTS, positions_BT, cfg.softmax_scale).astype(dt)
    return jnp.einsum("bnts,bsnv->btnv", probs_BNTS, v_BSND)


def attend_absorbed_kernel(q_nope, q_rope, latent_BSC, k_rope_BSR, positions_BT, w: MLAWeights, cfg: TextConfig,
                           pages_BM=None):
    """`attend_absorbed` with the attention after the query absorption in two Pallas kernels (flash decoding over
    the visible slots, then the combine of its splits). With `pages_BM` the caches are page pools [N, P, C|R] that
    the kernels read through the block table."""
    dt = q_nope.dtype
    q_lat_BTNC = jnp.einsum("btnd,ncd->btnc", q_nope, w.w_uk.astype(dt))
    interpret = target.interpret()

    def attend(q_lat_BTNC, q_rope, latent_BSC, k_rope_BSR, positions_BT, w_uv, pages_BM):
        return mla_decode_attention(q_lat_BTNC, q_rope, latent_BSC, k_rope_BSR, positions_BT, w_uv,
                                    cfg.softmax_scale, interpret=interpret, pages_BM=pages_BM)

    mesh = sharded_mesh()
    if mesh is None:
        return attend(q_lat_BTNC, q_rope, latent_BSC, k_rope_BSR, positions_BT, w.w_uv, pages_BM)
    # each device attends with the heads it holds (q_b, w_uk, w_uv, o_proj are split by heads) over its batch
    # rows' caches; o_proj's sum over heads is the all-reduce the program runs anyway. A paged cache's pools and
    # table are whole on every device (`model.kernels.dispatch.mla_kernel_applies` takes them on meshes whose
    # "data" axis is 1 only).
    b_ax = axis_of("batch", q_nope.shape[0], mesh) if pages_BM is None else None
    n_ax = axis_of("heads", q_nope.shape[2], mesh)
    heads, cache = P(b_ax, None, n_ax, None), P(b_ax, None, None)
    specs = (heads, heads, cache, cache, P(b_ax, None), P(n_ax, None, None))
    if pages_BM is None:
        return shard_map_unchecked(lambda *a: attend(*a, None), mesh, specs, heads)(
            q_lat_BTNC, q_rope, latent_BSC, k_rope_BSR, positions_BT, w.w_uv)
    return shard_map_unchecked(attend, mesh, specs + (P(),), heads)(
        q_lat_BTNC, q_rope, latent_BSC, k_rope_BSR, positions_BT, w.w_uv, pages_BM)


ATTENTION_PATHS = {"absorbed": attend_absorbed, "decompressed": attend_decompressed,
                   "absorbed_kernel": attend_absorbed_kernel}


def mla(x_BTH, w: MLAWeights, cfg: TextConfig, cos, sin, positions_BT, latent_BSC, k_rope_BSR, path="absorbed",
        norm_eps: float = LORA_NORM_EPS, pages_BM=None):
    """One MLA layer: write the T new tokens into the cache, attend, project out. With `pages_BM` (a paged cache,
    model.kv_cache) the caches are page pools [N, P, C|R] and the tokens are written to their pages; where the
    absorbed path takes the decode kernels (`mla_kernel_applies`), they read the pages through the table, and
    elsewhere attention reads each sequence's pages gathered into its contiguous cache (`read_pages`).

    Returns (out [B, T, H], latent cache, rope-key cache)."""
    q_a_BTX, kv_BTX, (q_sum_squares, latent_sum_squares) = input_projections(x_BTH, w, cfg)
    q_nope, q_rope = project_query(x_BTH, q_a_BTX, w, cfg, cos, sin, norm_eps, q_sum_squares)
    latent_BTC, k_rope_BTR = project_latent(kv_BTX, w, cfg, cos, sin, norm_eps, latent_sum_squares)
    if pages_BM is not None:
        latent_pool_NPC = write_pages(latent_BSC, latent_BTC, positions_BT, pages_BM)
        k_rope_pool_NPR = write_pages(k_rope_BSR, k_rope_BTR, positions_BT, pages_BM)
        b, t = x_BTH.shape[:2]
        page_tokens = latent_pool_NPC.shape[1]
        if path == "absorbed" and mla_kernel_applies(cfg.kernels, b, t, pages_BM.shape[1] * page_tokens, cfg,
                                                     page_tokens=page_tokens):
            out_BTND = attend_absorbed_kernel(q_nope, q_rope, latent_pool_NPC, k_rope_pool_NPR, positions_BT, w, cfg,
                                              pages_BM=pages_BM)
            return project_out(out_BTND, w, x_BTH), latent_pool_NPC, k_rope_pool_NPR
        out_BTH, _, _ = mla_attend(q_nope, q_rope, read_pages(latent_pool_NPC, pages_BM),
                                   read_pages(k_rope_pool_NPR, pages_BM), positions_BT, w, cfg, path, x_BTH)
        return out_BTH, latent_pool_NPC, k_rope_pool_NPR
    latent_BSC = write_slots(latent_BSC, latent_BTC, positions_BT)
    k_rope_BSR = write_slots(k_rope_BSR, k_rope_BTR, positions_BT)
    return mla_attend(q_nope, q_rope, latent_BSC, k_rope_BSR, positions_BT, w, cfg, path, x_BTH)


def mla_attend(q_nope, q_rope, latent_BSC, k_rope_BSR, positions_BT, w: MLAWeights, cfg: TextConfig, path, x_BTH):
    """Attention over the written caches and the output projection: (out [B, T, H], latent, rope key)."""
    if path == "absorbed" and mla_kernel_applies(cfg.kernels, x_BTH.shape[0], x_BTH.shape[1], latent_BSC.shape[1], cfg):
        path = "absorbed_kernel"
    out_BTND = ATTENTION_PATHS[path](q_nope, q_rope, latent_BSC, k_rope_BSR, positions_BT, w, cfg)
    return project_out(out_BTND, w, x_BTH), latent_BSC, k_rope_BSR


def project_out(out_BTNV, w: MLAWeights, x_BTH):
    """The heads' attention outputs through o_proj -> [B, T, H] in the layer input's dtype."""
    return jnp.einsum("btnv,hnv->bth", out_BTNV, w.o_proj.astype(x_BTH.dtype))
