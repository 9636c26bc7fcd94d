"""Routed experts in ONE Mosaic GPU kernel, gate_up through down, for decode (one token): Pallas (Hopper).

Plain reference: `model.moe.experts_gather`. moe_wgmma.py runs two kernels (gate_up, then down) with XLA's SiLU
and layouts between them; at one token each kernel is short (~40 and ~22 us), so each pays its own start and
tail (Nsight Compute, bench/results/ncu/ncu-1505-t1-splits.txt), and the fusions between them cost a few us.

Here a program owns one slot (token, choice) and one block of 64 F rows, and needs no other program's result:
1. gate / up: its 64 rows of both over all of H, the same TMA pipeline and wgmma tiles as moe_wgmma's gate_up;
2. h = SiLU(gate) * up * router weight for its 64 rows, written into shared memory as the next product's B;
3. down: the 64 F columns of down that h multiplies, for every H row, then added into y by TMA reduce-add.
Nothing waits across programs (no grid barrier), so it holds under the CPU interpreter too.

For (3) to run on the same [64, 256] int4 tiles, down is stored once in its own layout (`fused_down_layout`):
F block b's tile row R holds H rows 4R .. 4R + 3, 64 F values each. A tile's wgmma then multiplies 256 H rows by
the block's 64 F values, its N = 8 columns being (H row 4R + g // 2, half g % 2 of the 64): group g's scale is
that H row's scale of that 32-wide half, and y gets the two halves' sum. The F values within a block are
stored in the inverse of `permute_K`'s order, so after `_nibble_pairs` the wgmma's column order is h's own:
B's rows are h itself, not a permutation of it. B = [256, 16] ([K, N]: Mosaic swizzles no 16-byte rows, so 8
columns of zeros pad it): rows 64j .. 64j + 63 hold h in column 2j (first 32) and 2j + 1 (last 32), zeros elsewhere.

y is [T, H / 256, 64, 8] f32, zeros before the kernel; every program adds each down tile's [64, 8] share by a TMA
reduce-add as soon as the tile is done (float addition in the order the programs land: not bitwise deterministic
across runs). Under the interpreter (no TMA reductions) each program stores its shares to its own row and XLA adds
them.

Measured on the H200 (bench/results/README.md, run 19): correct (rel_err 5.1e-3 against the reference, as the
two kernels), but slower than moe_wgmma's two kernels at one token: 65.6-68 us for the kernel alone in Nsight
Compute (2.9-3.06 TB/s) against 62.4 for the two, 74-79 us a layer call in the lab against 66-69. At one token
there are only 256 programs (8 slots x 32 F blocks), about two warpgroups an SM, where the two kernels keep four
(registers cap them there); the warps stall on their loads (long scoreboard) more than on issue: the biased
conversion (one instruction fewer a pair) cut issued instructions by a fifth and did not shorten the kernel, and
with no conversion at all (`convert="none"`, a diagnostic) it still takes 64-66 us. The engine does not dispatch it
(`model.kernels`); it stays as the measured one-kernel design.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from model.kernels.moe_wgmma import (BIAS, GROUPS, ROWS, STAGES, TILE_K, _interpret_kw, _operand_A, _specs,
                                     _tile_products, _transforms, _wgmma_input, _zeros, int4_nibbles,
                                     supports)
from model.quant import Int4Weight

F_BLOCK = ROWS  # F rows a program owns: gate_up's wgmma M
SEGMENTS = TILE_K // F_BLOCK  # H rows side by side in one fused-down tile row
# down's B is stored [K, N] (h comes out of the accumulator row-wise), which Mosaic swizzles from 32-byte rows on:
# N = 16 bf16 columns, the last 8 zeros
B_COLS = 16
REDUCE_RING = 4  # down tiles whose reduce-adds may be in flight at once (shared-memory buffers of 2 KB)
DOWN_STAGES = 8  # a down step streams 9 KB against gate_up's 22, so twice the steps keep as many bytes in flight


def fused_down_layout(down: Int4Weight) -> Int4Weight:
    """down [E, H, F] -> [E, F / 64, H / 4, 256] int4 (+ scales [E, F / 64, H / 4, 8]): the fused kernel's tiles.

    Row R of F block b holds H rows 4R + j (j = 0..3), each its 64 F values of the block in the inverse of
    `permute_K`'s order; scale column 2j + c is H row 4R + j's scale of the block's c-th 32 values. One expert at
    a time (lax.map), so converting a 384-expert layer holds one expert's nibbles unpacked, not the layer's."""
    e, h, f = down.shape
    g = down.group_size
    if h % SEGMENTS or f % F_BLOCK or F_BLOCK % g or down.scale.shape[-1] != f // g:
        raise ValueError(f"fused_down_layout takes down [E, H, F] with H a multiple of {SEGMENTS}, F of {F_BLOCK} "
                         f"and {F_BLOCK} a multiple of the group size, got {down.shape} in groups of {g}")
    inverse = np.argsort(_permute_K_numpy(np.arange(F_BLOCK)))  # stored column s holds value inverse[s]

    def one(packed_HW):
        shifts = jnp.arange(8, dtype=jnp.uint32) * 4
        q_HF = ((packed_HW[..., None] >> shifts) & 0xF).reshape(h, f)  # nibble c of word w is value 8w + c
        q = q_HF.reshape(h // SEGMENTS, SEGMENTS, f // F_BLOCK, F_BLOCK)[..., inverse]
        q = q.transpose(2, 0, 1, 3).reshape(f // F_BLOCK, h // SEGMENTS, TILE_K // 8, 8)
        return jnp.sum(q << shifts, axis=-1, dtype=jnp.uint32)  # disjoint bits: the sum is the OR

    packed = jax.lax.map(one, down.packed)
    per_block = F_BLOCK // g
    scale = down.scale.reshape(e, h // SEGMENTS, SEGMENTS, f // F_BLOCK, per_block)
    scale = scale.transpose(0, 3, 1, 2, 4).reshape(e, f // F_BLOCK, h // SEGMENTS, SEGMENTS * per_block)
    return Int4Weight(packed, scale)


def check_down_fused(experts, down_fused: Int4Weight, kernel: str) -> None:
    """`kernel` takes these INT4 experts (`supports`) and `down_fused` is `fused_down_layout(experts.down)`'s shape."""
    if not supports(experts):
        raise ValueError(f"{kernel} takes INT4 experts with bf16 scales of group size {TILE_K // GROUPS} and dims in "
                         f"whole {TILE_K}-wide tiles, got gate {experts.gate.shape}")
    e, f, hidden = experts.gate.shape
    want = (e, f // F_BLOCK, hidden // SEGMENTS, TILE_K)
    if down_fused.shape != want:
        raise ValueError(f"{kernel}: down_fused is {down_fused.shape}, expected {want} "
                         f"(fused_down_layout of down {experts.down.shape})")


def _permute_K_numpy(v: np.ndarray) -> np.ndarray:
    """`permute_K` on a host array (a constant of the layout, not traced)."""
    return np.moveaxis(v.reshape(-1, 4, 2, 4), -1, -3).reshape(v.shape)


def _h_as_B(h, j: int, interpret: bool):
    """Rows 64j .. 64j + 63 of B ([64, 16] in the accumulator's layout): h[m] in column 2j + (m >= 32)."""
    shape = (F_BLOCK, B_COLS)
    if interpret:
        row, col = jax.lax.broadcasted_iota(jnp.int32, shape, 0), jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    else:
        row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
        col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    half = (row >= F_BLOCK // 2).astype(jnp.int32)
    keep = (col == 2 * j + half).astype(jnp.float32)
    return (jax.lax.broadcast_in_dim(h, shape, (0,)) * keep).astype(jnp.bfloat16)


def _group_sums_x(x_TH: jax.Array) -> jax.Array:
    """[T, H / TILE_K, GROUPS] f32: BIAS * the sum of each scale group of x as the wgmma sees it (bf16): what the
    biased operand (q + BIAS) adds to each group's product of a gate_up step."""
    t, h = x_TH.shape
    xb = x_TH.astype(jnp.bfloat16).astype(jnp.float32).reshape(t, h // TILE_K, GROUPS, TILE_K // GROUPS)
    return BIAS * jnp.sum(xb, axis=-1)


def _broadcast_rows(c_smem, interpret: bool):
    """A step's [GROUPS] correction as a [ROWS, GROUPS] array in the accumulator's layout."""
    if interpret:
        return jnp.broadcast_to(c_smem[...][None, :], (ROWS, GROUPS))
    c = plgpu.load(c_smem, (), layout=plgpu.Layout.WGMMA.reduce(0))
    return jax.lax.broadcast_in_dim(c, (ROWS, GROUPS), (1,))


def _B_group_sums(b_smem, interpret: bool):
    """[ROWS, GROUPS] f32: BIAS * the column sums of down's B ([TILE_K, B_COLS]) in every row, by one wgmma with an
    operand of ones (B is fixed for the whole down phase)."""
    if interpret:
        sums = jnp.sum(b_smem[...].astype(jnp.float32), axis=0)[:GROUPS]
        return BIAS * jnp.broadcast_to(sums[None, :], (ROWS, GROUPS))
    ones = plgpu.layout_cast(jnp.full((ROWS, TILE_K), 1.0, jnp.bfloat16), plgpu.Layout.WGMMA)

    def product(acc_ref):
        plgpu.wgmma(acc_ref, ones, b_smem)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    return BIAS * pl.run_scoped(product, plgpu.ACC((ROWS, B_COLS), jnp.float32))[:, :GROUPS]


def _down_tiles(w_smem, s_smem, b_smem, tiles: int, interpret: bool, c=None, interleave: bool = False,
                convert: str = "pairs") -> list:
    """[64, 8] f32 per fused-down tile of the step: s[R, g] * sum over k of group g of q[R, k] * B[k, g] (minus c, the
    biased operand's share, when given). The tiles' operands are all converted before their wgmmas (`interleave`:
    each while the previous tile's wgmma runs); one wait covers them (registers are spare at ~2 programs an SM)."""
    rows = [pl.ds(i * ROWS, ROWS) for i in range(tiles)]
    operand = lambda r: _operand_A(w_smem.at[r], interpret, convert, biased=c is not None)  # noqa: E731
    ws = [] if interleave and not interpret else [operand(r) for r in rows]
    if interpret:
        ps = [jnp.dot(w, b_smem[...], preferred_element_type=jnp.float32)[:, :GROUPS] for w in ws]
        ps = ps if c is None else [p - c for p in ps]
        return [p * s_smem[r].astype(jnp.float32) for p, r in zip(ps, rows)]

    def products(*acc_refs):
        for i, acc_ref in enumerate(acc_refs):
            plgpu.wgmma(acc_ref, operand(rows[i]) if interleave else ws[i], b_smem)
        plgpu.wgmma_wait(0)
        return tuple(acc_ref[...] for acc_ref in acc_refs)

    ps = pl.run_scoped(products, *(plgpu.ACC((ROWS, B_COLS), jnp.float32) for _ in rows))
    ps = [p[:, :GROUPS] for p in ps] if c is None else [p[:, :GROUPS] - c for p in ps]
    return [p * plgpu.load(s_smem.at[r], (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
            for p, r in zip(ps, rows)]


def _fused_kernel(expert_ref, weight_ref, xbd_ref, xsum_ref, gq_ref, gs_ref, uq_ref, us_ref, dq_ref, ds_ref, y_ref, *,
                  n_k, n_h, choices, stages, down_stages, overlap, down_tiles, biased, convert, interpret):
    slot, fb = jax.lax.axis_index("slot"), jax.lax.axis_index("fblock")
    e, t = expert_ref[slot], slot // choices

    # 1. gate / up rows of F block fb over all of H
    b, w, s = _specs(interpret, lambda k: (k, 0, 0), lambda k: (fb, k))

    def gate_up(xsum_smem, bar):
        if biased:  # the token's group sums for every step, in one copy (too small for one copy a step)
            plgpu.copy_gmem_to_smem(xsum_ref.at[t], xsum_smem, bar)
            plgpu.barrier_wait(bar)

        def gate_up_step(idx, xbd_smem, gq_smem, gs_smem, uq_smem, us_smem, carry):
            tiles = ((gq_smem, gs_smem), (uq_smem, us_smem))
            if biased:  # both tiles converted first, one wait (overlap 1), whatever `overlap` says: as measured
                c = _broadcast_rows(xsum_smem.at[idx[0]], interpret)
                return _tile_products(tiles, xbd_smem, carry, interpret, 1, convert, c)
            return _tile_products(tiles, xbd_smem, carry, interpret, overlap, convert)

        return plgpu.emit_pipeline(gate_up_step, grid=(n_k,), in_specs=[b, w, s, w, s], max_concurrent_steps=stages,
                                   init_carry=(_zeros(interpret), _zeros(interpret)))(
            xbd_ref.at[t], gq_ref.at[e], gs_ref.at[e], uq_ref.at[e], us_ref.at[e])

    acc_g, acc_u = pl.run_scoped(gate_up, plgpu.SMEM((n_k, GROUPS), jnp.float32), plgpu.Barrier())

    # 2. h of the block's 64 rows, the router weight folded in
    g, u = jnp.sum(acc_g, axis=1), jnp.sum(acc_u, axis=1)
    h = g / (1.0 + jnp.exp(-g)) * u * weight_ref[slot]

    # 3. down's columns of the block for all H rows, each tile's share reduce-added into y as it is done
    def down(b_smem, y_smem):
        for j in range(SEGMENTS):
            b_smem[pl.ds(j * F_BLOCK, F_BLOCK), :] = _h_as_B(h, j, interpret)
        if not interpret:
            plgpu.commit_smem()
        c_down = _B_group_sums(b_smem, interpret) if biased else None
        rows = down_tiles * ROWS
        w_d = plgpu.BlockSpec((rows, TILE_K), lambda n: (n, 0), transforms=_transforms(4, TILE_K, interpret))
        s_d = plgpu.BlockSpec((rows, GROUPS), lambda n: (n, 0))

        def down_step(idx, dq_smem, ds_smem):
            n = idx[0]
            ys = _down_tiles(dq_smem, ds_smem, b_smem, down_tiles, interpret, c_down, interleave=overlap == 2,
                             convert=convert)
            tiles = pl.ds(n * down_tiles, down_tiles)
            if interpret:  # no TMA reductions there: the shares go to the program's own row
                for i, y in enumerate(ys):
                    y_smem[0, i] = y
                plgpu.copy_smem_to_gmem(y_smem.at[0], y_ref.at[slot, fb, tiles])
                plgpu.wait_smem_to_gmem(0)
                return
            ring = n % REDUCE_RING
            plgpu.wait_smem_to_gmem(REDUCE_RING - 1, wait_read_only=True)  # this ring slot's last store has read it
            for i, y in enumerate(ys):
                y_smem[ring, i] = y
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(y_smem.at[ring], y_ref.at[t, tiles], reduction_op="add")

        plgpu.emit_pipeline(down_step, grid=(n_h // down_tiles,), in_specs=[w_d, s_d],
                            max_concurrent_steps=down_stages)(
            dq_ref.at[e, fb], ds_ref.at[e, fb])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(down, plgpu.SMEM((TILE_K, B_COLS), jnp.bfloat16, transforms=_transforms(16, B_COLS, interpret)),
                  plgpu.SMEM((REDUCE_RING, down_tiles, ROWS, GROUPS), jnp.float32))


def routed_experts_fused(x_TH, experts, down_fused: Int4Weight, ids_TK, weights_TK, *, stages: int = STAGES,
                         down_stages: int = DOWN_STAGES, overlap: int = 1, down_tiles: int = 2,
                         biased: bool = False, convert: str = "pairs", interpret: bool = False) -> jax.Array:
    """Same contract as `model.moe.experts_gather` for INT4 experts (`supports(experts)`); `down_fused` is
    `fused_down_layout(experts.down)`, laid out once when the weights are loaded. `overlap`: gate_up converts both
    tiles of a step before one wait (moe_wgmma's `overlap`; 2: each tile converted while the previous tile's wgmma
    runs, down's tiles too); `down_tiles`: fused-down tiles a down step streams; `biased`: the int4 operands enter
    the wgmma as q + BIAS (one instruction fewer per pair of values) and each product subtracts BIAS * its input's
    group sums (gate_up: from XLA, down: one wgmma of ones against h's B); `convert`: "pairs", or "none" for the
    diagnostic without int4 conversion (wrong results)."""
    if convert not in ("pairs", "none"):
        raise ValueError(f"moe_wgmma_fused convert must be 'pairs' or 'none' (the diagnostic), not {convert!r}")
    check_down_fused(experts, down_fused, "moe_wgmma_fused")
    _, f, hidden = experts.gate.shape
    t, k = ids_TK.shape
    n_h = hidden // TILE_K
    if n_h % down_tiles:
        raise ValueError(f"moe_wgmma_fused down_tiles={down_tiles} must divide the {n_h} tiles of H")
    expert_U = ids_TK.reshape(t * k).astype(jnp.int32)
    weight_U = weights_TK.reshape(t * k).astype(jnp.float32)
    body = functools.partial(_fused_kernel, n_k=hidden // TILE_K, n_h=n_h, choices=k, stages=stages,
                             down_stages=down_stages, overlap=overlap, down_tiles=down_tiles, biased=biased,
                             convert=convert, interpret=interpret)
    mesh = plgpu.Mesh(grid=(t * k, f // F_BLOCK), grid_names=("slot", "fblock"))
    operands = (expert_U, weight_U, _wgmma_input(x_TH, "pairs"), _group_sums_x(x_TH), int4_nibbles(experts.gate),
                experts.gate.scale,
                int4_nibbles(experts.up), experts.up.scale, int4_nibbles(down_fused), down_fused.scale)
    if interpret:  # every program's share in its own row, added here
        y = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((t * k, f // F_BLOCK, n_h, ROWS, GROUPS), jnp.float32),
                         grid=mesh.grid, grid_names=mesh.grid_names, **_interpret_kw(True))(*operands)
        y_TQ = jnp.sum(y.reshape(t, k * (f // F_BLOCK), n_h * ROWS * GROUPS), axis=1)
    else:  # one buffer of zeros that every program reduce-adds into (a Ref passed to the kernel is aliased)
        y_ref = jax.new_ref(jnp.zeros((t, n_h, ROWS, GROUPS), jnp.float32))
        pl.kernel(body, out_type=(), mesh=mesh, name="moe_wgmma_fused")(*operands, y_ref)
        y_TQ = y_ref[...].reshape(t, n_h * ROWS * GROUPS)
    # column 8R + g of tile n is H row 256n + 4R + g // 2, half g % 2
    return jnp.sum(y_TQ.reshape(t, hidden, 2), axis=-1).astype(x_TH.dtype)
