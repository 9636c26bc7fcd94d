"""One token's MLA cache write with its norm and rope: a Pallas (Triton) kernel that updates the caches in place.

Plain reference: `latent_write_reference` (model.attention_mla.project_latent's norm of the latent and rope of the
shared key, then model.kv_cache.write_slots), which runs everywhere the kernel does not. Why: at one token XLA runs
the latent's sum of squares as a reduction and each cache's update as a kernel of its own (the norm's scale and the
rope fused into them), three launches a layer for 576 values; here one program normalises the latent and writes
it, another ropes the key and writes it, and the caches are the kernel's outputs, aliased to its inputs, so only
the written slot is touched.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from model.kernels.triton_ops import rounded
from model.kv_cache import write_slots
from model.norms import rms_norm
from model.rope import apply_interleaved


def _kernel(pos_ref, kv_ref, norm_ref, cos_ref, sin_ref, _lat_in, _kr_in, lat_ref, kr_ref, *, offset, latent_dim,
            rope_dim, capacity, eps, interpret):
    slot = jnp.minimum(pos_ref[0], capacity - 1)  # past the capacity: the last slot, as write_slots' update
    dt = lat_ref.dtype

    # refs without a batch axis (kv [W], caches [S, C|R]): the interpreter cannot mix an integer with strided slices
    @pl.when(pl.program_id(0) == 0)
    def _():
        x = kv_ref[pl.ds(offset, latent_dim)].astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.sum(x * x) / latent_dim + eps)
        normed = rounded(rounded(x * inv_rms, dt, interpret) * norm_ref[...].astype(jnp.float32), dt, interpret)
        lat_ref[pl.ds(slot, 1), :] = normed.astype(dt)[None, :]

    @pl.when(pl.program_id(0) == 1)
    def _():
        half = rope_dim // 2
        even = kv_ref[pl.ds(offset + latent_dim, half, stride=2)].astype(jnp.float32)
        odd = kv_ref[pl.ds(offset + latent_dim + 1, half, stride=2)].astype(jnp.float32)
        cos, sin = cos_ref[...], sin_ref[...]
        kr_ref[pl.ds(slot, 1), pl.ds(0, half, stride=2)] = (even * cos - odd * sin).astype(dt)[None, :]
        kr_ref[pl.ds(slot, 1), pl.ds(1, half, stride=2)] = (odd * cos + even * sin).astype(dt)[None, :]


def latent_write(kv_TX, norm_C, cos_TF, sin_TF, latent_BSC, k_rope_BSR, positions_BT, eps: float, *, offset: int = 0,
                 interpret: bool = False):
    """One token of one sequence: (latent cache with rms_norm(kv[offset : offset + C], norm) at the token's slot,
    rope-key cache with kv[offset + C : offset + C + R] roped (interleaved pairs, angles cos / sin [1, R / 2]) there).
    kv [1, W]: the kv_a projection's output, or a wider one holding it from column `offset` (read in place)."""
    b, capacity, latent_dim = latent_BSC.shape
    rope_dim = k_rope_BSR.shape[-1]
    if b != 1 or positions_BT.shape != (1, 1) or kv_TX.shape[0] != 1:
        raise ValueError(f"latent_write takes one token of one sequence, got positions {positions_BT.shape}")
    if kv_TX.shape[1] < offset + latent_dim + rope_dim or rope_dim % 2 or cos_TF.shape != (1, rope_dim // 2):
        raise ValueError(f"latent_write: kv {kv_TX.shape} from column {offset}, caches {latent_BSC.shape} / "
                         f"{k_rope_BSR.shape} and rope angles {cos_TF.shape} disagree")
    if not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a Python number (it is baked into the kernel), got {type(eps).__name__}")
    kernel = functools.partial(_kernel, offset=offset, latent_dim=latent_dim, rope_dim=rope_dim, capacity=capacity,
                               eps=eps, interpret=interpret)
    latent_SC, k_rope_SR = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((capacity, latent_dim), latent_BSC.dtype),
                   jax.ShapeDtypeStruct((capacity, rope_dim), k_rope_BSR.dtype)),
        grid=(2,),
        input_output_aliases={5: 0, 6: 1},
        compiler_params=pl_triton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="latent_write",
    )(positions_BT.reshape(1).astype(jnp.int32), kv_TX.reshape(-1), norm_C, cos_TF.reshape(-1).astype(jnp.float32),
      sin_TF.reshape(-1).astype(jnp.float32), latent_BSC.reshape(capacity, latent_dim),
      k_rope_BSR.reshape(capacity, rope_dim))
    return latent_SC.reshape(latent_BSC.shape), k_rope_SR.reshape(k_rope_BSR.shape)


def latent_write_reference(kv_TX, norm_C, cos_TF, sin_TF, latent_BSC, k_rope_BSR, positions_BT, eps: float, *,
                           offset: int = 0):
    """The plain form the kernel is held to (model.attention_mla.project_latent, then write_slots)."""
    latent_dim, rope_dim = latent_BSC.shape[-1], k_rope_BSR.shape[-1]
    kv = kv_TX[None, :, offset:offset + latent_dim + rope_dim]  # [B = 1, T = 1, C + R]
    latent = rms_norm(kv[..., :latent_dim], norm_C, eps)
    k_rope = apply_interleaved(kv[..., latent_dim:][:, :, None, :], cos_TF[None], sin_TF[None])[:, :, 0, :]
    return write_slots(latent_BSC, latent, positions_BT), write_slots(k_rope_BSR, k_rope, positions_BT)
