"""moe_wgmma's two kernels with persistent programs: each program streams a run of consecutive work items through
ONE TMA pipeline, so a program ramps its pipeline once, not once per item (a Mosaic GPU kernel for Hopper).

Plain reference: `model.moe.experts_gather`. The work items are moe_wgmma's programs (gate_up: slot, block of 64 F
rows, split of H; down: block of 64 H rows, token, split of the choices, split of F) in the same order; program p of
P takes items p * n .. p * n + n - 1 (n = ceil(items / P); the last program's run is clamped to the last item, which
it then computes again and stores the same sums). Inside the pipeline the step's position in its item resets the
accumulators at the item's first step and stores them at its last, while the next item's tiles are already in
flight. Why: at one token the engine's programs run 4 steps each (1792 programs a kernel, 2 stages in flight), and
its kernels stream at 3.0-3.4 TB/s (run 19) where the lm_head GEMV reads 4.3. Not dispatched by the engine:
bench/moe_wgmma_lab.py's `P:` variants time it beside moe_wgmma.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from model.kernels.moe_wgmma import (ROWS, TILE_K, _check_convert, _interpret_kw, _operands, _specs, _sum_leading,
                                     _tile_products, _wgmma_input, _zeros, check_down_splits, store_rows_via, supports,
                                     swiglu_h)


def _run(items: int, programs: int, steps: int):
    """(items a program, pipeline grid, item_of) for `items` items of `steps` pipeline steps each over `programs`
    programs; item_of(p, j) = (item, step within it) of program p's step j."""
    per = math.ceil(items / programs)

    def item_of(p, j):
        return jnp.minimum(p * per + j // steps, items - 1), j % steps

    return per, (per * steps,), item_of


def _restart(accs, first):
    """The accumulators, zeroed at an item's first step (a multiply, so no branch over register arrays)."""
    keep = jnp.where(first, 0.0, 1.0).astype(jnp.float32)
    return tuple(a * keep for a in accs)


def _gate_up_kernel(expert_ref, xbd_ref, gq_ref, gs_ref, uq_ref, us_ref, gu_ref, *, n_k, rows, splits, items,
                    programs, choices, stages, convert, interpret):
    p = jax.lax.axis_index("p")
    _, grid, item_of = _run(items, programs, n_k)

    def where(j):  # (slot, row block, split, k) of step j
        i, k = item_of(p, j)
        return i // (rows * splits), i // splits % rows, i % splits, k

    def b_index(j):
        slot, _, split, k = where(j)
        return slot // choices, split * n_k + k, 0, 0

    def ws_index(j):
        slot, rb, split, k = where(j)
        return expert_ref[slot], rb, split * n_k + k

    b, w, s = _specs(interpret, b_index, ws_index, lead=(None,))

    def body(v_smem):
        def step(idx, xbd_smem, gq_smem, gs_smem, uq_smem, us_smem, carry):
            slot, rb, split, k = where(idx[0])
            carry = _restart(carry, k == 0)
            acc_g, acc_u = _tile_products(((gq_smem, gs_smem), (uq_smem, us_smem)), xbd_smem, carry, interpret,
                                          convert=convert)

            @pl.when(k == n_k - 1)
            def _():
                for gate_or_up, acc in enumerate((acc_g, acc_u)):
                    out = gu_ref.at[split, gate_or_up, slot, pl.ds(rb * ROWS, ROWS)]
                    store_rows_via(jnp.sum(acc, axis=1), v_smem, out)

            return acc_g, acc_u

        plgpu.emit_pipeline(step, grid=grid, in_specs=[b, w, s, w, s], max_concurrent_steps=stages,
                            init_carry=(_zeros(interpret), _zeros(interpret)))(xbd_ref, gq_ref, gs_ref, uq_ref, us_ref)

    pl.run_scoped(body, plgpu.SMEM((ROWS,), jnp.float32))


def _down_kernel(expert_ref, hbd_ref, dq_ref, ds_ref, y_ref, *, n_k, tokens, choices, splits, k_splits, items,
                 programs, stages, convert, interpret):
    p = jax.lax.axis_index("p")
    per_split = choices // splits
    _, grid, item_of = _run(items, programs, per_split * n_k)

    def where(j):  # (row block, token, split, share of F, choice within the split, k) of step j
        i, step = item_of(p, j)
        rb, rest = i // (tokens * splits * k_splits), i % (tokens * splits * k_splits)
        t, split, ks = rest // (splits * k_splits), rest // k_splits % splits, rest % k_splits
        return rb, t, split, ks, step // n_k, step % n_k

    def b_index(j):
        _, t, split, ks, c, kk = where(j)
        return t * choices + split * per_split + c, ks * n_k + kk, 0, 0

    def ws_index(j):
        rb, t, split, ks, c, kk = where(j)
        return expert_ref[t * choices + split * per_split + c], rb, ks * n_k + kk

    b, w, s = _specs(interpret, b_index, ws_index, lead=(None,))

    def body(v_smem):
        def step(idx, hbd_smem, dq_smem, ds_smem, carry):
            rb, t, split, ks, c, kk = where(idx[0])
            (acc,) = _restart((carry,), (c == 0) & (kk == 0))
            acc = _tile_products(((dq_smem, ds_smem),), hbd_smem, (acc,), interpret, convert=convert)[0]

            @pl.when((c == per_split - 1) & (kk == n_k - 1))
            def _():
                out = y_ref.at[split * k_splits + ks, t, pl.ds(rb * ROWS, ROWS)]
                store_rows_via(jnp.sum(acc, axis=1), v_smem, out)

            return acc

        plgpu.emit_pipeline(step, grid=grid, in_specs=[b, w, s], max_concurrent_steps=stages,
                            init_carry=_zeros(interpret))(hbd_ref, dq_ref, ds_ref)

    pl.run_scoped(body, plgpu.SMEM((ROWS,), jnp.float32))


def gate_up_sums(x_TH, gate, up, expert_U, *, choices: int, programs: int, stages: int, splits: int = 1,
                 convert: str = "pairs", interpret: bool = False) -> jax.Array:
    """moe_wgmma.gate_up_sums' [splits, 2, U, F] f32 from `programs` persistent programs."""
    _check_convert(convert)
    hidden, slots, f = x_TH.shape[1], expert_U.shape[0], gate.shape[1]
    if (hidden // TILE_K) % splits:
        raise ValueError(f"gate_up_splits={splits} must divide the {hidden // TILE_K} tiles of H")
    if slots != choices * x_TH.shape[0]:
        raise ValueError(f"{slots} slots are not {choices} choices for each of {x_TH.shape[0]} tokens")
    items = slots * (f // ROWS) * splits
    return plgpu.kernel(
        functools.partial(_gate_up_kernel, n_k=hidden // TILE_K // splits, rows=f // ROWS, splits=splits,
                          items=items, programs=programs, choices=choices, stages=stages, convert=convert,
                          interpret=interpret),
        out_type=jax.ShapeDtypeStruct((splits, 2, slots, f), jnp.float32),
        grid=(programs,), grid_names=("p",),
        **_interpret_kw(interpret),
    )(expert_U, _wgmma_input(x_TH, convert), *_operands(gate), *_operands(up))


def down_sums(h_UF, down, expert_U, *, choices: int, programs: int, stages: int, splits: int = 2,
              k_splits: int = 1, convert: str = "pairs", interpret: bool = False) -> jax.Array:
    """moe_wgmma.down_sums' [splits * k_splits, T, H] f32 from `programs` persistent programs."""
    _check_convert(convert)
    slots, f = h_UF.shape
    check_down_splits(choices, splits, f, k_splits)
    t, hidden = slots // choices, down.shape[1]
    items = (hidden // ROWS) * t * splits * k_splits
    return plgpu.kernel(
        functools.partial(_down_kernel, n_k=f // TILE_K // k_splits, tokens=t, choices=choices, splits=splits,
                          k_splits=k_splits, items=items, programs=programs, stages=stages, convert=convert,
                          interpret=interpret),
        out_type=jax.ShapeDtypeStruct((splits * k_splits, t, hidden), jnp.float32),
        grid=(programs,), grid_names=("p",),
        **_interpret_kw(interpret),
    )(expert_U, _wgmma_input(h_UF, convert), *_operands(down))


def routed_experts_persistent(x_TH, experts, ids_TK, weights_TK, *, programs: int = 132, stages: int = 4,
                              down_programs: int | None = None, down_stages: int | None = None,
                              gate_up_splits: int = 1, down_splits: int = 2, down_k_splits: int = 1,
                              convert: str = "pairs", interpret: bool = False) -> jax.Array:
    """Same contract as `model.moe.experts_gather` for INT4 experts (`moe_wgmma.supports`); the splits as in
    `moe_wgmma.routed_experts_wgmma` (they set the work items, which the programs then share)."""
    if not supports(experts):
        raise ValueError(f"moe_wgmma_persistent takes moe_wgmma's INT4 experts, got gate {experts.gate.shape}")
    if programs < 1 or (down_programs is not None and down_programs < 1):
        raise ValueError(f"programs={programs} / down_programs={down_programs} must be at least 1")
    t, k = ids_TK.shape
    check_down_splits(k, down_splits, experts.down.shape[2], down_k_splits)  # before the first kernel runs
    expert_U = ids_TK.reshape(t * k).astype(jnp.int32)
    gu_S2UF = gate_up_sums(x_TH, experts.gate, experts.up, expert_U, choices=k, programs=programs, stages=stages,
                           splits=gate_up_splits, convert=convert, interpret=interpret)
    h_UF = swiglu_h(gu_S2UF, weights_TK)
    y_STH = down_sums(h_UF, experts.down, expert_U, choices=k, programs=down_programs or programs,
                      stages=down_stages or stages, splits=down_splits, k_splits=down_k_splits, convert=convert,
                      interpret=interpret)
    return _sum_leading(y_STH).astype(x_TH.dtype)
