"""moe_wgmma's two kernels with the down kernel reading F-blocked down tiles: Pallas Mosaic GPU (Hopper).

Plain reference: `model.moe.experts_gather`. moe_wgmma's down kernel reads each [64, 256] int4 tile of down [E, H, F]
as 64 rows of 128 bytes, 1 KB apart (a row of down is 1 KB at F = 2048); at one token it streams at 2.98 TB/s even
with its conversion left out (bench/results/README.md, run 19), where gate_up, whose tiles are strided too but
whose kernel is otherwise alike, streams at 3.5. Here down is read in `fused_down_layout` (moe_wgmma_fused.py):
F block b's tile row R holds H rows 4R .. 4R + 3, 64 F values each, so a tile is 8 KB in one piece.

A tile then covers 256 H rows and one F block of 64, and its wgmma's eight columns are (H row 4R + g // 2, half
g % 2 of the block): B = h's 64 values of the block, tiled four times, block-diagonal over the groups of 32
(`block_diagonal_SNGK` of the tiled h; the layout's inverse permutation makes the wgmma's column order h's own).
A program sums its share of the choices and of the F blocks for one 256-row block of H; XLA adds the shares and
each H row's two halves. gate_up is moe_wgmma's.

Measured on the H200 at one token (bench/results/README.md, run 19): down 23.2 us at 2.89 TB/s against moe_wgmma's
22.2 at 2.99, a layer call 71.6-72.0 us against 67.8. The tiles' layout is not what holds the down kernel back; the
engine does not dispatch this.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from model.kernels.moe_wgmma import (GROUPS, ROWS, STAGES, TILE_K, _interpret_kw, _specs, _store_rows,
                                     _sum_leading, _tile_products, _zeros, block_diagonal_SNGK, gate_up_sums,
                                     int4_nibbles, swiglu_h)
from model.kernels.moe_wgmma_fused import F_BLOCK, SEGMENTS, check_down_fused
from model.quant import Int4Weight


def _blocked_down_kernel(expert_ref, hbd_ref, dq_ref, ds_ref, y_ref, *, n_f, choices, splits, k_splits, stages,
                         interpret):
    rb, ts = jax.lax.axis_index("rows"), jax.lax.axis_index("token_split")
    t, rest = ts // (splits * k_splits), ts % (splits * k_splits)
    split, ks = rest // k_splits, rest % k_splits
    per_split = choices // splits
    first = t * choices + split * per_split
    f0 = ks * n_f

    def step(_, hbd_smem, dq_smem, ds_smem, carry):
        return _tile_products(((dq_smem, ds_smem),), hbd_smem, (carry,), interpret)[0]

    # hbd [slots, F blocks, GROUPS, TILE_K]; dq [E, F blocks, H / 4, TILE_K]: (choice, F block) steps
    b, _, _ = _specs(interpret, lambda c, kk: (first + c, f0 + kk, 0, 0), None, lead=(None,))
    _, w, s = _specs(interpret, None, lambda c, kk: (expert_ref[first + c], f0 + kk, rb, 0), lead=(None, None))
    acc = plgpu.emit_pipeline(step, grid=(per_split, n_f), in_specs=[b, w, s], max_concurrent_steps=stages,
                              init_carry=_zeros(interpret))(hbd_ref, dq_ref, ds_ref)

    _store_rows(acc, y_ref.at[split * k_splits + ks, t, rb])


def _check_splits(choices: int, f: int, splits: int, k_splits: int) -> None:
    if choices % splits or (f // F_BLOCK) % k_splits:
        raise ValueError(f"down_splits={splits} must divide the {choices} choices per token and "
                         f"down_k_splits={k_splits} the {f // F_BLOCK} F blocks of {F_BLOCK}")


def blocked_down_sums(h_UF, down_fused: Int4Weight, expert_U, *, choices: int, stages: int = STAGES, splits: int = 8,
                      k_splits: int = 8, interpret: bool = False) -> jax.Array:
    """[splits * k_splits, T, H / 256, 64, 8] f32: token t's share (choices split s, F blocks share ks) of down(h);
    column (R, g) of row block n is H row 256n + 4R + g // 2, half g % 2."""
    slots, f = h_UF.shape
    n_blocks = f // F_BLOCK
    _check_splits(choices, f, splits, k_splits)
    t, hidden = slots // choices, down_fused.shape[2] * SEGMENTS
    tiled = jnp.tile(h_UF.reshape(slots, n_blocks, 1, F_BLOCK), (1, 1, SEGMENTS, 1)).reshape(slots, n_blocks * TILE_K)
    return plgpu.kernel(
        functools.partial(_blocked_down_kernel, n_f=n_blocks // k_splits, choices=choices, splits=splits,
                          k_splits=k_splits, stages=stages, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((splits * k_splits, t, hidden // TILE_K, ROWS, GROUPS), jnp.float32),
        grid=(hidden // TILE_K, t * splits * k_splits), grid_names=("rows", "token_split"),
        **_interpret_kw(interpret),
    )(expert_U, block_diagonal_SNGK(tiled), int4_nibbles(down_fused), down_fused.scale)


def routed_experts_blocked_down(x_TH, experts, down_fused: Int4Weight, ids_TK, weights_TK, *, stages: int = STAGES,
                                gate_up_splits: int = 7, down_splits: int = 8, down_k_splits: int = 8,
                                interpret: bool = False) -> jax.Array:
    """Same contract as `model.moe.experts_gather` for INT4 experts (`supports(experts)`); `down_fused` is
    `fused_down_layout(experts.down)`."""
    check_down_fused(experts, down_fused, "moe_wgmma_blocked_down")
    f, hidden = experts.gate.shape[1:]
    t, k = ids_TK.shape
    _check_splits(k, f, down_splits, down_k_splits)  # before any kernel runs
    expert_U = ids_TK.reshape(t * k).astype(jnp.int32)
    gu_S2UF = gate_up_sums(x_TH, experts.gate, experts.up, expert_U, choices=k, stages=stages,
                           splits=gate_up_splits, interpret=interpret)
    y = blocked_down_sums(swiglu_h(gu_S2UF, weights_TK), down_fused, expert_U, choices=k, stages=stages,
                          splits=down_splits, k_splits=down_k_splits, interpret=interpret)
    y_TQ = _sum_leading(y).reshape(t, hidden, 2)
    return jnp.sum(y_TQ, axis=-1).astype(x_TH.dtype)
