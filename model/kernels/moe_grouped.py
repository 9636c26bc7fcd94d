"""Routed experts for verify whose cost follows the experts the tokens share: Pallas Mosaic GPU (Hopper).

Plain reference: `model.moe.experts_gather`. moe_wgmma runs one program row per (token, choice) slot and converts an
expert's int4 tiles once per slot that chose it, so verify tokens that share experts cost what independent ones do.
Here the slots are split by how many slots of the step chose their expert, inside the program and with no
conditional (an XLA conditional costs a host round trip, ~16 us on an H200):
- an expert chosen by fewer than `min_members` slots runs in moe_wgmma's own kernels, one program row per slot, the
  other slots skipped (moe_wgmma skips a slot of router weight 0; skipped programs exit before their pipelines);
- an expert chosen by `min_members` slots or more is one group, at most T x K // min_members of them: its tiles are
  converted once and multiplied with all (up to 8) tokens as the wgmma's N columns, one wgmma per scale group
  (K = 32), each group's product scaled by that group's column of the scale tile, picked by a one-hot mask and a
  row sum.
Groups beyond the step's count exit at once. Both kernels always run; at independent routing the group kernels'
programs nearly all exit, at shared routing the slot kernels' do. The group kernels' outputs are added to the slot
kernels' by XLA (the down kernel writes per group: [U, H, 8]).

Why two slots make a group: wherever tokens share experts, a threshold of two ran faster than three
(bench.moe_grouped on an H200, docs/performance.md); at independent routing neither beat moe_wgmma alone, by the
fixed cost of the group kernels' launches and the bookkeeping, which is why `Kernels(moe="auto")` does not take
this path.

Why it is built this way: one kernel holding both paths (every program reserves both paths' registers and shared
memory) ran 1.2x slower at random routing, and one-member groups in the group layout ran 16-22% slower; here the
slots run the engine's kernels unchanged, with their layout and splits.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from model.kernels import moe_wgmma
from model.kernels.moe_wgmma import (GROUPS, ROWS, STAGES, TILE_K, _interpret_kw, _nibble_pairs, _operands,
                                     _specs, _store_rows, _sum_leading, _transforms, _zeros, permute_K, supports)

MAX_TOKENS = 8  # the tokens ride as the wgmma's N = 8 columns
MIN_MEMBERS = 2  # slots that make an expert a group (the module docstring: why)
GROUP_K = TILE_K // GROUPS  # columns of one scale group: the K of each of a tile's GROUPS wgmmas


class SharedGroups(NamedTuple):
    """The step's experts chosen by min_members slots or more (`shared_groups`): U of them at most, in order of
    first choice."""
    shared_P: jax.Array  # [T * K] bool: the slot's expert is a group's
    expert_U: jax.Array  # [U] int32: each group's expert; -1 beyond the step's count (those programs exit)
    weight_UT: jax.Array  # [U, T] float32: token t's router weight for the group's expert (0: not a member)
    member_UT: jax.Array  # [U, T] bool


def shared_groups(ids_TK: jax.Array, weights_TK: jax.Array, min_members: int = MIN_MEMBERS) -> SharedGroups:
    """Written as comparisons and masked sums over the T x K slots (no sort, scatter or scan), so XLA makes a few
    fused kernels of it: at independent routing this bookkeeping is all the group path adds to the step."""
    if min_members < 2:
        raise ValueError(f"min_members={min_members}: a group holds two slots at least")
    t, k = ids_TK.shape
    p = t * k
    groups = max(1, p // min_members)
    ids_P = ids_TK.reshape(p).astype(jnp.int32)
    slot_P = jnp.arange(p, dtype=jnp.int32)
    # a slot of router weight 0 (under expert parallelism, a choice of another device's expert, pointed at a local
    # one) joins no group: it stays with the slot kernels, which skip it
    active_P = weights_TK.reshape(p) != 0
    same_PP = (ids_P[:, None] == ids_P[None, :]) & active_P[:, None] & active_P[None, :]
    shared_P = jnp.sum(same_PP, axis=1) >= min_members
    # a slot leads its group when no earlier slot chose its expert; a group's index counts the leads before it
    lead_P = shared_P & ~jnp.any(same_PP & (slot_P[None, :] < slot_P[:, None]), axis=1)
    rank_P = jnp.sum(lead_P[None, :] & (slot_P[None, :] < slot_P[:, None]), axis=1)
    lead_rank_P = jnp.where(lead_P, rank_P, -1)
    group_P = jnp.where(shared_P, jnp.max(jnp.where(same_PP, lead_rank_P[None, :], -1), axis=1), -1)
    in_UP = group_P[None, :] == jnp.arange(groups, dtype=jnp.int32)[:, None]
    expert_U = jnp.max(jnp.where(in_UP, ids_P[None, :], -1), axis=1)
    of_token_UTP = in_UP[:, None, :] & ((slot_P // k)[None, None, :] == jnp.arange(t)[None, :, None])
    weight_P = weights_TK.reshape(p).astype(jnp.float32)
    return SharedGroups(shared_P=shared_P, expert_U=expert_U,
                        weight_UT=jnp.sum(jnp.where(of_token_UTP, weight_P[None, None, :], 0.0), axis=2),
                        member_UT=jnp.any(of_token_UTP, axis=2))


def token_tiles(v_XTK: jax.Array) -> jax.Array:
    """[X, T, K] -> [X, K // TILE_K, GROUPS, 8, GROUP_K] bf16: per tile and scale group, the tokens' values of that
    group's columns in the converted operand's column order (`permute_K`), missing tokens zero."""
    x, t, k = v_XTK.shape
    v = jnp.pad(permute_K(v_XTK.astype(jnp.bfloat16)), ((0, 0), (0, MAX_TOKENS - t), (0, 0)))
    return jnp.transpose(v.reshape(x, MAX_TOKENS, k // TILE_K, GROUPS, GROUP_K), (0, 2, 3, 1, 4))


def _tokens_tile_product(w_smem, s_smem, b_smem, acc, interpret: bool):
    """acc[r, t] += sum over scale groups g of s[r, g] * (sum over k of group g of q[r, k] * b[g, t, k]): one weight
    tile converted once for all tokens; one wgmma (K = GROUP_K, N = 8 tokens) per scale group."""
    if interpret:
        q = (w_smem[...] ^ jnp.int4(-8)).astype(jnp.float32)
        w = permute_K(q.astype(jnp.bfloat16))
        b, s = b_smem[...], s_smem[...].astype(jnp.float32)
        for g in range(GROUPS):
            p = jax.lax.dot_general(w[:, g * GROUP_K:(g + 1) * GROUP_K], b[g], (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
            acc = acc + p * s[:, g:g + 1]
        return acc
    w = _nibble_pairs(plgpu.load(w_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_4X))

    def products(*acc_refs):
        for g, acc_ref in enumerate(acc_refs):
            plgpu.wgmma(acc_ref, w[:, g * GROUP_K:(g + 1) * GROUP_K], plgpu.transpose_ref(b_smem.at[g], (1, 0)))
        plgpu.wgmma_wait(0)
        return tuple(acc_ref[...] for acc_ref in acc_refs)

    ps = pl.run_scoped(products, *(plgpu.ACC((ROWS, MAX_TOKENS), jnp.float32) for _ in range(GROUPS)))
    s = plgpu.load(s_smem, (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    col = plgpu.broadcasted_iota(jnp.int32, (ROWS, GROUPS), 1, layout=plgpu.Layout.WGMMA)
    for g, p in enumerate(ps):
        s_g = jnp.sum(s * (col == g).astype(jnp.float32), axis=1)
        acc = acc + p * jax.lax.broadcast_in_dim(s_g, (ROWS, MAX_TOKENS), (0,))
    return acc


def _b_spec(interpret: bool, index, lead: tuple = ()):
    return plgpu.BlockSpec((*lead, None, GROUPS, MAX_TOKENS, GROUP_K), index,
                           transforms=_transforms(16, GROUP_K, interpret))


def _group_gate_up_kernel(expert_ref, xt_ref, gq_ref, gs_ref, uq_ref, us_ref, gu_ref, *, n_k, stages, interpret):
    """gu[split, 0 / 1, group, rows, token]: every token's gate / up rows of the group's expert over the split's
    share of H (only the members' are used)."""
    g, rb, split = jax.lax.axis_index("group"), jax.lax.axis_index("rows"), jax.lax.axis_index("split")
    e = expert_ref[g]
    _, w, s = _specs(interpret, None, lambda k: (rb, split * n_k + k))
    b = _b_spec(interpret, lambda k: (split * n_k + k, 0, 0, 0))

    def step(_, xt_smem, gq_smem, gs_smem, uq_smem, us_smem, carry):
        acc_g, acc_u = carry  # one converted operand live at a time
        acc_g = _tokens_tile_product(gq_smem, gs_smem, xt_smem, acc_g, interpret)
        return acc_g, _tokens_tile_product(uq_smem, us_smem, xt_smem, acc_u, interpret)

    @pl.when(e >= 0)
    def _():
        acc_g, acc_u = plgpu.emit_pipeline(
            step, grid=(n_k,), in_specs=[b, w, s, w, s], max_concurrent_steps=stages,
            init_carry=(_zeros(interpret, MAX_TOKENS), _zeros(interpret, MAX_TOKENS)))(
            xt_ref, gq_ref.at[e], gs_ref.at[e], uq_ref.at[e], us_ref.at[e])
        _store_rows(acc_g, gu_ref.at[split, 0, g, pl.ds(rb * ROWS, ROWS)])
        _store_rows(acc_u, gu_ref.at[split, 1, g, pl.ds(rb * ROWS, ROWS)])


def _group_down_kernel(expert_ref, ht_ref, dq_ref, ds_ref, y_ref, *, n_k, stages, interpret):
    """y[group, rows, token]: the group's expert's down rows applied to each token's h (zero for non-members)."""
    rb, g = jax.lax.axis_index("rows"), jax.lax.axis_index("group")
    e = expert_ref[g]
    _, w, s = _specs(interpret, None, lambda k: (e, rb, k), lead=(None,))
    b = _b_spec(interpret, lambda k: (g, k, 0, 0, 0), lead=(None,))

    def step(_, ht_smem, dq_smem, ds_smem, acc):
        return _tokens_tile_product(dq_smem, ds_smem, ht_smem, acc, interpret)

    @pl.when(e >= 0)
    def _():
        acc = plgpu.emit_pipeline(step, grid=(n_k,), in_specs=[b, w, s], max_concurrent_steps=stages,
                                  init_carry=_zeros(interpret, MAX_TOKENS))(ht_ref, dq_ref, ds_ref)
        _store_rows(acc, y_ref.at[g, pl.ds(rb * ROWS, ROWS)])


def group_gate_up(x_TH, gate, up, groups: SharedGroups, *, splits: int, stages: int = STAGES,
                  interpret: bool = False) -> jax.Array:
    """[splits, 2, U, F, 8] f32: each group's gate / up rows for every token (rows of groups that exit unwritten)."""
    hidden, f, g = x_TH.shape[1], gate.shape[1], groups.expert_U.shape[0]
    return plgpu.kernel(
        functools.partial(_group_gate_up_kernel, n_k=hidden // TILE_K // splits, stages=stages, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((splits, 2, g, f, MAX_TOKENS), jnp.float32),
        grid=(g, f // ROWS, splits), grid_names=("group", "rows", "split"), **_interpret_kw(interpret),
    )(groups.expert_U, token_tiles(x_TH[None])[0], *_operands(gate), *_operands(up))


def group_down(h_UTF, down, groups: SharedGroups, *, stages: int = STAGES, interpret: bool = False) -> jax.Array:
    """[U, H, 8] f32: each group's down rows applied to its tokens' h (rows of groups that exit unwritten)."""
    f, hidden, g = h_UTF.shape[2], down.shape[1], groups.expert_U.shape[0]
    return plgpu.kernel(
        functools.partial(_group_down_kernel, n_k=f // TILE_K, stages=stages, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((g, hidden, MAX_TOKENS), jnp.float32),
        grid=(hidden // ROWS, g), grid_names=("rows", "group"), **_interpret_kw(interpret),
    )(groups.expert_U, token_tiles(h_UTF), *_operands(down))


def _slot_sums(x_TH, experts, ids_TK, alone_w_TK, *, gate_up_splits: int, down_splits: int, down_k_splits: int,
               stages: int = STAGES, interpret: bool = False) -> jax.Array:
    """[T, H] f32: the slots of experts that are no group, through moe_wgmma's kernels; a slot of weight 0 in
    `alone_w_TK` (a group's, or another device's) is skipped."""
    t, k = ids_TK.shape
    expert_U = ids_TK.reshape(t * k).astype(jnp.int32)
    gu_Z2UF = moe_wgmma.gate_up_sums(x_TH, experts.gate, experts.up, expert_U, choices=k, stages=stages,
                                     splits=gate_up_splits, weight_U=alone_w_TK.reshape(t * k), interpret=interpret)
    h_UF = moe_wgmma.swiglu_h(gu_Z2UF, alone_w_TK)
    y_ZTH = moe_wgmma.down_sums(h_UF, experts.down, expert_U, choices=k, stages=stages, splits=down_splits,
                                k_splits=down_k_splits, weight_U=alone_w_TK.reshape(t * k),
                                interpret=interpret)
    written_ZT1 = moe_wgmma.split_active_ZT(alone_w_TK, down_splits, down_k_splits)[..., None]
    return _sum_leading(jnp.where(written_ZT1, y_ZTH, 0.0))


def group_sums(x_TH, experts, groups: SharedGroups, *, gate_up_splits: int, stages: int = STAGES,
               interpret: bool = False) -> jax.Array:
    """[T, H] f32: the groups' experts, each converted once for all its tokens (this module's group kernels)."""
    t = x_TH.shape[0]
    gu = group_gate_up(x_TH, experts.gate, experts.up, groups, splits=gate_up_splits, stages=stages,
                       interpret=interpret)
    g_UTF, u_UTF = (jnp.swapaxes(m, 1, 2)[:, :t] for m in _sum_leading(gu))
    # where, not a product: the rows of groups that exited were never written
    h_UTF = jnp.where(groups.member_UT[..., None], jax.nn.silu(g_UTF) * u_UTF * groups.weight_UT[..., None], 0.0)
    y_UHT = group_down(h_UTF, experts.down, groups, stages=stages, interpret=interpret)
    y_HT = jnp.sum(jnp.where((groups.expert_U >= 0)[:, None, None], y_UHT, 0.0), axis=0)
    return y_HT[:, :t].T


def routed_experts_grouped(x_TH, experts, ids_TK, weights_TK, *, gate_up_splits: int = 1, down_splits: int = 2,
                           down_k_splits: int = 1, stages: int = STAGES, min_members: int = MIN_MEMBERS,
                           interpret: bool = False) -> jax.Array:
    """Same contract as `model.moe.experts_gather` for INT4 experts (`moe_wgmma.supports`), T <= MAX_TOKENS; the
    splits are moe_wgmma's (`model.kernels.dispatch.wgmma_config_for`), gate_up's shared by the group kernel."""
    if not supports(experts):
        raise ValueError(f"moe_grouped takes moe_wgmma's INT4 experts, got gate {experts.gate.shape}")
    t, k = ids_TK.shape
    if t > MAX_TOKENS:
        raise ValueError(f"moe_grouped takes up to {MAX_TOKENS} tokens, got {t}")
    groups = shared_groups(ids_TK, weights_TK, min_members)
    y_TH = _slot_sums(x_TH, experts, ids_TK, jnp.where(groups.shared_P.reshape(t, k), 0.0, weights_TK),
                      gate_up_splits=gate_up_splits, down_splits=down_splits, down_k_splits=down_k_splits,
                      stages=stages, interpret=interpret)
    y_TH = y_TH + group_sums(x_TH, experts, groups, gate_up_splits=gate_up_splits, stages=stages,
                             interpret=interpret)
    return y_TH.astype(x_TH.dtype)
