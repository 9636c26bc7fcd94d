"""Routed experts for verify steps with the slots grouped by expert: each selected expert's weights are read and
dequantized once for all the tokens that chose it. Pallas Mosaic GPU (Hopper), built from moe_wgmma.py's tiles.

Plain reference: `model.moe.experts_gather`. moe_wgmma.py runs one program row per slot (token, choice): when
several of a verify step's tokens choose one expert, each slot streams and converts that expert's tiles again
(the repeats may come from L2, but the int4 -> bf16 conversion, which bounds the kernel, is paid per slot). The
eight-layer step on the H200 showed what that costs (bench/results/README.md, run 17): from the fifth layer on the
random model's four verify tokens chose nearly the same experts (8-10 unique of 32 slots), and each such layer
took 305 us against 118 us of unique-expert bytes (2.6x), as long as a layer whose 32 slots hit 28 experts.

Here a program row is one group: an expert that at least one token chose (`expert_groups`, in sorted order; the
groups beyond the step's count are skipped at once). Its B operand holds the block-diagonal inputs of all T
tokens ([T * GROUPS, TILE_K] a step, one TMA), and each converted weight tile goes through T wgmmas, one per
token, so the conversion is paid once per expert. Tokens that did not choose the expert get products that
nobody reads: their h is zeroed before the down kernel, whose per-group sums XLA adds up over the groups.
The tensor cores do T x 8 times the needed multiplies; they have the headroom (moe_wgmma.py). What grows with T
is the B operand every program streams from L2 (T x 4 KB a step against the weights' 18 KB), so T is capped
(`GROUPED_MAX_TOKENS`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from model.kernels.moe_wgmma import (GROUPS, ROWS, STAGES, TILE_K, _check_convert, _interpret_kw, _operand_A,
                                     _operands, _specs, _store_rows, _sum_leading, _zeros, block_diagonal_SNGK,
                                     input_order, supports)

# T wgmmas per weight tile and 2 x T accumulators of [ROWS, GROUPS] (4 registers a thread each) per program
GROUPED_MAX_TOKENS = 8


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


def _token_products(w_smem, s_smem, b_smem, accs, interpret: bool, convert: str):
    """accs[t][r, g] += s[r, g] * (sum over k of group g of q[r, k] * b[t * GROUPS + g, k]): one weight tile,
    converted once, against each token's block of B."""
    w = _operand_A(w_smem, interpret, convert)
    if interpret:
        b, s = b_smem[...], s_smem[...].astype(jnp.float32)
        return tuple(acc + jax.lax.dot_general(w, b[GROUPS * t:GROUPS * (t + 1)], (((1,), (1,)), ((), ())),
                                               preferred_element_type=jnp.float32) * s
                     for t, acc in enumerate(accs))

    def products(*acc_refs):
        for t, acc_ref in enumerate(acc_refs):
            plgpu.wgmma(acc_ref, w, plgpu.transpose_ref(b_smem.at[pl.ds(GROUPS * t, GROUPS)], (1, 0)))
        plgpu.wgmma_wait(0)
        return tuple(acc_ref[...] for acc_ref in acc_refs)

    ps = pl.run_scoped(products, *(plgpu.ACC((ROWS, GROUPS), jnp.float32) for _ in accs))
    s = plgpu.load(s_smem, (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    return tuple(acc + p * s for acc, p in zip(accs, ps))


def _b_spec(interpret: bool, tokens: int, index, lead: tuple = ()):
    from model.kernels.moe_wgmma import _transforms

    return plgpu.BlockSpec((*lead, None, tokens * GROUPS, TILE_K), index, transforms=_transforms(16, TILE_K, interpret))


def _gate_up_kernel(expert_ref, xbd_ref, gq_ref, gs_ref, uq_ref, us_ref, gu_ref, *, n_k, tokens, stages, convert,
                    interpret):
    """gu[split, 0 / 1, group, token, rows]: every token's gate / up rows of the group's expert over the split's
    share of H (only the groups' member tokens are read afterwards)."""
    g, rb, split = jax.lax.axis_index("group"), jax.lax.axis_index("rows"), jax.lax.axis_index("split")
    e = expert_ref[g]

    @pl.when(e >= 0)
    def _():
        _, w, s = _specs(interpret, None, lambda k: (rb, split * n_k + k))
        b = _b_spec(interpret, tokens, lambda k: (split * n_k + k, 0, 0))

        def step(_, xbd_smem, gq_smem, gs_smem, uq_smem, us_smem, carry):
            acc_g, acc_u = carry  # one gate tile, then one up tile: one converted operand live at a time
            acc_g = _token_products(gq_smem, gs_smem, xbd_smem, acc_g, interpret, convert)
            return acc_g, _token_products(uq_smem, us_smem, xbd_smem, acc_u, interpret, convert)

        zeros = tuple(_zeros(interpret) for _ in range(tokens))
        acc_g, acc_u = plgpu.emit_pipeline(step, grid=(n_k,), in_specs=[b, w, s, w, s], max_concurrent_steps=stages,
                                           init_carry=(zeros, zeros))(
            xbd_ref, gq_ref.at[e], gs_ref.at[e], uq_ref.at[e], us_ref.at[e])
        for t in range(tokens):
            _store_rows(jnp.sum(acc_g[t], axis=1), gu_ref.at[split, 0, g, t, pl.ds(rb * ROWS, ROWS)])
            _store_rows(jnp.sum(acc_u[t], axis=1), gu_ref.at[split, 1, g, t, pl.ds(rb * ROWS, ROWS)])


def _down_kernel(expert_ref, hbd_ref, dq_ref, ds_ref, y_ref, *, n_k, tokens, stages, convert, interpret):
    """y[group, token, rows]: the group's expert's down rows applied to each token's (weighted, zero for
    non-members) h."""
    rb, g = jax.lax.axis_index("rows"), jax.lax.axis_index("group")
    e = expert_ref[g]

    @pl.when(e >= 0)
    def _():
        _, w, s = _specs(interpret, None, lambda k: (e, rb, k), lead=(None,))
        b = _b_spec(interpret, tokens, lambda k: (g, k, 0, 0), lead=(None,))

        def step(_, hbd_smem, dq_smem, ds_smem, carry):
            return _token_products(dq_smem, ds_smem, hbd_smem, carry, interpret, convert)

        acc = plgpu.emit_pipeline(step, grid=(n_k,), in_specs=[b, w, s], max_concurrent_steps=stages,
                                  init_carry=tuple(_zeros(interpret) for _ in range(tokens)))(hbd_ref, dq_ref, ds_ref)
        for t in range(tokens):
            _store_rows(jnp.sum(acc[t], axis=1), y_ref.at[g, t, pl.ds(rb * ROWS, ROWS)])


def _block_diagonal_tokens(v_XTK: jax.Array, convert: str) -> jax.Array:
    """[X, T, K] -> [X, K // TILE_K, T * GROUPS, TILE_K]: each tile's B holds the T tokens' block-diagonal rows."""
    x, t, k = v_XTK.shape
    bd = block_diagonal_SNGK(input_order(v_XTK.reshape(x * t, k), convert))  # [X*T, tiles, GROUPS, TILE_K]
    bd = bd.reshape(x, t, k // TILE_K, GROUPS, TILE_K)
    return jnp.swapaxes(bd, 1, 2).reshape(x, k // TILE_K, t * GROUPS, TILE_K)


def routed_experts_grouped(x_TH, experts, ids_TK, weights_TK, *, stages: int = STAGES, gate_up_splits: int = 1,
                           convert: str = "pairs", interpret: bool = False) -> jax.Array:
    """Same contract as `model.moe.experts_gather` for INT4 experts (`supports(experts)`), T <= GROUPED_MAX_TOKENS.

    `gate_up_splits` splits H across gate_up programs (their partial sums meet in the XLA fusion that applies
    SiLU); the down kernel's per-group sums are added by XLA."""
    _check_convert(convert)
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
    xbd = _block_diagonal_tokens(x_TH[None], convert)[0]  # [tiles of H, T * GROUPS, TILE_K], shared by all programs
    n_k = hidden // TILE_K // gate_up_splits
    gu = plgpu.kernel(
        functools.partial(_gate_up_kernel, n_k=n_k, tokens=t, stages=stages, convert=convert, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((gate_up_splits, 2, groups, t, f), jnp.float32),
        grid=(groups, f // ROWS, gate_up_splits), grid_names=("group", "rows", "split"),
        **_interpret_kw(interpret),
    )(expert_G, xbd, *_operands(experts.gate), *_operands(experts.up))
    g_GTF, u_GTF = _sum_leading(gu)
    # where, not a product: a skipped group's rows were never written
    h_GTF = jnp.where(member_GT[..., None], jax.nn.silu(g_GTF) * u_GTF * weight_GT[..., None], 0.0)
    y_GTH = plgpu.kernel(
        functools.partial(_down_kernel, n_k=f // TILE_K, tokens=t, stages=stages, convert=convert,
                          interpret=interpret),
        out_type=jax.ShapeDtypeStruct((groups, t, hidden), jnp.float32),
        grid=(hidden // ROWS, groups), grid_names=("rows", "group"),
        **_interpret_kw(interpret),
    )(expert_G, _block_diagonal_tokens(h_GTF, convert), *_operands(experts.down))
    y_TH = jnp.sum(jnp.where((expert_G >= 0)[:, None, None], y_GTH, 0.0), axis=0)
    return y_TH.astype(x_TH.dtype)
