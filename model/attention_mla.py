"""Multi-head latent attention (MLA) over the latent cache.

`absorbed` is what runs: the k_nope half of kv_b_proj is folded into the query and the v half into the
output, so attention reads only the cached normalized latent [C] and roped key [R] per token.
`decompressed` expands K and V per head (HF's formulation) and exists as the test reference.
`absorbed_kernel` is `absorbed` with the attention after the query absorption in two Pallas kernels
(model/kernels/mla_decode.py); it runs on GPU for decode and verify.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import struct

from model.config import TextConfig
from model.kv_cache import LONG_CAPACITY, visible_slots, write_slots
from model.norms import rms_norm
from model.quant import Weight, linear
from model.rope import apply_interleaved
from model.sharding import single_device_program

# HF DeepseekV3 builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps.
LORA_NORM_EPS = 1e-6


@struct.dataclass
class MLAWeights:
    q_a_proj: Weight | None  # [Q, H] (None when q_lora_rank is None)
    q_a_norm: jax.Array | None  # [Q]
    q_b_proj: jax.Array  # [N, Dn+R, Q], or [N, Dn+R, H] as q_proj without q-LoRA
    kv_a_proj: Weight  # [C+R, H]
    kv_a_norm: jax.Array  # [C]
    # [N, C, Dn]: k_nope rows of kv_b_proj, transposed so the absorbed query contracts Dn along the minor axis
    # (stored [N, Dn, C], XLA transposed it at every dispatch of a step: bench/results/README.md, run 15)
    w_uk: jax.Array
    w_uv: jax.Array  # [N, Dv, C]  v rows of kv_b_proj
    o_proj: jax.Array  # [H, N, Dv]


def project_query(x_BTH, w: MLAWeights, cfg: TextConfig, cos, sin, norm_eps: float = LORA_NORM_EPS):
    """-> q_nope [B, T, N, Dn], roped q_rope [B, T, N, R]. `norm_eps`: the q_a_layernorm's (EAGLE-3 MLA drafters
    build it with their rms_norm_eps)."""
    q_in = x_BTH if w.q_a_proj is None else rms_norm(linear(x_BTH, w.q_a_proj), w.q_a_norm, norm_eps)
    q_BTNK = jnp.einsum("btq,nkq->btnk", q_in, w.q_b_proj.astype(x_BTH.dtype))
    q_nope, q_rope = q_BTNK[..., : cfg.qk_nope_head_dim], q_BTNK[..., cfg.qk_nope_head_dim :]
    return q_nope, apply_interleaved(q_rope, cos, sin)


def project_latent(x_BTH, w: MLAWeights, cfg: TextConfig, cos, sin, norm_eps: float = LORA_NORM_EPS):
    """-> normalized latent [B, T, C], roped shared key [B, T, R]: what the cache stores."""
    kv_BTX = linear(x_BTH, w.kv_a_proj)
    latent_BTC = rms_norm(kv_BTX[..., : cfg.kv_lora_rank], w.kv_a_norm, norm_eps)
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
    v_BSNV = jnp.einsum("bsc,nvc->bsnv", latent_BSC.astype(dt), w.w_uv.astype(dt))
    n = k_nope_BSND.shape[2]
    k_rope_BSNR = jnp.broadcast_to(k_rope_BSR[:, :, None, :].astype(dt), (*k_rope_BSR.shape[:2], n, k_rope_BSR.shape[-1]))
    k_BSNK = jnp.concatenate([k_nope_BSND, k_rope_BSNR], axis=-1)
    q_BTNK = jnp.concatenate([q_nope, q_rope], axis=-1)
    scores_BNTS = jnp.einsum("btnk,bsnk->bnts", q_BTNK, k_BSNK, preferred_element_type=jnp.float32)
    probs_BNTS = _softmax_masked(scores_BNTS, positions_BT, cfg.softmax_scale).astype(dt)
    return jnp.einsum("bnts,bsnv->btnv", probs_BNTS, v_BSNV)


def attend_absorbed_kernel(q_nope, q_rope, latent_BSC, k_rope_BSR, positions_BT, w: MLAWeights, cfg: TextConfig):
    """`attend_absorbed` with the attention after the query absorption in two Pallas kernels (flash decoding over
    the visible slots, then the combine of its splits)."""
    from model.kernels.mla_decode import mla_decode_attention

    dt = q_nope.dtype
    q_lat_BTNC = jnp.einsum("btnd,ncd->btnc", q_nope, w.w_uk.astype(dt))
    return mla_decode_attention(q_lat_BTNC, q_rope, latent_BSC, k_rope_BSR, positions_BT, w.w_uv,
                                cfg.softmax_scale, interpret=jax.default_backend() != "gpu")


ATTENTION_PATHS = {"absorbed": attend_absorbed, "decompressed": attend_decompressed,
                   "absorbed_kernel": attend_absorbed_kernel}
# On one GPU, decode / verify steps with batch x tokens <= 8 over caches of up to 4096 slots run the kernels, and
# decode at batch 8 over longer caches (below); JAXSPEC_MLA_KERNEL=0 turns them off, =1 forces them for any batch
# and capacity at T <= 16. The plain XLA path runs everywhere else (CPU, sharded programs, prefill, long caches,
# large batches) and is what tests hold the kernels to. Measured on the H200 (bench/results/README.md): at 1k the
# kernels save 65 us per 4-layer step at T=1 and 13 at T=4 (run 8); the attention alone (run 9 lab, us per layer,
# kernel vs XLA, tiles of model.kernels.mla_decode.config_for) at 1k: B=1 T=1 23 vs 32, B=1 T=4 28 vs 39, B=8 T=1
# 46 vs 73, but B=8 T=4 101-124 vs 77; at 4k B=8 T=4 172-185 vs 167; at 32k B=1 T=1 74-118 vs 72.
MLA_KERNEL_MAX_QUERY_TOKENS = 8  # batch x tokens: 1, 4 and 8 measured faster than XLA, 32 slower
MLA_KERNEL_MAX_TOKENS = 16  # the ceiling even when forced: prefill never takes the kernels
# Beyond 4096 slots (model.kv_cache.LONG_CAPACITY), decode (T = 1) at batch 8 (mla_decode.LONG_CACHE_MIN_BATCH)
# still takes them, with 32-row blocks (config_for): the attention lab at B=8, 32k measured 219.6 us a layer
# against XLA's 330.2 (attention-lab-gpu-20261129-1743); at B=1 and at T > 1 XLA's path measured as fast or faster.


def _use_kernel(path: str, batch: int, tokens: int, capacity: int, cfg: TextConfig, backend: str | None = None) -> bool:
    setting = os.environ.get("JAXSPEC_MLA_KERNEL", "auto")
    if path != "absorbed" or setting == "0" or (backend or jax.default_backend()) != "gpu":
        return False
    if not single_device_program() or tokens > MLA_KERNEL_MAX_TOKENS:
        return False
    from model.kernels.mla_decode import LONG_CACHE_MIN_BATCH, check_config, config_for

    long_cache_decode = tokens == 1 and batch >= LONG_CACHE_MIN_BATCH
    if setting != "1" and (batch * tokens > MLA_KERNEL_MAX_QUERY_TOKENS
                           or (capacity > LONG_CAPACITY and not long_cache_decode)):
        return False
    try:
        check_config(config_for(capacity, cfg.kv_lora_rank, tokens * cfg.num_attention_heads, batch), capacity,
                     cfg.kv_lora_rank)
    except ValueError:
        return False
    return True


def mla(x_BTH, w: MLAWeights, cfg: TextConfig, cos, sin, positions_BT, latent_BSC, k_rope_BSR, path="absorbed",
        norm_eps: float = LORA_NORM_EPS):
    """One MLA layer: write the T new tokens into the cache, attend, project out.

    Returns (out [B, T, H], latent cache, rope-key cache)."""
    q_nope, q_rope = project_query(x_BTH, w, cfg, cos, sin, norm_eps)
    latent_BTC, k_rope_BTR = project_latent(x_BTH, w, cfg, cos, sin, norm_eps)
    latent_BSC = write_slots(latent_BSC, latent_BTC, positions_BT)
    k_rope_BSR = write_slots(k_rope_BSR, k_rope_BTR, positions_BT)
    if _use_kernel(path, x_BTH.shape[0], x_BTH.shape[1], latent_BSC.shape[1], cfg):
        path = "absorbed_kernel"
    out_BTNV = ATTENTION_PATHS[path](q_nope, q_rope, latent_BSC, k_rope_BSR, positions_BT, w, cfg)
    return jnp.einsum("btnv,hnv->bth", out_BTNV, w.o_proj.astype(x_BTH.dtype)), latent_BSC, k_rope_BSR
