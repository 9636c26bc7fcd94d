"""Routed experts for verify steps with the slots grouped by expert: each selected expert's weights are read and
dequantized once for all the tokens that chose it. Pallas Mosaic GPU (Hopper), built from moe_wgmma.py's tiles.
Measured on the H200, not dispatched by the engine (below).

Plain reference: `model.moe.experts_gather`. moe_wgmma.py runs one program row per slot (token, choice): when
several of a verify step's tokens choose one expert, each slot streams and converts that expert's tiles again
(the repeats may come from L2, but the int4 -> bf16 conversion, which bounds the kernel, is paid per slot). The
eight-layer step on the H200 showed what that costs (bench/results/README.md, run 17): from the fifth layer on the
random model's four verify tokens chose nearly the same experts (8-10 unique of 32 slots), and each such layer
took 305 us against 118 us of unique-expert bytes (2.6x), as long as a layer whose 32 slots hit 28 experts.

Here a program row is one group: an expert that at least one token chose (`expert_groups`, in sorted order; the
groups beyond the step's count are skipped at once). Two paths, picked per group inside the kernels:
- several member tokens: B holds all (up to 8) tokens as the wgmma's N columns (`token_tiles`, 4 KB a step as
  moe_wgmma's one-token B), and each converted weight tile goes through one wgmma per scale group (K = 32), whose
  [ROWS, tokens] product is scaled by that group's column of the scale tile. The column is picked out of the
  [ROWS, GROUPS] tile by a one-hot mask and a row sum (a strided load of it is refused by jax 0.11.2's Mosaic GPU:
  "cannot apply swizzle to non-contiguous refs"), which costs ALU time in a kernel that the conversion bounds;
- one member token (most groups at random routing): moe_wgmma's slot path, that token's block-diagonal B.
Tokens that did not choose the expert get products that nobody reads: their h is zeroed before the down kernel,
whose per-group sums XLA adds up over the groups.

One K2.5 layer on the H200, us (`python -m bench.moe_wgmma_lab --routing R --variants 2:4:8:0:p:b g:2:4 [g:2:4:t]`,
bench/results/run17/ 1327-1329, the :t column 1323-1324; the engine's moe_wgmma config first):
| routing (unique experts T=4 / T=8) | T=4 moe_wgmma | grouped | tokens path only (:t) | T=8 moe_wgmma | grouped | :t |
| same (8 / 8) | 200.2 | 125.0 | 115.2 | 399.4 | 147.5 | 130.2 |
| near (21 / 35) | 204.7 | 214.1 | | 388.0 | 327.7 | |
| random (31 / 59) | 224.9 | 268.4 | 300.5 | 408.5 | 494.8 | 552.2 |
So it wins where the tokens share experts (down to a third at T=8) and loses ~20% where they do not, even with
the one-member path: both paths' registers and shared memory are reserved for every program. The engine keeps
moe_wgmma.py; run 17 in bench/results/README.md says what would make this one pay everywhere. `paths="split"`
(lab `g:2:4:s`) compiles each path into a kernel of its own, the first of those steps; written after run 17's
device time ran out, held to the reference on CPU only. A first version
(block-diagonal B of every token, T x 4 KB a step) lost at random routing 440 vs 235 us (git 39e7f65).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from model.kernels.moe_wgmma import (GROUPS, ROWS, STAGES, TILE_K, _check_convert, _interpret_kw, _operand_A,
                                     _operands, _specs, _store_rows, _sum_leading, _tile_products, _transforms,
                                     _wgmma_input, _zeros, input_order, supports)

# B holds the tokens as the wgmma's N = 8 columns
GROUPED_MAX_TOKENS = 8
GROUP_K = TILE_K // GROUPS  # columns of one scale group: the K of each of a tile's GROUPS wgmmas


def expert_groups(ids_TK: jax.Array, weights_TK: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The step's slots grouped by expert, at most T * K groups (static), in increasing expert order.

    -> expert_G [G] int32 (-1 for the groups beyond the step's count of distinct experts), weight_GT [G, T]
    float32 (token t's routing weight for group g's expert, 0 if t did not choose it), member_GT [G, T] bool."""
    t, k = ids_TK.shape
    slots = t * k
    expert_S = ids_TK.reshape(slots).astype(jnp.int32)
    token_S = jnp.arange(slots, dtype=jnp.int32) // k
    order_S = jnp.argsort(expert_S, stable=True)
    sorted_S = expert_S[order_S]
    first_S = jnp.concatenate([jnp.ones((1,), bool), sorted_S[1:] != sorted_S[:-1]])
    group_sorted_S = jnp.cumsum(first_S.astype(jnp.int32)) - 1
    group_S = jnp.zeros((slots,), jnp.int32).at[order_S].set(group_sorted_S)
    expert_G = jnp.full((slots,), -1, jnp.int32).at[group_sorted_S].set(sorted_S)
    # .add: a token that named one expert twice (top-k never does) still counts it twice, as the reference does
    weight_GT = jnp.zeros((slots, t), jnp.float32).at[group_S, token_S].add(weights_TK.reshape(slots).astype(jnp.float32))
    member_GT = jnp.zeros((slots, t), bool).at[group_S, token_S].set(True)
    return expert_G, weight_GT, member_GT


def token_tiles(v_XTK: jax.Array, convert: str) -> jax.Array:
    """[X, T, K] -> [X, K // TILE_K, GROUPS, 8, GROUP_K] bf16: per tile and scale group, the (up to 8) tokens' values
    of that group's columns in the wgmma operand's column order, the missing tokens zero."""
    x, t, k = v_XTK.shape
    v = jnp.pad(input_order(v_XTK.astype(jnp.bfloat16), convert), ((0, 0), (0, 8 - t), (0, 0)))
    return jnp.transpose(v.reshape(x, 8, k // TILE_K, GROUPS, GROUP_K), (0, 2, 3, 1, 4))


def _tile_product(w_smem, s_smem, b_smem, acc, interpret: bool, convert: str):
    """acc[r, t] += sum over groups g of s[r, g] * (sum over k of group g of q[r, k] * b[g, t, k]): one weight tile,
    converted once, against all tokens; one wgmma (K = GROUP_K, N = 8 tokens) per scale group."""
    w = _operand_A(w_smem, interpret, convert)
    if interpret:
        b, s = b_smem[...], s_smem[...].astype(jnp.float32)
        for g in range(GROUPS):
            p = jax.lax.dot_general(w[:, g * GROUP_K:(g + 1) * GROUP_K], b[g], (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
            acc = acc + p * s[:, g:g + 1]
        return acc

    def products(*acc_refs):
        for g, acc_ref in enumerate(acc_refs):
            plgpu.wgmma(acc_ref, w[:, g * GROUP_K:(g + 1) * GROUP_K], plgpu.transpose_ref(b_smem.at[g], (1, 0)))
        plgpu.wgmma_wait(0)
        return tuple(acc_ref[...] for acc_ref in acc_refs)

    ps = pl.run_scoped(products, *(plgpu.ACC((ROWS, 8), jnp.float32) for _ in range(GROUPS)))
    # each row's scale of group g, broadcast over the tokens: picked out of the [ROWS, GROUPS] tile by a one-hot
    # mask and a sum along the row (a strided load of the tile's column is refused: "cannot apply swizzle to
    # non-contiguous refs", jax 0.11.2)
    s = plgpu.load(s_smem, (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    col = plgpu.broadcasted_iota(jnp.int32, (ROWS, GROUPS), 1, layout=plgpu.Layout.WGMMA)
    for g, p in enumerate(ps):
        s_g = jnp.sum(s * (col == g).astype(jnp.float32), axis=1)
        acc = acc + p * jax.lax.broadcast_in_dim(s_g, (ROWS, 8), (0,))
    return acc


def _b_spec(interpret: bool, index, lead: tuple = ()):
    return plgpu.BlockSpec((*lead, None, GROUPS, 8, GROUP_K), index, transforms=_transforms(16, GROUP_K, interpret))


def _one_token_tile(acc_RG, token, interpret: bool):
    """moe_wgmma's per-group partial sums [ROWS, GROUPS] of one token -> a [ROWS, 8] tile holding their sum in
    column `token`, zeros elsewhere (the layout of the grouped path's tiles)."""
    v = jnp.sum(acc_RG, axis=1)
    if interpret:
        return v[:, None] * (jnp.arange(8)[None, :] == token).astype(jnp.float32)
    col = plgpu.broadcasted_iota(jnp.int32, (ROWS, 8), 1, layout=plgpu.Layout.WGMMA)
    return jax.lax.broadcast_in_dim(v, (ROWS, 8), (0,)) * (col == token).astype(jnp.float32)


def _run_paths(paths, e, tok, one_token, tokens) -> None:
    """Each path this kernel holds, for its groups: `one_token` where the group has one member, `tokens` where it
    has several (`token_G` < 0); the groups beyond the step's count (e < 0) are skipped. A path left out is not
    compiled, so its registers and shared memory are not reserved."""
    if "one" in paths:
        pl.when((e >= 0) & (tok >= 0))(one_token)
    if "tokens" in paths:
        pl.when((e >= 0) & (tok < 0))(tokens)


def _gate_up_kernel(expert_ref, token_ref, xt_ref, xbd_ref, gq_ref, gs_ref, uq_ref, us_ref, gu_ref, *, n_k, stages,
                    convert, paths, interpret):
    """gu[split, 0 / 1, group, rows, token]: the tokens' gate / up rows of the group's expert over the split's
    share of H (only the groups' member tokens are read afterwards), for the groups of the `paths` it holds."""
    g, rb, split = jax.lax.axis_index("group"), jax.lax.axis_index("rows"), jax.lax.axis_index("split")
    e, tok = expert_ref[g], token_ref[g]
    _, w, s = _specs(interpret, None, lambda k: (rb, split * n_k + k))
    weights = (gq_ref.at[e], gs_ref.at[e], uq_ref.at[e], us_ref.at[e])

    def store(acc_g, acc_u):
        _store_rows(acc_g, gu_ref.at[split, 0, g, pl.ds(rb * ROWS, ROWS)])
        _store_rows(acc_u, gu_ref.at[split, 1, g, pl.ds(rb * ROWS, ROWS)])

    def _one_token():  # moe_wgmma's slot path: the one token's block-diagonal B, 8 scale groups as the N columns
        b, _, _ = _specs(interpret, lambda k: (split * n_k + k, 0, 0), lambda k: (0, 0))

        def step(_, xbd_smem, gq_smem, gs_smem, uq_smem, us_smem, carry):
            return _tile_products(((gq_smem, gs_smem), (uq_smem, us_smem)), xbd_smem, carry, interpret,
                                  convert=convert)

        acc_g, acc_u = plgpu.emit_pipeline(step, grid=(n_k,), in_specs=[b, w, s, w, s], max_concurrent_steps=stages,
                                           init_carry=(_zeros(interpret), _zeros(interpret)))(xbd_ref.at[tok], *weights)
        store(_one_token_tile(acc_g, tok, interpret), _one_token_tile(acc_u, tok, interpret))

    def _tokens():  # all tokens as the N columns, one wgmma per scale group
        b = _b_spec(interpret, lambda k: (split * n_k + k, 0, 0, 0))

        def step(_, xt_smem, gq_smem, gs_smem, uq_smem, us_smem, carry):
            acc_g, acc_u = carry  # one gate tile, then one up tile: one converted operand live at a time
            acc_g = _tile_product(gq_smem, gs_smem, xt_smem, acc_g, interpret, convert)
            return acc_g, _tile_product(uq_smem, us_smem, xt_smem, acc_u, interpret, convert)

        store(*plgpu.emit_pipeline(step, grid=(n_k,), in_specs=[b, w, s, w, s], max_concurrent_steps=stages,
                                   init_carry=(_zeros(interpret, 8), _zeros(interpret, 8)))(xt_ref, *weights))

    _run_paths(paths, e, tok, _one_token, _tokens)


def _down_kernel(expert_ref, token_ref, ht_ref, hbd_ref, dq_ref, ds_ref, y_ref, *, n_k, stages, convert, paths,
                 interpret):
    """y[group, rows, token]: the group's expert's down rows applied to each token's (weighted, zero for
    non-members) h."""
    rb, g = jax.lax.axis_index("rows"), jax.lax.axis_index("group")
    e, tok = expert_ref[g], token_ref[g]
    _, w, s = _specs(interpret, None, lambda k: (e, rb, k), lead=(None,))

    def _one_token():
        b, _, _ = _specs(interpret, lambda k: (g, k, 0, 0), lambda k: (0, 0, 0), lead=(None,))

        def step(_, hbd_smem, dq_smem, ds_smem, acc):
            return _tile_products(((dq_smem, ds_smem),), hbd_smem, (acc,), interpret, convert=convert)[0]

        acc = plgpu.emit_pipeline(step, grid=(n_k,), in_specs=[b, w, s], max_concurrent_steps=stages,
                                  init_carry=_zeros(interpret))(hbd_ref, dq_ref, ds_ref)
        _store_rows(_one_token_tile(acc, tok, interpret), y_ref.at[g, pl.ds(rb * ROWS, ROWS)])

    def _tokens():
        b = _b_spec(interpret, lambda k: (g, k, 0, 0, 0), lead=(None,))

        def step(_, ht_smem, dq_smem, ds_smem, acc):
            return _tile_product(dq_smem, ds_smem, ht_smem, acc, interpret, convert)

        acc = plgpu.emit_pipeline(step, grid=(n_k,), in_specs=[b, w, s], max_concurrent_steps=stages,
                                  init_carry=_zeros(interpret, 8))(ht_ref, dq_ref, ds_ref)
        _store_rows(acc, y_ref.at[g, pl.ds(rb * ROWS, ROWS)])

    _run_paths(paths, e, tok, _one_token, _tokens)


# How the two paths are compiled (`routed_experts_grouped(paths=...)`): both in each kernel (run 17's measured
# version), the tokens path alone for every group (run 17's second version), or each path in a kernel of its own
# (independent kernels, which CONCURRENT graph scheduling may overlap; not measured yet)
PATH_LAYOUTS = ("both", "tokens", "split")


def routed_experts_grouped(x_TH, experts, ids_TK, weights_TK, *, stages: int = STAGES, gate_up_splits: int = 1,
                           convert: str = "pairs", paths: str = "both", interpret: bool = False) -> jax.Array:
    """Same contract as `model.moe.experts_gather` for INT4 experts (`supports(experts)`), T <= GROUPED_MAX_TOKENS.

    `gate_up_splits` splits H across gate_up programs (their partial sums meet in the XLA fusion that applies
    SiLU); the down kernel's per-group sums are added by XLA. `paths`: one of PATH_LAYOUTS."""
    _check_convert(convert)
    if paths not in PATH_LAYOUTS:
        raise ValueError(f"moe_wgmma_grouped paths must be one of {PATH_LAYOUTS}, not {paths!r}")
    if not supports(experts):
        raise ValueError(f"moe_wgmma_grouped takes INT4 experts with bf16 scales of group size {TILE_K // GROUPS} and "
                         f"dims in whole {TILE_K}-wide tiles, got gate {experts.gate.shape}")
    t, hidden = x_TH.shape
    if t > GROUPED_MAX_TOKENS:
        raise ValueError(f"moe_wgmma_grouped takes up to {GROUPED_MAX_TOKENS} tokens, got {t}")
    if (hidden // TILE_K) % gate_up_splits:
        raise ValueError(f"gate_up_splits={gate_up_splits} must divide the {hidden // TILE_K} tiles of H")
    f = experts.gate.shape[1]
    expert_G, weight_GT, member_GT = expert_groups(ids_TK, weights_TK)
    groups = expert_G.shape[0]
    # a group with one member token takes the slot path (its B one token's block-diagonal rows): at random routing
    # most groups have one member, and the tokens path's per-group scale picking costs ALU time there
    token_G = jnp.where(jnp.sum(member_GT, axis=1) == 1, jnp.argmax(member_GT, axis=1), -1).astype(jnp.int32)
    if paths == "tokens":
        token_G = jnp.full_like(token_G, -1)
    kernels = {"both": (("one", "tokens"),), "tokens": (("tokens",),), "split": (("one",), ("tokens",))}[paths]

    def each_kernel(body, out_type, group_axis, grid, grid_names, *args):
        """The kernel once per path set, the results merged by group (a group's rows come from the kernel that
        holds its path; the other kernel never wrote them)."""
        outs = [plgpu.kernel(functools.partial(body, stages=stages, convert=convert, paths=held, interpret=interpret),
                             out_type=out_type, grid=grid, grid_names=grid_names, **_interpret_kw(interpret))(*args)
                for held in kernels]
        if len(outs) == 1:
            return outs[0]
        shape = [1] * out_type.ndim
        shape[group_axis] = groups
        return jnp.where((token_G >= 0).reshape(shape), outs[0], outs[1])

    n_k = hidden // TILE_K // gate_up_splits
    gu = each_kernel(functools.partial(_gate_up_kernel, n_k=n_k),
                     jax.ShapeDtypeStruct((gate_up_splits, 2, groups, f, 8), jnp.float32), 2,
                     (groups, f // ROWS, gate_up_splits), ("group", "rows", "split"),
                     expert_G, token_G, token_tiles(x_TH[None], convert)[0], _wgmma_input(x_TH, convert),
                     *_operands(experts.gate), *_operands(experts.up))
    g_GTF, u_GTF = (jnp.swapaxes(m, 1, 2)[:, :t] for m in _sum_leading(gu))
    # where, not a product: a skipped group's rows were never written
    h_GTF = jnp.where(member_GT[..., None], jax.nn.silu(g_GTF) * u_GTF * weight_GT[..., None], 0.0)
    h_GF = jnp.sum(h_GTF, axis=1)  # a one-member group's h (the other tokens' rows are zero)
    y_GHT = each_kernel(functools.partial(_down_kernel, n_k=f // TILE_K),
                        jax.ShapeDtypeStruct((groups, hidden, 8), jnp.float32), 0,
                        (hidden // ROWS, groups), ("rows", "group"),
                        expert_G, token_G, token_tiles(h_GTF, convert), _wgmma_input(h_GF, convert),
                        *_operands(experts.down))
    y_HT = jnp.sum(jnp.where((expert_G >= 0)[:, None, None], y_GHT, 0.0), axis=0)
    return y_HT[:, :t].T.astype(x_TH.dtype)
