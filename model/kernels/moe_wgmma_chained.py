"""Routed experts in ONE launch: moe_wgmma's gate_up programs, then down programs that wait for their slot's sums.

Plain reference: `model.moe.experts_gather`. moe_wgmma.py runs gate_up and down as two kernels with XLA's split sum,
SiLU and h's layout between them: at one token the down kernel starts only after gate_up's last program (its tail,
a launch, down's ramp), and h's layout is a launch of its own. Here one grid holds both:
- programs 0 .. G - 1 are gate_up's (slot, block of 64 F rows, split of H), moe_wgmma's pipeline and tiles; each
  adds its gate / up sums into gu by a TMA reduce-add, then signals its slot's semaphore (one per slot and share
  of F);
- then down's (slot, share of F, block of 64 H rows), slot slowest. Each waits until every gate_up program of its
  slot and share has signalled, then builds down's B from gu: h = SiLU(g) * u * router weight, [256, 16] a tile
  (`_h_as_B`: rows 64j .. 64j + 63 hold h's values of groups 2j, 2j + 1 in columns 2j, 2j + 1). Either each down
  program builds each tile's B itself, or (`h_programs`) one program per slot and share builds them once, between
  gate_up's programs and down's, and down's programs stream them as moe_wgmma's down kernel streams h.
So down's programs take the SMs as gate_up's drain, and h costs no launch of its own. (moe_wgmma_fused.py, the
other one-kernel design, kept every program independent and had 256 programs at one token; this one keeps the two
kernels' 1792 + 1792.)

Waiting across programs holds because a 1-D grid's blocks are handed out in order: every gate_up program holds an
SM or has finished before any down program can wait (CUTLASS's serial split-K relies on the same). The CPU
interpreter runs programs one after another in grid order, so there the waits are left out; it has no TMA
reductions either, so there gu keeps one row per split and the readers add them.

B as h itself needs down's tiles converted in h's own column order: in order (moe_wgmma's convert="mosaic"), or by
nibble pairs when gate's and up's rows are stored in the pairs' order (`permute_gate_up_rows`, a layout the engine's
weights do not have).

Measured on the H200 (bench/results/README.md, run 20): correct (rel_err 5.1e-3 against the reference, as the two
kernels), slower at one token. Nsight Compute, the kernel alone: 74.2-75.7 us in order, 69.1-70.0 by pairs,
70.8-72.6 with h programs, against 61-62.6 for moe_wgmma's two kernels; a layer call 77-86 us against 66-70. One
kernel has one register count for both phases: gate_up's 128 a thread allow 4 programs an SM, where the down kernel
alone runs with 95 and 5, so down streams slower inside it; B built in every down program costs 9M instructions
more (37.4M against 28.5M for the two kernels), built once 2M (30.5M), and h programs put their build on the path
from gate_up's last program to down's. The engine does not dispatch it (`model.kernels`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from model.kernels.moe_wgmma import (GROUPS, ROWS, STAGES, TILE_K, _interpret_kw, _operands, _specs, _store_rows,
                                     _sum_leading, _tile_products, _transforms, _wgmma_input, _zeros, permute_K,
                                     supports)
from model.kernels.moe_wgmma_fused import B_COLS, SEGMENTS, _down_tiles, _h_as_B
from model.quant import Int4Weight


def _fence_proxy_async_global():
    """Orders this thread's generic-proxy accesses to global memory with its TMA (async-proxy) ones: between a
    completed TMA reduce-add and the semaphore's release, and between the semaphore's acquire and a TMA load."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm

    @plgpu.inline_mgpu()
    def fence(_):
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.proxy.async.global;", "", has_side_effects=True)

    fence()


def _gate_up_program(p, expert_ref, xbd_ref, gq_ref, gs_ref, uq_ref, us_ref, gu_ref, sems, *, n_k, f_blocks,
                     splits, blocks_per_share, k_splits, choices, stages, interpret):
    """moe_wgmma's gate_up program (slot, 64 F rows, split of H): its sums added into gu, then its share signalled."""
    slot, rest = p // (f_blocks * splits), p % (f_blocks * splits)
    rb, split = rest // splits, rest % splits
    e, t = expert_ref[slot], slot // choices
    b, w, s = _specs(interpret, lambda k: (split * n_k + k, 0, 0), lambda k: (rb, split * n_k + k))

    def step(_, xbd_smem, gq_smem, gs_smem, uq_smem, us_smem, carry):
        return _tile_products(((gq_smem, gs_smem), (uq_smem, us_smem)), xbd_smem, carry, interpret)

    acc_g, acc_u = plgpu.emit_pipeline(step, grid=(n_k,), in_specs=[b, w, s, w, s], max_concurrent_steps=stages,
                                       init_carry=(_zeros(interpret), _zeros(interpret)))(
        xbd_ref.at[t], gq_ref.at[e], gs_ref.at[e], uq_ref.at[e], us_ref.at[e])
    per_tile = TILE_K // ROWS
    tile, rows = rb // per_tile, pl.ds((rb % per_tile) * ROWS, ROWS)

    def store(gu_smem):
        gu_smem[0] = jnp.sum(acc_g, axis=1)
        gu_smem[1] = jnp.sum(acc_u, axis=1)
        plgpu.commit_smem()
        if interpret:
            plgpu.copy_smem_to_gmem(gu_smem, gu_ref.at[split, :, slot, tile, rows])
            plgpu.wait_smem_to_gmem(0)
            return
        plgpu.copy_smem_to_gmem(gu_smem, gu_ref.at[:, slot, tile, rows], reduction_op="add")
        plgpu.wait_smem_to_gmem(0)  # the reduce-add has landed, not only read its buffer
        _fence_proxy_async_global()
        plgpu.semaphore_signal(sems.at[slot * k_splits + rb // blocks_per_share], 1, memory_scope="gpu")

    pl.run_scoped(store, plgpu.SMEM((2, ROWS), jnp.float32))


def _h_program(r, weight_ref, gu_ref, hb_ref, sems, h_sems, *, share_tiles, k_splits, splits, blocks_per_share,
               interpret):
    """B of every down tile of one slot's share of F, written once for all the share's down programs to stream."""
    slot, ks = r // k_splits, r % k_splits
    tiles = pl.ds(ks * share_tiles, share_tiles)
    w_slot = weight_ref[slot]

    def build(gu_smem, b_smem, bar):
        _load_gu(gu_ref, gu_smem, bar, slot, tiles, None if interpret else sems.at[r], blocks_per_share * splits,
                 interpret)
        for n in range(share_tiles):
            _build_B(gu_smem, b_smem.at[n], n, w_slot, interpret)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(b_smem, hb_ref.at[slot, tiles])
        plgpu.wait_smem_to_gmem(0)
        if not interpret:
            _fence_proxy_async_global()
            plgpu.semaphore_signal(h_sems.at[r], 1, memory_scope="gpu")

    pl.run_scoped(build, plgpu.SMEM(_gu_smem_shape(splits, share_tiles, interpret), jnp.float32),
                  plgpu.SMEM((share_tiles, TILE_K, B_COLS), jnp.bfloat16,
                             transforms=_transforms(16, B_COLS, interpret)),
                  plgpu.Barrier())


def _down_streamed_program(q, expert_ref, dq_ref, ds_ref, hb_ref, y_ref, h_sems, *, h_blocks, share_tiles, k_splits,
                           choices, down_stages, down_convert, interpret):
    """moe_wgmma's down program over one slot's share of F, its B streamed from the h program's tiles."""
    slot, rest = q // (k_splits * h_blocks), q % (k_splits * h_blocks)
    ks, rb = rest // h_blocks, rest % h_blocks
    e, t, c = expert_ref[slot], slot // choices, slot % choices
    if not interpret:
        plgpu.semaphore_wait(h_sems.at[slot * k_splits + ks], 1, decrement=False, memory_scope="gpu")
        _fence_proxy_async_global()
    b = plgpu.BlockSpec((None, None, TILE_K, B_COLS), lambda k: (slot, ks * share_tiles + k, 0, 0),
                        transforms=_transforms(16, B_COLS, interpret))
    w, s = _down_specs(rb, ks * share_tiles, interpret)

    def step(_, hb_smem, dq_smem, ds_smem, acc):
        [y] = _down_tiles(dq_smem, ds_smem, hb_smem, 1, interpret, convert=down_convert)
        return acc + y

    acc = plgpu.emit_pipeline(step, grid=(share_tiles,), in_specs=[b, w, s], max_concurrent_steps=down_stages,
                              init_carry=_zeros(interpret))(hb_ref, dq_ref.at[e], ds_ref.at[e])
    _store_rows(jnp.sum(acc, axis=1), y_ref.at[c * k_splits + ks, t, pl.ds(rb * ROWS, ROWS)])


def _load_gu(gu_ref, gu_smem, bar, slot, tiles, sem, signals: int, interpret: bool):
    """gu of one slot's share of F into shared memory, once all `signals` gate_up programs of it have signalled
    `sem`."""
    if interpret:  # earlier programs ran to completion; one row of gu per gate_up split
        plgpu.copy_gmem_to_smem(gu_ref.at[:, :, slot, tiles], gu_smem, bar)
    else:
        plgpu.semaphore_wait(sem, signals, decrement=False, memory_scope="gpu")
        _fence_proxy_async_global()
        plgpu.copy_gmem_to_smem(gu_ref.at[:, slot, tiles], gu_smem, bar)
    plgpu.barrier_wait(bar)


def _build_B(gu_smem, b_smem, n, w_slot, interpret: bool):
    """down's B ([256, 16], `_h_as_B`) of tile n of the share: h = SiLU(g) * u * router weight."""
    for j in range(SEGMENTS):
        g, u = (_gu_rows(gu_smem, i, n, j, interpret) for i in (0, 1))
        b_smem[pl.ds(j * ROWS, ROWS), :] = _h_as_B(g / (1.0 + jnp.exp(-g)) * u * w_slot, j, interpret)


def _down_specs(rb, k0, interpret: bool):
    """BlockSpecs of down's (weight, scales) tiles for H row block rb, F tiles k0, k0 + 1, .. of the share."""
    w = plgpu.BlockSpec((ROWS, TILE_K), lambda k: (rb, k0 + k), transforms=_transforms(4, TILE_K, interpret))
    return w, plgpu.BlockSpec((ROWS, GROUPS), lambda k: (rb, k0 + k))


def _gu_smem_shape(splits: int, share_tiles: int, interpret: bool) -> tuple:
    return (splits, 2, share_tiles, TILE_K) if interpret else (2, share_tiles, TILE_K)


def _down_program(q, expert_ref, weight_ref, dq_ref, ds_ref, gu_ref, y_ref, sems, *, h_blocks, share_tiles,
                  k_splits, splits, blocks_per_share, choices, down_stages, down_convert, interpret):
    """A down program (slot, share of F, 64 H rows) that builds each tile's B from gu in the step multiplying it."""
    slot, rest = q // (k_splits * h_blocks), q % (k_splits * h_blocks)
    ks, rb = rest // h_blocks, rest % h_blocks
    e, t, c = expert_ref[slot], slot // choices, slot % choices
    tiles = pl.ds(ks * share_tiles, share_tiles)
    w_slot = weight_ref[slot]

    def down(gu_smem, b_smem, bar):
        w, s = _down_specs(rb, ks * share_tiles, interpret)

        def step(idx, dq_smem, ds_smem, acc):
            n = idx[0]

            @pl.when(n == 0)  # after the pipeline has asked for its first tiles: they stream in while this waits
            def _():
                _load_gu(gu_ref, gu_smem, bar, slot, tiles, None if interpret else sems.at[slot * k_splits + ks],
                         blocks_per_share * splits, interpret)

            _build_B(gu_smem, b_smem, n, w_slot, interpret)  # (the previous tile's wgmma has completed)
            if not interpret:
                plgpu.commit_smem()
            [y] = _down_tiles(dq_smem, ds_smem, b_smem, 1, interpret, convert=down_convert)
            return acc + y

        acc = plgpu.emit_pipeline(step, grid=(share_tiles,), in_specs=[w, s], max_concurrent_steps=down_stages,
                                  init_carry=_zeros(interpret))(dq_ref.at[e], ds_ref.at[e])
        _store_rows(jnp.sum(acc, axis=1), y_ref.at[c * k_splits + ks, t, pl.ds(rb * ROWS, ROWS)])

    pl.run_scoped(down, plgpu.SMEM(_gu_smem_shape(splits, share_tiles, interpret), jnp.float32),
                  plgpu.SMEM((TILE_K, B_COLS), jnp.bfloat16, transforms=_transforms(16, B_COLS, interpret)),
                  plgpu.Barrier())


def _gu_rows(gu_smem, i: int, n: int, j: int, interpret: bool):
    """[64] f32: gate (i = 0) or up (1) rows 64j .. 64j + 63 of tile n of the share, in the accumulator's row layout."""
    cols = pl.ds(j * ROWS, ROWS)
    if interpret:
        return jnp.sum(gu_smem[:, i, n, cols], axis=0)
    return plgpu.load(gu_smem.at[i, n, cols], (), layout=plgpu.Layout.WGMMA.reduce(1))


def permute_gate_up_rows(experts):
    """The experts with gate's and up's rows (F) in `permute_K` order within each 32 (scales alike; down unchanged):
    F is internal to an expert, so a kernel that reads these computes the same function as long as the position of
    h it hands down is read as that order (what `gate_up_rows_permuted` tells routed_experts_chained)."""
    def rows(w: Int4Weight) -> Int4Weight:
        return Int4Weight(jnp.swapaxes(permute_K(jnp.swapaxes(w.packed, 1, 2)), 1, 2),
                          jnp.swapaxes(permute_K(jnp.swapaxes(w.scale, 1, 2)), 1, 2))
    return dataclasses.replace(experts, gate=rows(experts.gate), up=rows(experts.up))


def _chained_kernel(expert_ref, weight_ref, xbd_ref, gq_ref, gs_ref, uq_ref, us_ref, dq_ref, ds_ref, gu_ref, y_ref,
                    hb_ref, *, n_gate_up, shares, h_programs, gate_up, h, down, interpret):
    p = jax.lax.axis_index("program")
    sems = h_sems = None
    if not interpret:
        sems = pl.get_global(plgpu.SemaphoreType.REGULAR((shares,)))
        h_sems = pl.get_global(plgpu.SemaphoreType.REGULAR((shares,))) if h_programs else None

    @pl.when(p < n_gate_up)
    def _():
        _gate_up_program(p, expert_ref, xbd_ref, gq_ref, gs_ref, uq_ref, us_ref, gu_ref, sems, **gate_up)

    if not h_programs:
        @pl.when(p >= n_gate_up)
        def _():
            _down_program(p - n_gate_up, expert_ref, weight_ref, dq_ref, ds_ref, gu_ref, y_ref, sems, **down)
        return

    @pl.when((p >= n_gate_up) & (p < n_gate_up + shares))
    def _():
        _h_program(p - n_gate_up, weight_ref, gu_ref, hb_ref, sems, h_sems, **h)

    @pl.when(p >= n_gate_up + shares)
    def _():
        _down_streamed_program(p - n_gate_up - shares, expert_ref, dq_ref, ds_ref, hb_ref, y_ref, h_sems, **down)


def routed_experts_chained(x_TH, experts, ids_TK, weights_TK, *, stages: int = STAGES, down_stages: int = STAGES,
                           gate_up_splits: int = 7, down_k_splits: int = 2, gate_up_rows_permuted: bool = False,
                           h_programs: bool = False, interpret: bool = False) -> jax.Array:
    """Same contract as `model.moe.experts_gather` for INT4 experts (`supports(experts)`). `gate_up_splits` splits
    H across gate_up programs (moe_wgmma's), `down_k_splits` F across down programs (each a share of F for one slot
    and 64 H rows); stages: each phase's pipeline depth. `gate_up_rows_permuted`: gate's and up's rows are stored in
    `permute_K` order within each 32 (`permute_gate_up_rows`), so gu comes out in the column order of down's
    nibble-pair conversion and down's tiles take it (fewer instructions than the in-order conversion). `h_programs`:
    one program per slot and share builds its down tiles' B once (after gate_up's programs, before down's) and
    down's programs stream it as moe_wgmma's down kernel streams h; otherwise every down program builds each B
    itself."""
    if not supports(experts):
        raise ValueError(f"moe_wgmma_chained takes INT4 experts with bf16 scales of group size {TILE_K // GROUPS} and "
                         f"dims in whole {TILE_K}-wide tiles, got gate {experts.gate.shape}")
    _, f, hidden = experts.gate.shape
    h_tiles, f_tiles = hidden // TILE_K, f // TILE_K
    if h_tiles % gate_up_splits:
        raise ValueError(f"moe_wgmma_chained gate_up_splits={gate_up_splits} must divide the {h_tiles} tiles of H")
    if f_tiles % down_k_splits:
        raise ValueError(f"moe_wgmma_chained down_k_splits={down_k_splits} must divide the {f_tiles} tiles of F")
    t, k = ids_TK.shape
    slots, f_blocks, h_blocks = t * k, f // ROWS, hidden // ROWS
    # what a program waits for: the gate_up programs of one slot's share of F
    waits = dict(k_splits=down_k_splits, splits=gate_up_splits, blocks_per_share=f_blocks // down_k_splits,
                 interpret=interpret)
    share_tiles = f_tiles // down_k_splits
    gate_up = dict(n_k=h_tiles // gate_up_splits, f_blocks=f_blocks, stages=stages, choices=k, **waits)
    h = dict(share_tiles=share_tiles, **waits)
    down = dict(h_blocks=h_blocks, share_tiles=share_tiles, k_splits=down_k_splits, choices=k, down_stages=down_stages,
                down_convert="pairs" if gate_up_rows_permuted else "mosaic", interpret=interpret)
    if not h_programs:  # each down program waits on gate_up itself
        down.update(waits)
    n_gate_up, shares = slots * f_blocks * gate_up_splits, slots * down_k_splits
    programs = n_gate_up + (shares if h_programs else 0) + shares * h_blocks
    body = functools.partial(_chained_kernel, n_gate_up=n_gate_up, shares=shares, h_programs=h_programs,
                             gate_up=gate_up, h=h, down=down, interpret=interpret)
    expert_U = ids_TK.reshape(slots).astype(jnp.int32)
    weight_U = weights_TK.reshape(slots).astype(jnp.float32)
    operands = (expert_U, weight_U, _wgmma_input(x_TH, "pairs"), *_operands(experts.gate), *_operands(experts.up),
                *_operands(experts.down))
    y_struct = jax.ShapeDtypeStruct((k * down_k_splits, t, hidden), jnp.float32)
    hb_struct = jax.ShapeDtypeStruct((slots, f_tiles, TILE_K, B_COLS), jnp.bfloat16)  # written by the h programs
    if interpret:  # gu per split (no TMA reductions there): an output the down programs read back
        gu_struct = jax.ShapeDtypeStruct((gate_up_splits, 2, slots, f_tiles, TILE_K), jnp.float32)
        _, y, _ = plgpu.kernel(body, out_type=(gu_struct, y_struct, hb_struct), grid=(programs,),
                               grid_names=("program",), **_interpret_kw(True))(*operands)
    else:  # gu: zeros that every gate_up program reduce-adds into (a Ref passed to the kernel is aliased)
        gu_ref = jax.new_ref(jnp.zeros((2, slots, f_tiles, TILE_K), jnp.float32))
        mesh = plgpu.Mesh(grid=(programs,), grid_names=("program",))
        y, _ = pl.kernel(body, out_type=(y_struct, hb_struct), mesh=mesh, name="moe_wgmma_chained")(*operands, gu_ref)
    return _sum_leading(y).astype(x_TH.dtype)
