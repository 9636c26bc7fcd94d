"""Fused routed experts for few tokens (decode, verify): Pallas (Triton) gather-GEMMs over the selected experts.

Plain reference: `model.moe.experts_gather` (tests hold this to it in Pallas interpret mode on CPU).

Two kernels, each reading every selected expert once (slots from `expert_slots`):
1. gate_up: grid (slot, block of F rows). h[u, f, t] = silu(x_t . gate[e_u, f]) * (x_t . up[e_u, f]) * c[u, t],
   where c[u, t] is token t's routing weight for the slot's expert (0 when t did not choose it).
2. down: grid (block of H rows). y[h, t] = sum over used slots u of down[e_u, h, :] . h[u, :, t].
The T tokens ride along as the N side of a small matrix product (padded to 16+), so T = 1..16 tokens cost
about the same bytes as one: weights are read once per slot, never per (token, choice) pair. On the
GPU the dequantized tiles' trip through shared memory costs more than those bytes save at few tokens, where the
dispatch (model/kernels/dispatch.py) runs moe_gemv.py's one-slot-per-pair kernel instead.

INT4 weights stay packed in HBM and are dequantized in registers (see int4_tile.py): nibble j of each
word is a "part" dotted with the inputs 8*w + j, so the wrapper lays x out j-major ([8, H/8, T]) and the
gate_up kernel computes F rows in the matching j-major order, which is the layout the down kernel needs
for its own inputs. bf16 weights are the same code with one part.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from model.kernels.int4_tile import nibble_float, nibble_offset, shifted_words
from model.kernels.moe_gemv import routed_experts_gemv, scale_tile
from model.kernels.moe_tiles import (MoEKernelConfig, check_shapes, expert_slots, parts_of, split_range, token_tile,
                                     weight_arrays, words_per_group)
from model.kernels.triton_ops import div, even_splits, fma, rem
from model.quant import Int4Weight

def _loadparts_of(w_ref, s_ref, e, rows, k0, block_k, parts, words_per_group, dtype, gather, ptx):
    """One [rows, block_k] tile of expert e -> `parts` operands [rows, block_k] in `dtype`.

    INT4: nibble j as the exact float q + offset_j (moe_gemv.nibble_float), then one FMA gives q * scale,
    rounded once to `dtype` as in the reference `dequantize`."""
    words = w_ref[e, rows, pl.ds(k0, block_k)]
    if s_ref is None:
        return [words.astype(dtype)]
    scale = scale_tile(s_ref, e, rows, k0, block_k, words_per_group, gather)  # one per word, f32
    shifted = shifted_words(words)
    minus = {off: -off * scale for off in {nibble_offset(j) for j in range(parts)}}
    return [fma(nibble_float(shifted, j, ptx), scale, minus[nibble_offset(j)], ptx).astype(dtype)
            for j in range(parts)]


def _gate_up_kernel(expert_ref, num_ref, combine_ref, x_ref, *refs, parts, words_per_group, rows_per_part,
                    cfg: MoEKernelConfig, n_k: int, ptx: bool):
    if parts > 1:
        gate_w, gate_s, up_w, up_s, h_ref = refs
    else:
        (gate_w, up_w, h_ref), gate_s, up_s = refs, None, None
    u = pl.program_id(0)
    p0 = pl.program_id(1) * cfg.block_f  # first j-major position of this block
    dt = h_ref.dtype

    @pl.when(u < num_ref[0])
    def _():
        e = expert_ref[u]
        # j-major position p = j * rows_per_part + w is matrix row f = parts * w + j
        rows = pl.ds(parts * rem(p0, rows_per_part) + div(p0, rows_per_part), cfg.block_f, stride=parts)

        def step(i, acc):
            acc_g, acc_u = acc
            k0 = i * cfg.block_k
            gather = cfg.scales == "gather"
            g_parts = _loadparts_of(gate_w, gate_s, e, rows, k0, cfg.block_k, parts, words_per_group, dt, gather, ptx)
            u_parts = _loadparts_of(up_w, up_s, e, rows, k0, cfg.block_k, parts, words_per_group, dt, gather, ptx)
            for j in range(parts):
                x_j = x_ref[j, pl.ds(k0, cfg.block_k), :]
                acc_g += jnp.dot(g_parts[j], x_j, preferred_element_type=jnp.float32)
                acc_u += jnp.dot(u_parts[j], x_j, preferred_element_type=jnp.float32)
            return acc_g, acc_u

        zeros = jnp.zeros((cfg.block_f, x_ref.shape[-1]), jnp.float32)
        acc_g, acc_u = jax.lax.fori_loop(0, n_k, step, (zeros, zeros))
        h = jax.nn.silu(acc_g) * acc_u * combine_ref[u, :][None, :]
        h_ref[u, pl.ds(p0, cfg.block_f), :] = h.astype(dt)


def _down_kernel(expert_ref, num_ref, h_ref, *refs, parts, words_per_group, rows_per_part,
                 cfg: MoEKernelConfig, n_k: int, slots_per_split: int, ptx: bool):
    if parts > 1:
        down_w, down_s, y_ref = refs
    else:
        (down_w, y_ref), down_s = refs, None
    r0 = pl.program_id(0) * cfg.block_h
    first_slot, slots = split_range(num_ref, pl.program_id(1), slots_per_split)
    dt = h_ref.dtype

    def step(i, acc):
        u = first_slot + div(i, n_k)
        k0 = rem(i, n_k) * cfg.block_k
        e = expert_ref[u]
        d_parts = _loadparts_of(down_w, down_s, e, pl.ds(r0, cfg.block_h), k0, cfg.block_k, parts, words_per_group, dt,
                              cfg.scales == "gather", ptx)
        for j in range(parts):
            h_j = h_ref[u, pl.ds(j * rows_per_part + k0, cfg.block_k), :]
            acc += jnp.dot(d_parts[j], h_j, preferred_element_type=jnp.float32)
        return acc

    zeros = jnp.zeros((cfg.block_h, h_ref.shape[-1]), jnp.float32)
    y_ref[pl.program_id(1), pl.ds(r0, cfg.block_h), :] = jax.lax.fori_loop(0, slots * n_k, step, zeros)


def routed_experts_pallas(x_TH, experts, ids_TK, weights_TK, *, cfg: MoEKernelConfig = MoEKernelConfig(),
                          interpret: bool = False) -> jax.Array:
    """Same contract as `model.moe.experts_gather`: [T, H] -> [T, H] in x's dtype."""
    if cfg.variant == "gemv":
        return routed_experts_gemv(x_TH, experts, ids_TK, weights_TK, cfg=cfg, interpret=interpret)
    if cfg.slots != "unique":
        raise ValueError(f"MoEKernelConfig slots={cfg.slots!r} needs variant='gemv' (the mma variant reads unique "
                         "experts)")
    check_shapes(experts, cfg)
    t, hidden = x_TH.shape
    num_experts, f, _ = experts.gate.shape
    parts, wpg = parts_of(experts.gate), words_per_group(experts.gate)
    tp = token_tile(t)
    dt = x_TH.dtype
    slots = expert_slots(ids_TK, weights_TK, min(num_experts, ids_TK.size), tp)
    u = slots.expert_U.shape[0]
    # element parts * w + j of each row -> x[j, w, t] (j-major, matching the nibble parts)
    x_OWT = jnp.pad(x_TH, ((0, tp - t), (0, 0))).reshape(tp, hidden // parts, parts).transpose(2, 1, 0)
    params = pl_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    common = dict(parts=parts, words_per_group=wpg, rows_per_part=f // parts, cfg=cfg, ptx=not interpret)

    gate_up = functools.partial(_gate_up_kernel, n_k=hidden // parts // cfg.block_k, **common)
    h_UFT = pl.pallas_call(
        gate_up,
        out_shape=jax.ShapeDtypeStruct((u, f, tp), dt),
        grid=(u, f // cfg.block_f),
        compiler_params=params,
        interpret=interpret,
        name="moe_gate_up",
    )(slots.expert_U, slots.num_used, slots.combine_UT, x_OWT,
      *weight_arrays(experts.gate), *weight_arrays(experts.up))

    splits, slots_per_split = even_splits(u, cfg.down_splits)
    down = functools.partial(_down_kernel, n_k=f // parts // cfg.block_k, slots_per_split=slots_per_split, **common)
    y_ZHT = pl.pallas_call(
        down,
        out_shape=jax.ShapeDtypeStruct((splits, hidden, tp), jnp.float32),
        grid=(hidden // cfg.block_h, splits),
        compiler_params=params,
        interpret=interpret,
        name="moe_down",
    )(slots.expert_U, slots.num_used, h_UFT, *weight_arrays(experts.down))
    return jnp.sum(y_ZHT, axis=0)[:, :t].T.astype(dt)
