"""Fused routed experts for decode and verify with TMA-pipelined INT4 tiles: Pallas Mosaic GPU (Hopper).

Plain reference: `model.moe.experts_gather`. Same slots as moe_gemv.py's "pairs" (one slot per (token, choice)):
gate_up over (slot, block of 64 F rows, split of H), then down over (block of 64 H rows, token, split of its
choices, split of F); XLA adds the splits' partial sums.
Why another kernel: the Triton gemv kernels dequantize in registers while their own loads are in flight, so
the registers of the dequantization cap the loads in flight (Nsight Compute, run 10: 96-128 registers a
thread, 23-30% occupancy, 3.0-3.1 TB/s). Here the TMA engine streams the weight tiles into shared memory
`stages` steps ahead, which costs no registers, and the warpgroup dequantizes the landed tile.

The products run on tensor cores as one wgmma per tile with the weights as the register operand A and a
block-diagonal B: B[g, k] = x[k] if k lies in group g of the tile (`block_diagonal_SNGK`, built by XLA), so the
wgmma's N = 8 columns are the tile's eight per-group partial dot products P[r, g]. The group scales are
then one [64, 8] tile in the accumulator's own layout: acc += P * s, summed over g once at the end.
With one token per slot the tensor cores do 8x the needed multiplies, which they have to spare; the
bytes of B (4 KB a step, shared by every program of the token) come from L2.

The int4 -> bf16 conversion is what bounds the kernel (Nsight Compute: the ALU pipe the busiest, 67% with
Mosaic's own conversion). `convert="pairs"` (the default, `_nibble_pairs`) leaves each lane its own 32-bit
words and turns nibbles (p, p + 4) of a word into one bf16 pair with a shift and a LOP3, so the wgmma sees the
tile's columns in a fixed permuted order (`permute_K`), which XLA applies to B as well. `convert="mosaic"`
(flip bit 3, relayout to WGMMA, Mosaic's signed upcast) is the in-order baseline: T=4 267 vs 252 us.

Interpret mode (CPU, `interpret=True`) runs the same kernels under Pallas' GPU interpreter; its wgmma takes
no register operand, so there the product is a dot_general on the permuted tile and the shared-memory tiles
carry no swizzle.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from model.quant import Int4Weight

ROWS = 64  # wgmma M: weight rows per program
TILE_K = 256  # int4 elements per pipeline step: 128 bytes a row, one 128-byte swizzle span
GROUPS = 8  # scale groups per step at group size 32: the wgmma N
STAGES = 2  # pipeline steps in flight; more (3, 4, 6) measured slower: shared memory limits programs per SM


def supports(experts) -> bool:
    """Shapes this kernel takes: INT4 experts with bf16 scales of group size TILE_K / GROUPS (the scale tiles are
    streamed as they are stored) and rows, columns in whole TILE_K tiles (so in whole ROWS blocks too)."""
    if not isinstance(experts.gate, Int4Weight):
        return False
    _, f, h = experts.gate.shape
    mats = (experts.gate, experts.up, experts.down)
    return (all(m.group_size == TILE_K // GROUPS and m.scale.dtype == jnp.bfloat16 for m in mats)
            and f % TILE_K == 0 and h % TILE_K == 0)


def int4_nibbles(w: Int4Weight) -> jax.Array:
    """[.., out, in // 8] uint32 words -> [.., out, in] int4 holding q + 8 (the same bytes, no copy intended)."""
    q = jax.lax.bitcast_convert_type(w.packed, jnp.int4)  # little-endian: nibble j of word c is element 8c + j
    return q.reshape(*w.packed.shape[:-1], w.packed.shape[-1] * 8)


def block_diagonal_SNGK(v_SK: jax.Array) -> jax.Array:
    """[S, K] -> [S, K // TILE_K, GROUPS, TILE_K] bf16: tile n's row g holds v where k's group within the tile
    is g, zeros elsewhere (each pipeline step's B is one [GROUPS, TILE_K] block).

    Built by padding and reshapes, not by a mask over a broadcast (which would repeat SiLU's exp 8 times): each
    output element reads at most one input element, so with one gate_up split XLA fuses the SiLU into this
    layout (6 launches a layer call instead of 7 at four tokens). With the engine's four splits it still launches
    the split sum + SiLU apart; there the two layouts time the same within the runs' spread (lab, A/B/A in one
    call: bench/results/moe-wgmma-lab-gpu-20261130-0329, -0330 and run12-ab-old-layout.log). Each pipeline
    step's B is one contiguous 4 KB block."""
    s, k = v_SK.shape
    width, tiles = TILE_K // GROUPS, k // TILE_K
    v = v_SK.astype(jnp.bfloat16).reshape(s, tiles, GROUPS, width)
    # flattened, a tile's [GROUPS, TILE_K] block holds group g at g * (width + TILE_K): each group, then TILE_K zeros
    padded = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, TILE_K))).reshape(s, tiles, GROUPS * (width + TILE_K))
    return padded[:, :, :GROUPS * TILE_K].reshape(s, tiles, GROUPS, TILE_K)


def _transforms(bits: int, cols: int, interpret: bool):
    if interpret:
        return ()
    swizzle = plgpu.find_swizzle(cols * bits, "tile")
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def permute_K(v: jax.Array) -> jax.Array:
    """The column order in which `_nibble_pairs` hands a tile's values to the wgmma, within each 32 columns.

    Thread lane j of a row holds the 32-bit word of columns 32c + 8j .. 32c + 8j + 7 (WGMMA_UPCAST_4X); pair p of
    that word (nibbles p and p + 4) becomes the wgmma register of columns 32c + 8p + 2j + {0, 1}. So wgmma column
    32c + 8p + 2j + e holds original column 32c + 8j + p + 4e; the inputs are laid out the same way."""
    *lead, n = v.shape
    v = v.reshape(*lead, n // 32, 4, 2, 4)  # (c, j, e, p) of original column 32c + 8j + 4e + p
    return jnp.moveaxis(v, -1, -3).reshape(*lead, n)  # -> (c, p, j, e)


# `_nibble_pairs(biased=True)` leaves out the subtraction: each value enters the wgmma as q + BIAS (exact in bf16), and
# the caller subtracts BIAS * (the sum of B over the group) from each group's product
BIAS = 136


def _nibble_pairs(w, biased: bool = False, half: int | None = None):
    """[ROWS, TILE_K] int4 words of q + 8 in WGMMA_UPCAST_4X -> bf16 q in the WGMMA layout, columns in `permute_K`
    order. Per 32-bit word (8 values): 3 shifts and 4 LOP3 put the nibble pairs (p, p + 4) under a bf16 exponent
    as 128 + n, 4 packed subtractions of 136 give q. No cross-lane shuffle: each lane keeps its own words (the
    in-order relayout to WGMMA costs shuffles, and Mosaic's signed upcast needs a PRMT per pair). `half` (0 / 1):
    only columns 128 * half .. + 127, a [ROWS, TILE_K / 2] operand (half the registers)."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    cols = TILE_K if half is None else TILE_K // 2
    first = 0 if half is None else half * cols // 32  # the first 32-column tile converted

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
                       return_type=plgpu.ShapeDtypeStruct((ROWS, cols), jnp.bfloat16, layout=plgpu.Layout.WGMMA))
    def convert(_, words):
        i32 = ir.IntegerType.get_signless(32)
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        out = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((ROWS, cols)), dtype=object)
        for idx, reg in np.ndenumerate(words.registers):  # idx = (0, 32-column tile, 0, 0, row half, 0, 0, 0, 0)
            if not first <= idx[1] < first + cols // 32:
                continue
            word = mgpu_utils.bitcast(reg, i32)
            for p in range(4):
                src = word if p == 0 else arith.shrui(word, arith.constant(i32, 4 * p))
                asm = ("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;" if biased else
                       "{ .reg .b32 t, b; lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA; mov.b32 b, 0x43084308; "
                       "sub.bf16x2 $0, t, b; }")
                pair = llvm.inline_asm(i32, [src], asm, "=r,r")
                out[(0, 4 * (idx[1] - first) + p, 0, 0, idx[4], 0, 0, 0, 0)] = mgpu_utils.bitcast(pair, bf16x2)
        return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return convert(w)


def _operand_A(w_smem, interpret: bool, convert: str, biased: bool = False):
    """The wgmma's register operand: bf16 q of a [ROWS, TILE_K] tile (q + BIAS if `biased`, "pairs" only), columns in
    `permute_K` order."""
    if convert == "none":  # diagnostic, wrong results: ones in place of the tile, which is streamed and never read
        ones = jnp.ones((ROWS, TILE_K), jnp.bfloat16)
        return ones if interpret else plgpu.layout_cast(ones, plgpu.Layout.WGMMA)
    if interpret:  # the interpreter takes the plain value path (no layouts): same numbers, same column order
        q = (w_smem[...] ^ jnp.int4(-8)).astype(jnp.float32) + (BIAS if biased else 0)
        return input_order(q.astype(jnp.bfloat16), convert)
    w = plgpu.load(w_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
    if convert == "pairs":
        return _nibble_pairs(w, biased)
    # "mosaic": flip bit 3 to two's complement, Mosaic's relayout to WGMMA and signed int4 -> bf16 upcast; in
    # order, so the caller lays the inputs out unpermuted (see `input_order`)
    w = w ^ jnp.int4(-8)
    return plgpu.layout_cast(w, plgpu.Layout.WGMMA).astype(jnp.bfloat16)


def input_order(v: jax.Array, convert: str) -> jax.Array:
    """Inputs in the column order of the wgmma operand that `convert` produces."""
    return permute_K(v) if convert == "pairs" else v


def _tile_product(w_smem, s_smem, b_smem, acc, interpret: bool, convert: str, c=None, halves: bool = False):
    """acc[r, g] += s[r, g] * sum over k of group g of q[r, k] * b[g, k] for one [ROWS, TILE_K] weight tile. With `c`
    (BIAS * b's group sums, [ROWS, GROUPS]) the operand is the biased q + BIAS and c is subtracted from each product.
    `halves` ("pairs" only): the tile's two column halves converted and multiplied one after the other (an operand
    of 32 registers a thread live at a time, not 64). Measured (bench/results/README.md, run 20): gate_up 120
    registers instead of 128, still 4 programs an SM, no faster; the engine leaves it off."""
    if interpret:  # the interpreter's wgmma reads its operands from shared memory only
        w = _operand_A(w_smem, interpret, convert, biased=c is not None)
        p = jax.lax.dot_general(w, b_smem[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc + _unbiased(p, c) * s_smem[...].astype(jnp.float32)
    if halves and convert == "pairs":
        p = _halves_product(w_smem, b_smem, c is not None)
    else:
        w = _operand_A(w_smem, interpret, convert, biased=c is not None)

        def product(acc_ref):
            plgpu.wgmma(acc_ref, w, plgpu.transpose_ref(b_smem, (1, 0)))
            plgpu.wgmma_wait(0)
            return acc_ref[...]

        p = pl.run_scoped(product, plgpu.ACC((ROWS, GROUPS), jnp.float32))
    return acc + _unbiased(p, c) * plgpu.load(s_smem, (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)


def _halves_product(w_smem, b_smem, biased: bool):
    """[ROWS, GROUPS] products of one tile, its column halves converted and multiplied one after the other."""
    words = plgpu.load(w_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
    half_k = TILE_K // 2

    def product(acc_ref):
        for half in range(2):
            a = _nibble_pairs(words, biased, half)
            plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(b_smem.at[:, pl.ds(half * half_k, half_k)], (1, 0)))
            plgpu.wgmma_wait(0)
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC((ROWS, GROUPS), jnp.float32))


def _unbiased(p, c):
    return p if c is None else p - c


def _tile_products(tiles, b_smem, accs, interpret: bool, overlap: int = 0, convert: str = "pairs", c=None,
                   halves: bool = False):
    """`_tile_product` for each (weight, scales) tile of `tiles` with the same input b. One after another by
    default: each tile's operand (64 registers a thread) is converted after the previous wgmma completed, so
    two operands are never live at once (gate_up: 168 -> 128 registers, 3 -> 4 programs an SM; T=4 251 -> 236 us,
    bench/results/moe-wgmma-lab-gpu-20261130-0104 / -0107). With `overlap` every tile is converted first and
    one wait covers all the wgmmas; with `overlap=2` each tile is converted while the previous tile's wgmma runs
    (issued without a wait), one wait at the end. `c`: the biased operands' correction (`_tile_product`)."""
    if interpret or not overlap:
        return tuple(_tile_product(w, s, b_smem, acc, interpret, convert, c, halves)
                     for (w, s), acc in zip(tiles, accs))
    interleave = overlap == 2
    operand = functools.partial(_operand_A, interpret=interpret, convert=convert, biased=c is not None)
    ws = [] if interleave else [operand(w_smem) for w_smem, _ in tiles]
    b = plgpu.transpose_ref(b_smem, (1, 0))

    def products(*acc_refs):
        for i, acc_ref in enumerate(acc_refs):
            w = operand(tiles[i][0]) if interleave else ws[i]
            plgpu.wgmma(acc_ref, w, b)
        plgpu.wgmma_wait(0)
        return tuple(acc_ref[...] for acc_ref in acc_refs)

    ps = pl.run_scoped(products, *(plgpu.ACC((ROWS, GROUPS), jnp.float32) for _ in tiles))
    return tuple(acc + _unbiased(p, c) * plgpu.load(s_smem, (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                 for acc, p, (_, s_smem) in zip(accs, ps, tiles))


def _zeros(interpret: bool, cols: int = GROUPS):
    """A [ROWS, cols] float32 accumulator of zeros in the wgmma's layout."""
    z = jnp.zeros((ROWS, cols), jnp.float32)
    return z if interpret else plgpu.layout_cast(z, plgpu.Layout.WGMMA)


def _store_rows(v, out_gmem):
    """Registers -> shared memory -> TMA into a slice of the output of v's shape ([ROWS] or [ROWS, cols])."""
    pl.run_scoped(lambda v_smem: store_rows_via(v, v_smem, out_gmem), plgpu.SMEM(v.shape, jnp.float32))


def store_rows_via(v, v_smem, out_gmem):
    """`_store_rows` through a given shared-memory buffer of v's shape; waits for the copy, so v_smem is free again
    when it returns (a kernel that stores inside its pipeline allocates the buffer once, outside it)."""
    v_smem[...] = v
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(v_smem, out_gmem)
    plgpu.wait_smem_to_gmem(0)


def _specs(interpret: bool, b_index, ws_index, lead: tuple = (), rows: int = ROWS):
    """BlockSpecs of (block-diagonal input, weight, scales) for one pipeline step; `lead` squeezes leading axes
    (the down kernel indexes slot and expert there); `rows` weight rows a step (whole ROWS blocks)."""
    b = plgpu.BlockSpec((*lead, None, GROUPS, TILE_K), b_index, transforms=_transforms(16, TILE_K, interpret))
    w = plgpu.BlockSpec((*lead, rows, TILE_K), ws_index, transforms=_transforms(4, TILE_K, interpret))
    s = plgpu.BlockSpec((*lead, rows, GROUPS), ws_index)
    return b, w, s


def _routed_slot(slot, choices: int, group):
    """The index in the routing's slots (expert ids) of a kernel's slot: the same without `group`; with group (g, G)
    the kernel sees only each token's choices g * choices .. + choices - 1 of its choices * G."""
    if group is None:
        return slot
    g, groups = group
    return slot // choices * (choices * groups) + g * choices + slot % choices


def _gate_up_kernel(expert_ref, xbd_ref, gq_ref, gs_ref, uq_ref, us_ref, gu_ref, *, n_k, choices, stages,
                    overlap, convert, halves, group, interpret):
    """gu[split, 0 / 1, slot, rows]: slot's gate / up rows summed over the split's share of H."""
    slot, rb, split = jax.lax.axis_index("slot"), jax.lax.axis_index("rows"), jax.lax.axis_index("split")
    e, t = expert_ref[_routed_slot(slot, choices, group)], slot // choices  # slot t * choices + c: token t, choice c
    b, w, s = _specs(interpret, lambda k: (split * n_k + k, 0, 0), lambda k: (rb, split * n_k + k))

    def step(_, xbd_smem, gq_smem, gs_smem, uq_smem, us_smem, carry):
        tiles = ((gq_smem, gs_smem), (uq_smem, us_smem))
        return _tile_products(tiles, xbd_smem, carry, interpret, overlap, convert, halves=halves)

    acc_g, acc_u = plgpu.emit_pipeline(step, grid=(n_k,), in_specs=[b, w, s, w, s], max_concurrent_steps=stages,
                                       init_carry=(_zeros(interpret), _zeros(interpret)))(
        xbd_ref.at[t], gq_ref.at[e], gs_ref.at[e], uq_ref.at[e], us_ref.at[e])
    _store_rows(jnp.sum(acc_g, axis=1), gu_ref.at[split, 0, slot, pl.ds(rb * ROWS, ROWS)])
    _store_rows(jnp.sum(acc_u, axis=1), gu_ref.at[split, 1, slot, pl.ds(rb * ROWS, ROWS)])


def _down_kernel(expert_ref, hbd_ref, dq_ref, ds_ref, y_ref, *, n_k, choices, splits, k_splits, stages, convert,
                 halves, group, row_blocks, interpret):
    rb, ts = jax.lax.axis_index("rows"), jax.lax.axis_index("token_split")
    t, rest = ts // (splits * k_splits), ts % (splits * k_splits)
    split, ks = rest // k_splits, rest % k_splits  # k_splits fastest: a row block's F shares run side by side
    per_split = choices // splits
    first = t * choices + split * per_split
    k0 = ks * n_k

    def step(_, hbd_smem, dq_smem, ds_smem, carry):
        tiles = tuple((dq_smem.at[pl.ds(i * ROWS, ROWS)], ds_smem.at[pl.ds(i * ROWS, ROWS)])
                      for i in range(row_blocks)) if row_blocks > 1 else ((dq_smem, ds_smem),)
        return _tile_products(tiles, hbd_smem, carry, interpret, convert=convert, halves=halves)

    # one pipeline over (choice, k tile): the expert id read in the index map picks the weights' leading block
    rows = ROWS * row_blocks
    b, w, s = _specs(interpret, lambda c, kk: (first + c, k0 + kk, 0, 0),
                     lambda c, kk: (expert_ref[_routed_slot(first + c, choices, group)], rb, k0 + kk), lead=(None,),
                     rows=rows)
    accs = plgpu.emit_pipeline(step, grid=(per_split, n_k), in_specs=[b, w, s], max_concurrent_steps=stages,
                               init_carry=tuple(_zeros(interpret) for _ in range(row_blocks)))(hbd_ref, dq_ref, ds_ref)
    for i, acc in enumerate(accs):
        _store_rows(jnp.sum(acc, axis=1), y_ref.at[split * k_splits + ks, t, pl.ds(rb * rows + i * ROWS, ROWS)])


def gate_up_sums(x_TH, gate: Int4Weight, up: Int4Weight, expert_U, *, choices: int, stages: int = STAGES,
                 splits: int = 1, overlap: bool = False, convert: str = "pairs", slots_inner: bool = False,
                 halves: bool = False, group: tuple[int, int] | None = None, interpret: bool = False) -> jax.Array:
    """[splits, 2, U, F] f32: slot u's gate / up rows (expert expert_U[u], token u // choices) over split s of H.
    With `group` (g, G) the U = T * choices slots are each token's choices g * choices .. + choices - 1 of the
    choices * G in expert_U (`_routed_slot`).

    `slots_inner`: the slot is the fastest grid axis (CUDA's x), so the programs in flight together cover every
    slot's same rows and the slots routed to one expert read each of its tiles at about the same time (the
    repeats come from L2). Otherwise (slot slowest) each slot streams its whole expert before the next begins."""
    _check_convert(convert)
    hidden = x_TH.shape[1]
    if (hidden // TILE_K) % splits:
        raise ValueError(f"gate_up_splits={splits} must divide the {hidden // TILE_K} tiles of H")
    groups = 1 if group is None else group[1]
    slots, f = expert_U.shape[0] // groups, gate.shape[1]
    if expert_U.shape[0] % groups or slots % choices or slots // choices != x_TH.shape[0]:
        raise ValueError(f"{expert_U.shape[0]} slots are not {choices} x {groups} choices for each of "
                         f"{x_TH.shape[0]} tokens")
    sizes = {"slot": slots, "rows": f // ROWS, "split": splits}
    names = ("rows", "split", "slot") if slots_inner else ("slot", "rows", "split")  # the last is CUDA's x
    return plgpu.kernel(
        functools.partial(_gate_up_kernel, n_k=hidden // TILE_K // splits, choices=choices, stages=stages,
                          overlap=overlap, convert=convert, halves=halves, group=group, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((splits, 2, slots, f), jnp.float32),
        grid=tuple(sizes[n] for n in names), grid_names=names,
        **_interpret_kw(interpret),
    )(expert_U, _wgmma_input(x_TH, convert), *_operands(gate), *_operands(up))


def down_sums(h_UF, down: Int4Weight, expert_U, *, choices: int, stages: int = STAGES, splits: int = 2,
              k_splits: int = 1, convert: str = "pairs", h_in_input_order: bool = False, halves: bool = False,
              group: tuple[int, int] | None = None, row_blocks: int = 1, interpret: bool = False) -> jax.Array:
    """[splits * k_splits, T, H] f32: token t's sum over split s of its `choices` slots t * choices + c of down(h),
    over share ks of F (row s * k_splits + ks). `h_in_input_order`: h's columns are already in
    `input_order(.., convert)`. `group`: h's slots are a group of expert_U's (`gate_up_sums`). `row_blocks`: a
    program's step streams that many blocks of ROWS H rows as one tile (one wgmma a block), so each step moves
    row_blocks x the bytes and there are as many times fewer programs. Measured (bench/results/README.md, run 22):
    a layer at one token 68.8 / 70.6 us with 2 / 4 against 67.4 with 1, which the engine keeps."""
    _check_convert(convert)
    slots, f = h_UF.shape
    check_down_splits(choices, splits, f, k_splits)
    t, hidden = slots // choices, down.shape[1]
    if row_blocks < 1 or hidden % (ROWS * row_blocks) or ROWS * row_blocks > 256:
        raise ValueError(f"down row_blocks={row_blocks} must divide the {hidden // ROWS} blocks of {ROWS} H rows "
                         f"and make a tile of at most 256 rows (a TMA box)")
    return plgpu.kernel(
        functools.partial(_down_kernel, n_k=f // TILE_K // k_splits, choices=choices, splits=splits,
                          k_splits=k_splits, stages=stages, convert=convert, halves=halves, group=group,
                          row_blocks=row_blocks, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((splits * k_splits, t, hidden), jnp.float32),
        grid=(hidden // (ROWS * row_blocks), t * splits * k_splits), grid_names=("rows", "token_split"),
        **_interpret_kw(interpret),
    )(expert_U, block_diagonal_SNGK(h_UF) if h_in_input_order else _wgmma_input(h_UF, convert), *_operands(down))


def check_down_splits(choices: int, splits: int, f: int, k_splits: int) -> None:
    """The down kernel's splits of a token's choices and of F must divide them."""
    if choices % splits:
        raise ValueError(f"down_splits={splits} must divide the {choices} choices per token")
    if (f // TILE_K) % k_splits:
        raise ValueError(f"down_k_splits={k_splits} must divide the {f // TILE_K} tiles of F")


def routed_experts_wgmma(x_TH, experts, ids_TK, weights_TK, *, stages: int = STAGES, gate_up_splits: int = 1,
                         down_splits: int = 2, overlap: bool = False, convert: str = "pairs",
                         permute_h: str = "after", down_stages: int | None = None, slots_inner: bool = False,
                         down_k_splits: int = 1, halves: int = 0, choice_groups: int = 1,
                         down_row_blocks: int = 1, interpret: bool = False) -> jax.Array:
    """Same contract as `model.moe.experts_gather` for INT4 experts (`supports(experts)`).

    `gate_up_splits` splits H across programs (more programs in flight at one token; the partial sums meet in
    the XLA fusion that applies SiLU and lays h out block-diagonally), `down_splits` splits each token's
    choices across programs and `down_k_splits` its F (partial sums added by XLA). `permute_h` puts h's columns
    in the down kernel's input order "after" SiLU or "before" it (on gate_up's partial sums): the same numbers, a
    different fusion for XLA (with split gate_up, "after" leaves a transpose behind SiLU that XLA launches apart). `down_stages`
    (default `stages`): the down kernel's pipeline depth, whose steps hold one weight tile to gate_up's two.
    `slots_inner`: gate_up's grid order (`gate_up_sums`); the down kernel's grid already has the row block
    slowest, so slots sharing an expert read its row block together there. `halves` (bits: 1 gate_up, 2 down): that
    kernel converts and multiplies each tile's column halves one after the other (`_tile_product`).
    `choice_groups`: each token's choices in that many groups, each its own gate_up -> h -> down chain (the down
    kernel's splits of the choices become the largest divisor of a group's choices that divides `down_splits`);
    the chains share no buffer, so XLA's CONCURRENT graph scheduling may run one group's down kernel while the next
    group's gate_up still streams (the ramp of one kernel under the tail of the other). `down_row_blocks`: the down
    kernel's steps stream that many blocks of ROWS H rows each (`down_sums`)."""
    if permute_h not in ("after", "before"):
        raise ValueError(f"moe_wgmma permute_h must be 'after' or 'before', not {permute_h!r}")
    if not supports(experts):
        raise ValueError(f"moe_wgmma takes INT4 experts with bf16 scales of group size {TILE_K // GROUPS} and dims "
                         f"in whole {TILE_K}-wide tiles, got gate {experts.gate.shape}")
    t, k = ids_TK.shape
    if choice_groups < 1 or k % choice_groups:
        raise ValueError(f"choice_groups={choice_groups} must divide the {k} choices per token")
    kg = k // choice_groups
    expert_U = ids_TK.reshape(t * k).astype(jnp.int32)
    y_TH = None
    for g in range(choice_groups):
        group = (g, choice_groups) if choice_groups > 1 else None
        gu_S2UF = gate_up_sums(x_TH, experts.gate, experts.up, expert_U, choices=kg, stages=stages,
                               splits=gate_up_splits, overlap=overlap, convert=convert, slots_inner=slots_inner,
                               halves=bool(halves & 1), group=group, interpret=interpret)
        if permute_h == "before":
            gu_S2UF = input_order(gu_S2UF, convert)
        h_UF = swiglu_h(gu_S2UF, weights_TK[:, g * kg:(g + 1) * kg])
        # one group keeps the caller's down_splits, so a split that does not divide the choices is still refused
        splits = down_splits if choice_groups == 1 else math.gcd(down_splits, kg)
        y_STH = down_sums(h_UF, experts.down, expert_U, choices=kg, stages=down_stages or stages, splits=splits,
                          k_splits=down_k_splits, convert=convert, h_in_input_order=permute_h == "before",
                          halves=bool(halves & 2), group=group, row_blocks=down_row_blocks, interpret=interpret)
        y_TH = _sum_leading(y_STH) if y_TH is None else y_TH + _sum_leading(y_STH)
    return y_TH.astype(x_TH.dtype)


def swiglu_h(gu_S2UF: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """[U, F] f32: each slot's SiLU(gate) * up from gate_up's split sums, times the slot's router weight."""
    g_UF, u_UF = _sum_leading(gu_S2UF)
    return jax.nn.silu(g_UF) * u_UF * weights_TK.reshape(-1, 1).astype(jnp.float32)


def _sum_leading(v: jax.Array) -> jax.Array:
    """Sum over the (few) splits as elementwise adds of slices, not a reduction: XLA then fuses the sum into its
    consumer (SiLU, the block-diagonal layout) instead of launching a reduction kernel before it."""
    out = v[0]
    for i in range(1, v.shape[0]):
        out = out + v[i]
    return out


def _check_convert(convert: str) -> None:
    """"pairs" / "mosaic" (`_operand_A`); "none" is a diagnostic with wrong results (no int4 conversion: what the
    kernel takes without it, bench/moe_wgmma_lab.py's CONVERT n)."""
    if convert not in ("pairs", "mosaic", "none"):
        raise ValueError(f"moe_wgmma convert must be 'pairs', 'mosaic' or 'none', not {convert!r}")


def _wgmma_input(v_SK: jax.Array, convert: str) -> jax.Array:
    """The B operand of every step: v in the operand's column order, block-diagonal over the scale groups."""
    return block_diagonal_SNGK(input_order(v_SK, convert))


def _operands(w: Int4Weight):
    return int4_nibbles(w), w.scale  # bf16 (`supports`): streamed as stored, no converted copy per call


def _interpret_kw(interpret: bool) -> dict:
    if not interpret:
        return {}
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return {"interpret": InterpretGPUParams()}
