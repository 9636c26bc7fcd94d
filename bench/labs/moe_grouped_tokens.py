"""Lab: moe_grouped's group kernels with the slot kernel's product, once per token (not yet measured on a GPU).

moe_grouped's group kernels (model/kernels/moe_grouped.py) multiply a converted weight tile with all tokens as the
wgmma's N = 8 columns, one wgmma per scale group (K = 32), and pick each group's scale column by a one-hot mask and
a row sum: eight cross-lane reductions a tile, which is why a group costs 2.2-2.5x a slot of moe_wgmma per expert
(docs/performance.md). Here a group program converts each tile once, as there, but multiplies it the way
moe_wgmma does for one slot, once per token of the step: one wgmma (K = 256, N = 8 scale groups) against that
token's block-diagonal input, whose accumulator [64 rows, 8 groups] takes the scale tile elementwise, in its own
layout, with no reduction until the end. Per group: one conversion (the kernels' arithmetic bound) and T wgmmas
where T slots would convert T times; the price is T block-diagonal inputs (4 KB each) a step from L2.

Run on a GPU: `python -m bench.labs.moe_grouped_tokens --tokens 4 8 --out DIR` (bench.moe_grouped's rows, with the
path `grouped_tokens_m2` beside `slots` and `grouped_m2`); on a CPU the kernels run in Pallas' interpreter.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import bench  # noqa: F401  (the engine's XLA flags)
from bench import moe_grouped as grouped_bench
from model.kernels.dispatch import wgmma_config_for
from model.kernels.moe_grouped import SharedGroups, group_h, routed_experts_grouped
from model.kernels.moe_wgmma import (GROUPS, ROWS, STAGES, TILE_K, _interpret_kw, _nibble_pairs, _operands, _specs,
                                     _store_rows, _sum_leading, _transforms, _zeros, block_diagonal_UNGK, permute_K)


def _token_tile_products(w_smem, s_smem, b_smem, accs, interpret: bool):
    """accs[t][r, g] += s[r, g] * sum over k of group g of q[r, k] * b[t, g, k]: the tile converted once, one wgmma
    per token."""
    if interpret:
        q = (w_smem[...] ^ jnp.int4(-8)).astype(jnp.float32)
        w = permute_K(q.astype(jnp.bfloat16))
        s = s_smem[...].astype(jnp.float32)
        return tuple(acc + jax.lax.dot_general(w, b_smem[t], (((1,), (1,)), ((), ())),
                                               preferred_element_type=jnp.float32) * s
                     for t, acc in enumerate(accs))
    w = _nibble_pairs(plgpu.load(w_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_4X))

    def products(*acc_refs):
        for t, acc_ref in enumerate(acc_refs):
            plgpu.wgmma(acc_ref, w, plgpu.transpose_ref(b_smem.at[t], (1, 0)))
        plgpu.wgmma_wait(0)
        return tuple(acc_ref[...] for acc_ref in acc_refs)

    ps = pl.run_scoped(products, *(plgpu.ACC((ROWS, GROUPS), jnp.float32) for _ in accs))
    s = plgpu.load(s_smem, (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    return tuple(acc + p * s for acc, p in zip(accs, ps))


def _tokens_spec(tokens: int, index, interpret: bool, lead: tuple = ()):
    return plgpu.BlockSpec((*lead, tokens, None, GROUPS, TILE_K), index, transforms=_transforms(16, TILE_K, interpret))


def _gate_up_kernel(expert_ref, xbd_ref, gq_ref, gs_ref, uq_ref, us_ref, gu_ref, *, tokens, n_k, stages, interpret):
    """gu[split, 0 / 1, group, token, rows]: every token's gate / up rows of the group's expert over the split."""
    g, rb, split = jax.lax.axis_index("group"), jax.lax.axis_index("rows"), jax.lax.axis_index("split")
    e = expert_ref[g]
    b = _tokens_spec(tokens, lambda k: (0, split * n_k + k, 0, 0), interpret)
    _, w, s = _specs(interpret, None, lambda k: (rb, split * n_k + k))

    def step(_, xbd_smem, gq_smem, gs_smem, uq_smem, us_smem, carry):
        acc_g, acc_u = carry  # one converted operand live at a time
        acc_g = _token_tile_products(gq_smem, gs_smem, xbd_smem, acc_g, interpret)
        return acc_g, _token_tile_products(uq_smem, us_smem, xbd_smem, acc_u, interpret)

    @pl.when(e >= 0)
    def _():
        zeros = tuple(_zeros(interpret) for _ in range(tokens))
        acc_g, acc_u = plgpu.emit_pipeline(step, grid=(n_k,), in_specs=[b, w, s, w, s], max_concurrent_steps=stages,
                                           init_carry=(zeros, zeros))(
            xbd_ref, gq_ref.at[e], gs_ref.at[e], uq_ref.at[e], us_ref.at[e])
        for t in range(tokens):
            _store_rows(jnp.sum(acc_g[t], axis=1), gu_ref.at[split, 0, g, t, pl.ds(rb * ROWS, ROWS)])
            _store_rows(jnp.sum(acc_u[t], axis=1), gu_ref.at[split, 1, g, t, pl.ds(rb * ROWS, ROWS)])


def _down_kernel(expert_ref, hbd_ref, dq_ref, ds_ref, y_ref, *, tokens, n_k, stages, interpret):
    """y[group, token, rows]: the group's expert's down rows applied to each token's h (zero for non-members)."""
    rb, g = jax.lax.axis_index("rows"), jax.lax.axis_index("group")
    e = expert_ref[g]
    b = _tokens_spec(tokens, lambda k: (g, 0, k, 0, 0), interpret, lead=(None,))
    _, w, s = _specs(interpret, None, lambda k: (e, rb, k), lead=(None,))

    def step(_, hbd_smem, dq_smem, ds_smem, acc):
        return _token_tile_products(dq_smem, ds_smem, hbd_smem, acc, interpret)

    @pl.when(e >= 0)
    def _():
        acc = plgpu.emit_pipeline(step, grid=(n_k,), in_specs=[b, w, s], max_concurrent_steps=stages,
                                  init_carry=tuple(_zeros(interpret) for _ in range(tokens)))(hbd_ref, dq_ref, ds_ref)
        for t in range(tokens):
            _store_rows(jnp.sum(acc[t], axis=1), y_ref.at[g, t, pl.ds(rb * ROWS, ROWS)])


def group_gate_up(x_TH, gate, up, groups: SharedGroups, *, splits: int, stages: int = STAGES,
                  interpret: bool = False) -> jax.Array:
    """[splits, 2, U, T, F] f32: each group's gate / up rows for every token (groups that exit: unwritten)."""
    t, hidden = x_TH.shape
    f, g = gate.shape[1], groups.expert_U.shape[0]
    return plgpu.kernel(
        functools.partial(_gate_up_kernel, tokens=t, n_k=hidden // TILE_K // splits, stages=stages,
                          interpret=interpret),
        out_type=jax.ShapeDtypeStruct((splits, 2, g, t, f), jnp.float32),
        grid=(g, f // ROWS, splits), grid_names=("group", "rows", "split"), **_interpret_kw(interpret),
    )(groups.expert_U, block_diagonal_UNGK(permute_K(x_TH)), *_operands(gate), *_operands(up))


def group_down(h_UTF, down, groups: SharedGroups, *, stages: int = STAGES, interpret: bool = False) -> jax.Array:
    """[U, T, H] f32: each group's down rows applied to its tokens' h (groups that exit: unwritten)."""
    u, t, f = h_UTF.shape
    hidden = down.shape[1]
    hbd = block_diagonal_UNGK(permute_K(h_UTF).reshape(u * t, f)).reshape(u, t, f // TILE_K, GROUPS, TILE_K)
    return plgpu.kernel(
        functools.partial(_down_kernel, tokens=t, n_k=f // TILE_K, stages=stages, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((u, t, hidden), jnp.float32),
        grid=(hidden // ROWS, u), grid_names=("rows", "group"), **_interpret_kw(interpret),
    )(groups.expert_U, hbd, *_operands(down))


def group_sums_tokens(x_TH, experts, groups: SharedGroups, *, gate_up_splits: int, stages: int = STAGES,
                      interpret: bool = False) -> jax.Array:
    """`model.kernels.moe_grouped.group_sums` with this lab's group kernels: [T, H] f32."""
    g_UTF, u_UTF = _sum_leading(group_gate_up(x_TH, experts.gate, experts.up, groups, splits=gate_up_splits,
                                              stages=stages, interpret=interpret))
    y_UTH = group_down(group_h(g_UTF, u_UTF, groups), experts.down, groups, stages=stages, interpret=interpret)
    return jnp.sum(jnp.where((groups.expert_U >= 0)[:, None, None], y_UTH, 0.0), axis=0)


# moe_grouped's routed experts with this lab's group kernels (the slot kernels and the bookkeeping are the product's)
routed_experts_grouped_tokens = functools.partial(routed_experts_grouped, group_path=group_sums_tokens)


def paths(experts, tokens: int, min_members: list[int]) -> dict:
    """bench.moe_grouped's paths and this lab's at each threshold."""
    out = grouped_bench.paths(experts, tokens, min_members)
    splits = wgmma_config_for(experts, 8, tokens)
    for m in min_members:
        out[f"grouped_tokens_m{m}"] = functools.partial(routed_experts_grouped_tokens, **splits, min_members=m,
                                                        interpret=jax.default_backend() != "gpu")
    return out


def main(argv=None) -> int:
    return grouped_bench.main(argv, paths_fn=paths, prog="python -m bench.labs.moe_grouped_tokens",
                              stem="moe-grouped-tokens")


if __name__ == "__main__":
    sys.exit(main())
