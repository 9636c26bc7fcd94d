"""A few tokens' MLA cache writes with their norm and rope: a Pallas (Triton) kernel updating the caches in place.

Plain reference: `latent_write_reference` (model.attention_mla.project_latent's norm of the latent and rope of the
shared key, then model.kv_cache.write_slots), which runs everywhere the kernel does not. Why: at one token XLA runs
the latent's sum of squares as a reduction and each cache's update as a kernel of its own (the norm's scale and the
rope fused into them), three launches a layer for 576 values; here, per token, one program normalises the latent
and writes it, another ropes the key and writes it, and the caches are the kernel's outputs, aliased to its
inputs, so only the written slots are touched.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from model.kernels.triton_ops import div, rounded
from model.kv_cache import write_slots
from model.norms import rms_norm
from model.rope import apply_interleaved


MAX_ROWS = 8  # tokens written in one launch (batch x tokens): decode at batch 1 to 8, verify at batch 1


def _kernel(pos_ref, kv_ref, norm_ref, cos_ref, sin_ref, _lat_in, _kr_in, lat_ref, kr_ref, *, tokens, width, offset,
            latent_dim, rope_dim, capacity, eps, interpret):
    row, part = pl.program_id(0), pl.program_id(1)  # row b * T + t: sequence b's token t
    position = pos_ref[row]
    # one token of one sequence: past the capacity it lands on the last slot, as write_slots' update does; several:
    # a slot past the capacity is dropped, as its scatter does
    slot = jnp.minimum(position, capacity - 1)
    keep = (position < capacity) | (pos_ref.shape[0] == 1)
    cache_row = div(row, tokens) * capacity + slot  # the caches flattened to [B * S, C | R]
    x0 = row * width + offset  # kv flattened to [B * T * W]
    dt = lat_ref.dtype

    # refs without a batch axis: the interpreter cannot mix an integer index with strided slices
    @pl.when(keep & (part == 0))
    def _():
        x = kv_ref[pl.ds(x0, latent_dim)].astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.sum(x * x) / latent_dim + eps)
        normed = rounded(rounded(x * inv_rms, dt, interpret) * norm_ref[...].astype(jnp.float32), dt, interpret)
        lat_ref[pl.ds(cache_row, 1), :] = normed.astype(dt)[None, :]

    @pl.when(keep & (part == 1))
    def _():
        half = rope_dim // 2
        even = kv_ref[pl.ds(x0 + latent_dim, half, stride=2)].astype(jnp.float32)
        odd = kv_ref[pl.ds(x0 + latent_dim + 1, half, stride=2)].astype(jnp.float32)
        cos, sin = cos_ref[pl.ds(row * half, half)], sin_ref[pl.ds(row * half, half)]
        kr_ref[pl.ds(cache_row, 1), pl.ds(0, half, stride=2)] = (even * cos - odd * sin).astype(dt)[None, :]
        kr_ref[pl.ds(cache_row, 1), pl.ds(1, half, stride=2)] = (odd * cos + even * sin).astype(dt)[None, :]


def latent_write(kv_BTX, norm_C, cos_BTF, sin_BTF, latent_BSC, k_rope_BSR, positions_BT, eps: float, *,
                 offset: int = 0, interpret: bool = False):
    """B x T tokens (up to MAX_ROWS): (latent cache with rms_norm(kv[offset : offset + C], norm) at each token's
    slot, rope-key cache with kv[offset + C : offset + C + R] roped there (interleaved pairs, angles cos / sin
    [B, T, R / 2])). kv [B, T, W]: the kv_a projection's output, or a wider one holding it from column `offset`
    (read in place). Slots as model.kv_cache.write_slots takes them."""
    b, capacity, latent_dim = latent_BSC.shape
    rope_dim = k_rope_BSR.shape[-1]
    t = positions_BT.shape[1]
    width = kv_BTX.shape[-1]
    if positions_BT.shape[0] != b or kv_BTX.shape[:2] != (b, t) or not 1 <= b * t <= MAX_ROWS:
        raise ValueError(f"latent_write takes 1 to {MAX_ROWS} tokens of the caches' {b} sequences, got positions "
                         f"{positions_BT.shape} and kv {kv_BTX.shape}")
    if width < offset + latent_dim + rope_dim or rope_dim % 2 or cos_BTF.shape != (b, t, rope_dim // 2):
        raise ValueError(f"latent_write: kv {kv_BTX.shape} from column {offset}, caches {latent_BSC.shape} / "
                         f"{k_rope_BSR.shape} and rope angles {cos_BTF.shape} disagree")
    if not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a Python number (it is baked into the kernel), got {type(eps).__name__}")
    kernel = functools.partial(_kernel, tokens=t, width=width, offset=offset, latent_dim=latent_dim,
                               rope_dim=rope_dim, capacity=capacity, eps=eps, interpret=interpret)
    latent_NC, k_rope_NR = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b * capacity, latent_dim), latent_BSC.dtype),
                   jax.ShapeDtypeStruct((b * capacity, rope_dim), k_rope_BSR.dtype)),
        grid=(b * t, 2),
        input_output_aliases={5: 0, 6: 1},
        compiler_params=pl_triton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="latent_write",
    )(positions_BT.reshape(-1).astype(jnp.int32), kv_BTX.reshape(-1), norm_C,
      cos_BTF.reshape(-1).astype(jnp.float32), sin_BTF.reshape(-1).astype(jnp.float32),
      latent_BSC.reshape(b * capacity, latent_dim), k_rope_BSR.reshape(b * capacity, rope_dim))
    return latent_NC.reshape(latent_BSC.shape), k_rope_NR.reshape(k_rope_BSR.shape)


def latent_write_reference(kv_BTX, norm_C, cos_BTF, sin_BTF, latent_BSC, k_rope_BSR, positions_BT, eps: float, *,
                           offset: int = 0):
    """The plain form the kernel is held to (model.attention_mla.project_latent, then write_slots)."""
    latent_dim, rope_dim = latent_BSC.shape[-1], k_rope_BSR.shape[-1]
    kv = kv_BTX[..., offset:offset + latent_dim + rope_dim]
    latent = rms_norm(kv[..., :latent_dim], norm_C, eps)
    k_rope = apply_interleaved(kv[..., latent_dim:][:, :, None, :], cos_BTF, sin_BTF)[:, :, 0, :]
    return write_slots(latent_BSC, latent, positions_BT), write_slots(k_rope_BSR, k_rope, positions_BT)
