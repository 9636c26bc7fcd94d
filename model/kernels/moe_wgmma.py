"""Fused routed experts for decode and verify with TMA-pipelined INT4 tiles: Pallas Mosaic GPU (Hopper).

Plain reference: `model.moe.experts_gather`. One slot per (token, choice): gate_up over (slot, block of 64 F rows,
split of H), then down over (block of 64 H rows, token, split of its choices, split of F); XLA adds the splits'
partial sums. Why this kernel: dequantizing in registers while the kernel's own loads are in flight (the Triton
kernels) lets the dequantization's registers cap the loads in flight; here the TMA engine streams the weight tiles
into shared memory `stages` steps ahead, which costs no registers, and the warpgroup dequantizes the landed tile.

The products run on tensor cores as one wgmma per tile with the weights as the register operand A and a
block-diagonal B: B[g, k] = x[k] if k lies in group g of the tile (`block_diagonal_UNGK`, built by XLA), so the
wgmma's N = 8 columns are the tile's eight per-group partial dot products P[r, g]. The group scales are
then one [64, 8] tile in the accumulator's own layout: acc += P * s, summed over g once at the end.
With one token per slot the tensor cores do 8x the needed multiplies, which they have to spare; the
bytes of B (4 KB a step, shared by every program of the token) come from L2.

The int4 -> bf16 conversion bounds the kernel's arithmetic. `_nibble_pairs` leaves each lane its own 32-bit
words and turns nibbles (p, p + 4) of a word into one bf16 pair with a shift and a LOP3, so the wgmma sees the
tile's columns in a fixed permuted order (`permute_K`), which XLA applies to B as well.

Interpret mode (CPU, `interpret=True`) runs the same kernels under Pallas' GPU interpreter; its wgmma takes
no register operand, so there the product is a dot_general on the permuted tile and the shared-memory tiles
carry no swizzle.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from model.quant import Int4Weight

ROWS = 64  # wgmma M: weight rows per program
TILE_K = 256  # int4 elements per pipeline step: 128 bytes a row, one 128-byte swizzle span
GROUPS = 8  # scale groups per step at group size 32: the wgmma N
STAGES = 2  # pipeline steps in flight; deeper pipelines leave fewer programs an SM (shared memory)


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


def block_diagonal_UNGK(v_UK: jax.Array) -> jax.Array:
    """[U, K] -> [U, K // TILE_K, GROUPS, TILE_K] bf16: tile n's row g holds v where k's group within the tile
    is g, zeros elsewhere (each pipeline step's B is one contiguous [GROUPS, TILE_K] block).

    Built by padding and reshapes, not by a mask over a broadcast (which would repeat SiLU's exp 8 times): each
    output element reads at most one input element, so XLA can fuse the producer (SiLU) into this layout."""
    u, k = v_UK.shape
    width, tiles = TILE_K // GROUPS, k // TILE_K
    v = v_UK.astype(jnp.bfloat16).reshape(u, tiles, GROUPS, width)
    # flattened, a tile's [GROUPS, TILE_K] block holds group g at g * (width + TILE_K): each group, then TILE_K zeros
    padded = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, TILE_K))).reshape(u, tiles, GROUPS * (width + TILE_K))
    return padded[:, :, :GROUPS * TILE_K].reshape(u, tiles, GROUPS, TILE_K)


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


def _nibble_pairs(w):
    """[ROWS, TILE_K] int4 words of q + 8 in WGMMA_UPCAST_4X -> bf16 q in the WGMMA layout, columns in `permute_K`
    order. Per 32-bit word (8 values): 3 shifts and 4 LOP3 put the nibble pairs (p, p + 4) under a bf16 exponent
    as 128 + n, 4 packed subtractions of 136 give q. No cross-lane shuffle: each lane keeps its own words (the
    in-order relayout to WGMMA costs shuffles, and Mosaic's signed upcast needs a PRMT per pair)."""
    import jax.experimental.mosaic.gpu as mgpu  # GPU-only modules: CPU interpret mode never needs them
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
                       return_type=plgpu.ShapeDtypeStruct((ROWS, TILE_K), jnp.bfloat16, layout=plgpu.Layout.WGMMA))
    def convert(_, words):
        i32 = ir.IntegerType.get_signless(32)
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        out = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((ROWS, TILE_K)), dtype=object)
        for idx, reg in np.ndenumerate(words.registers):  # idx = (0, 32-column tile, 0, 0, row half, 0, 0, 0, 0)
            word = mgpu_utils.bitcast(reg, i32)
            for p in range(4):
                src = word if p == 0 else arith.shrui(word, arith.constant(i32, 4 * p))
                asm = ("{ .reg .b32 t, b; lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA; mov.b32 b, 0x43084308; "
                       "sub.bf16x2 $0, t, b; }")
                pair = llvm.inline_asm(i32, [src], asm, "=r,r")
                out[(0, 4 * idx[1] + p, 0, 0, idx[4], 0, 0, 0, 0)] = mgpu_utils.bitcast(pair, bf16x2)
        return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return convert(w)


def _tile_product(w_smem, s_smem, b_smem, acc, interpret: bool):
    """acc[r, g] += s[r, g] * sum over k of group g of q[r, k] * b[g, k] for one [ROWS, TILE_K] weight tile."""
    if interpret:  # the interpreter's wgmma reads its operands from shared memory only: the plain value path
        q = (w_smem[...] ^ jnp.int4(-8)).astype(jnp.float32)
        w = permute_K(q.astype(jnp.bfloat16))
        p = jax.lax.dot_general(w, b_smem[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc + p * s_smem[...].astype(jnp.float32)
    w = _nibble_pairs(plgpu.load(w_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_4X))

    def product(acc_ref):
        plgpu.wgmma(acc_ref, w, plgpu.transpose_ref(b_smem, (1, 0)))
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    p = pl.run_scoped(product, plgpu.ACC((ROWS, GROUPS), jnp.float32))
    return acc + p * plgpu.load(s_smem, (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)


def _tile_products(tiles, b_smem, accs, interpret: bool):
    """`_tile_product` for each (weight, scales) tile of `tiles` with the same input b, one after another: each
    tile's operand (64 registers a thread) is converted after the previous wgmma completed, so two operands are
    never live at once (fewer registers, more programs an SM)."""
    return tuple(_tile_product(w, s, b_smem, acc, interpret) for (w, s), acc in zip(tiles, accs))


def _zeros(interpret: bool, cols: int = GROUPS):
    """A [ROWS, cols] float32 accumulator of zeros in the wgmma's layout."""
    z = jnp.zeros((ROWS, cols), jnp.float32)
    return z if interpret else plgpu.layout_cast(z, plgpu.Layout.WGMMA)


def _store_rows(v, out_gmem, write=None):
    """Registers -> shared memory -> TMA into a slice of the output of v's shape ([ROWS] or [ROWS, cols]).
    `write(v, v_smem)` puts v into shared memory where it is not stored as it is."""
    def store(v_smem):
        if write is None:
            v_smem[...] = v
        else:
            write(v, v_smem)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(v_smem, out_gmem)
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM(v.shape, jnp.float32))


def _store_rows_in_K_order(v, out_gmem, interpret: bool):
    """`_store_rows` of [ROWS] rows in natural order, written in `permute_K` order: the down kernel takes h in that
    order, and given natural rows XLA spends a kernel of its own on the permutation between the two MoE kernels
    (SiLU, the split sum and the block-diagonal layout then fuse into one). ROWS is whole groups of 32, so the
    block's rows stay within the block."""
    if interpret:
        _store_rows(permute_K(v), out_gmem)
    else:
        _store_rows(v, out_gmem, write=_scatter_in_K_order)


def _scatter_in_K_order(v, v_smem):
    """Each thread stores its rows of v (the wgmma's row layout) at their `permute_K` positions of v_smem: natural
    row 32c + 8j + 4e + p goes to 32c + 8p + 2j + e. The threads of a quad hold the same rows and store the same
    values."""
    from jax._src.lib.mlir import ir  # GPU-only modules: CPU interpret mode never needs them
    from jax._src.lib.mlir.dialects import arith, memref
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA.reduce(1), plgpu.RefType()))
    def scatter(_, rows, ref):
        index = ir.IndexType.get()

        def const(n):
            return mgpu_utils.c(n, index)

        def digit(r, unit, base):
            return arith.remui(arith.divui(r, const(unit)), const(base))

        def store(value, idx):
            (r,) = idx
            c32 = arith.muli(arith.divui(r, const(32)), const(32))
            j, e, p = digit(r, 8, 4), digit(r, 4, 2), digit(r, 1, 4)
            o = arith.addi(arith.addi(c32, arith.muli(p, const(8))), arith.addi(arith.muli(j, const(2)), e))
            memref.store(value, ref, [o])

        rows.foreach(store)

    scatter(v, v_smem)


def _specs(interpret: bool, b_index, ws_index, lead: tuple = ()):
    """BlockSpecs of (block-diagonal input, weight, scales) for one pipeline step; `lead` squeezes leading axes
    (the down kernel indexes slot and expert there)."""
    b = plgpu.BlockSpec((*lead, None, GROUPS, TILE_K), b_index, transforms=_transforms(16, TILE_K, interpret))
    w = plgpu.BlockSpec((*lead, ROWS, TILE_K), ws_index, transforms=_transforms(4, TILE_K, interpret))
    s = plgpu.BlockSpec((*lead, ROWS, GROUPS), ws_index)
    return b, w, s


def _local_expert(expert_ref, weight_ref, first_ref, slot, num_local: int):
    """(slot's expert among this device's [first, first + num_local), whether the slot runs here): a slot runs where
    its router weight is not 0 and its expert is this device's; the index is clipped into range for the slots that
    do not run (an index map computes it for them too)."""
    e = expert_ref[slot] - first_ref[0]
    runs = (weight_ref[slot] != 0) & (e >= 0) & (e < num_local)
    return jnp.minimum(jnp.maximum(e, 0), num_local - 1), runs


def _gate_up_kernel(expert_ref, weight_ref, first_ref, xbd_ref, gq_ref, gs_ref, uq_ref, us_ref, gu_ref, *, n_k,
                    choices, num_local, stages, interpret):
    """gu[split, 0 / 1, slot, rows]: slot's gate / up rows summed over the split's share of H; a slot of router
    weight 0 or of another device's expert is skipped and its rows are not written (the caller masks them)."""
    slot, rb, split = jax.lax.axis_index("slot"), jax.lax.axis_index("rows"), jax.lax.axis_index("split")
    (e, runs), t = _local_expert(expert_ref, weight_ref, first_ref, slot, num_local), slot // choices
    b, w, s = _specs(interpret, lambda k: (split * n_k + k, 0, 0), lambda k: (rb, split * n_k + k))

    def step(_, xbd_smem, gq_smem, gs_smem, uq_smem, us_smem, carry):
        return _tile_products(((gq_smem, gs_smem), (uq_smem, us_smem)), xbd_smem, carry, interpret)

    @pl.when(runs)
    def _():
        acc_g, acc_u = plgpu.emit_pipeline(step, grid=(n_k,), in_specs=[b, w, s, w, s], max_concurrent_steps=stages,
                                           init_carry=(_zeros(interpret), _zeros(interpret)))(
            xbd_ref.at[t], gq_ref.at[e], gs_ref.at[e], uq_ref.at[e], us_ref.at[e])
        _store_rows_in_K_order(jnp.sum(acc_g, axis=1), gu_ref.at[split, 0, slot, pl.ds(rb * ROWS, ROWS)], interpret)
        _store_rows_in_K_order(jnp.sum(acc_u, axis=1), gu_ref.at[split, 1, slot, pl.ds(rb * ROWS, ROWS)], interpret)


def _down_kernel(expert_ref, weight_ref, first_ref, hbd_ref, dq_ref, ds_ref, y_ref, *, n_k, choices, splits, k_splits,
                 num_local, stages, interpret):
    """y[split * k_splits + ks, t, rows]; not written where no choice of the split runs here (router weight 0 or
    another device's expert; the caller masks those rows, `split_active_ZT`)."""
    rb, ts = jax.lax.axis_index("rows"), jax.lax.axis_index("token_split")
    t, rest = ts // (splits * k_splits), ts % (splits * k_splits)
    split, ks = rest // k_splits, rest % k_splits  # k_splits fastest: a row block's F shares run side by side
    per_split = choices // splits
    first = t * choices + split * per_split
    k0 = ks * n_k

    def step(_, hbd_smem, dq_smem, ds_smem, carry):
        return _tile_products(((dq_smem, ds_smem),), hbd_smem, carry, interpret)

    # one pipeline over (choice, k tile): the expert id read in the index map picks the weights' leading block (a
    # choice that does not run reads some local expert's tiles against its h of zeros)
    b, w, s = _specs(interpret, lambda c, kk: (first + c, k0 + kk, 0, 0),
                     lambda c, kk: (_local_expert(expert_ref, weight_ref, first_ref, first + c, num_local)[0], rb,
                                    k0 + kk), lead=(None,))
    any_active = _local_expert(expert_ref, weight_ref, first_ref, first, num_local)[1]
    for c in range(1, per_split):
        any_active = any_active | _local_expert(expert_ref, weight_ref, first_ref, first + c, num_local)[1]

    @pl.when(any_active)
    def _():
        (acc,) = plgpu.emit_pipeline(step, grid=(per_split, n_k), in_specs=[b, w, s], max_concurrent_steps=stages,
                                     init_carry=(_zeros(interpret),))(hbd_ref, dq_ref, ds_ref)
        _store_rows(jnp.sum(acc, axis=1), y_ref.at[split * k_splits + ks, t, pl.ds(rb * ROWS, ROWS)])


def gate_up_sums(x_TH, gate: Int4Weight, up: Int4Weight, expert_U, *, choices: int, stages: int = STAGES,
                 splits: int = 1, weight_U=None, first_expert=None, interpret: bool = False) -> jax.Array:
    """[P, 2, U, F] f32 (P = `splits` of H): slot u's gate / up rows (expert expert_U[u], token u // choices) over
    split p of H. Rows in `permute_K` order (the down kernel's column order), as x's columns enter the
    products. A slot whose router weight weight_U[u] is 0 is skipped and its rows hold whatever the buffer held
    (None: no slot skipped). `first_expert`: expert_U are global ids and the weights hold experts [first_expert,
    first_expert + E); a slot of another expert is skipped too (None: expert_U index the weights)."""
    hidden = x_TH.shape[1]
    if (hidden // TILE_K) % splits:
        raise ValueError(f"gate_up_splits={splits} must divide the {hidden // TILE_K} tiles of H")
    slots, f = expert_U.shape[0], gate.shape[1]
    if slots % choices or slots // choices != x_TH.shape[0]:
        raise ValueError(f"{slots} slots are not {choices} choices for each of {x_TH.shape[0]} tokens")
    return plgpu.kernel(
        functools.partial(_gate_up_kernel, n_k=hidden // TILE_K // splits, choices=choices,
                          num_local=gate.shape[0], stages=stages, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((splits, 2, slots, f), jnp.float32),
        grid=(slots, f // ROWS, splits), grid_names=("slot", "rows", "split"),  # the last is CUDA's x
        **_interpret_kw(interpret),
    )(expert_U, _weights(weight_U, slots), _first(first_expert), block_diagonal_UNGK(permute_K(x_TH)),
      *_operands(gate), *_operands(up))


def down_sums(h_UF, down: Int4Weight, expert_U, *, choices: int, stages: int = STAGES, splits: int = 2,
              k_splits: int = 1, weight_U=None, first_expert=None, interpret: bool = False) -> jax.Array:
    """[P, T, H] f32 (P = splits * k_splits): token t's sum over split s of its `choices` slots t * choices + c of
    down(h), over share ks of F (row s * k_splits + ks). h's columns come in `permute_K` order. A split none of
    whose slots runs (router weight weight_U 0, or with `first_expert` another device's expert, as `gate_up_sums`)
    is skipped and its row is not written (`split_active_ZT` says which rows hold sums; None: no split skipped)."""
    slots, f = h_UF.shape
    check_down_splits(choices, splits, f, k_splits)
    t, hidden = slots // choices, down.shape[1]
    return plgpu.kernel(
        functools.partial(_down_kernel, n_k=f // TILE_K // k_splits, choices=choices, splits=splits,
                          k_splits=k_splits, num_local=down.shape[0], stages=stages, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((splits * k_splits, t, hidden), jnp.float32),
        grid=(hidden // ROWS, t * splits * k_splits), grid_names=("rows", "token_split"),
        **_interpret_kw(interpret),
    )(expert_U, _weights(weight_U, slots), _first(first_expert), block_diagonal_UNGK(h_UF), *_operands(down))


def check_down_splits(choices: int, splits: int, f: int, k_splits: int) -> None:
    """The down kernel's splits of a token's choices and of F must divide them."""
    if choices % splits:
        raise ValueError(f"down_splits={splits} must divide the {choices} choices per token")
    if (f // TILE_K) % k_splits:
        raise ValueError(f"down_k_splits={k_splits} must divide the {f // TILE_K} tiles of F")


def routed_experts_wgmma(x_TH, experts, ids_TK, weights_TK, *, stages: int = STAGES, gate_up_splits: int = 1,
                         down_splits: int = 2, down_k_splits: int = 1, first_expert=None,
                         interpret: bool = False) -> jax.Array:
    """Same contract as `model.moe.experts_gather` for INT4 experts (`supports(experts)`); with `first_expert`, the
    ids are global and `experts` are one device's, [first_expert, first_expert + E): the sum over the token's
    choices of this device's experts (expert parallelism, model.moe_parallel).

    `gate_up_splits` splits H across programs (more programs in flight at one token; the partial sums meet in
    the XLA fusion that applies SiLU and lays h out block-diagonally), `down_splits` splits each token's
    choices across programs and `down_k_splits` its F (partial sums added by XLA). gate_up writes its rows in
    the down kernel's column order, so XLA fuses the split sum, SiLU and the block-diagonal layout into one kernel."""
    if not supports(experts):
        raise ValueError(f"moe_wgmma takes INT4 experts with bf16 scales of group size {TILE_K // GROUPS} and dims "
                         f"in whole {TILE_K}-wide tiles, got gate {experts.gate.shape}")
    t, k = ids_TK.shape
    expert_U = ids_TK.reshape(t * k).astype(jnp.int32)
    # a slot whose router weight is 0 adds nothing, and under expert parallelism neither does a choice of an expert
    # another device holds: the kernels skip both, reading the router's ids and weights themselves, so nothing
    # stands between the router's top-k and gate_up (no kernel of XLA's to restrict the choices to this device)
    weight_U = weights_TK.reshape(t * k)
    gu_Z2UF = gate_up_sums(x_TH, experts.gate, experts.up, expert_U, choices=k, stages=stages,
                           splits=gate_up_splits, weight_U=weight_U, first_expert=first_expert, interpret=interpret)
    runs_TK = weights_TK if first_expert is None else jnp.where(
        (ids_TK >= first_expert) & (ids_TK < first_expert + experts.num_experts), weights_TK, 0.0)
    h_UF = swiglu_h(gu_Z2UF, runs_TK)
    y_ZTH = down_sums(h_UF, experts.down, expert_U, choices=k, stages=stages, splits=down_splits,
                      k_splits=down_k_splits, weight_U=weight_U, first_expert=first_expert, interpret=interpret)
    written_ZT1 = split_active_ZT(runs_TK, down_splits, down_k_splits)[..., None]
    return _sum_leading(jnp.where(written_ZT1, y_ZTH, 0.0)).astype(x_TH.dtype)


def split_active_ZT(weights_TK: jax.Array, splits: int, k_splits: int) -> jax.Array:
    """[splits * k_splits, T] bool: whether row s * k_splits + ks of `down_sums` was written (a slot of split s of
    the token's choices has a router weight other than 0)."""
    t, k = weights_TK.shape
    split_TS = jnp.any(weights_TK.reshape(t, splits, k // splits) != 0, axis=-1)
    return jnp.repeat(split_TS.T, k_splits, axis=0)


def swiglu_h(gu_Z2UF: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """[U, F] f32: each slot's SiLU(gate) * up from gate_up's split sums, times the slot's router weight; 0 where
    that weight is 0 (gate_up skipped the slot and left its rows unwritten)."""
    g_UF, u_UF = _sum_leading(gu_Z2UF)
    w_U1 = weights_TK.reshape(-1, 1).astype(jnp.float32)
    return jnp.where(w_U1 != 0, jax.nn.silu(g_UF) * u_UF * w_U1, 0.0)


def _sum_leading(v: jax.Array) -> jax.Array:
    """Sum over the (few) splits as elementwise adds of slices, not a reduction: XLA then fuses the sum into its
    consumer (SiLU, the block-diagonal layout) instead of launching a reduction kernel before it."""
    out = v[0]
    for i in range(1, v.shape[0]):
        out = out + v[i]
    return out


def _first(first_expert) -> jax.Array:
    """[1] int32: the first expert the weights hold (0: expert ids index the weights)."""
    return jnp.zeros((1,), jnp.int32) if first_expert is None else jnp.reshape(first_expert, (1,)).astype(jnp.int32)


def _weights(weight_U, slots: int) -> jax.Array:
    return jnp.ones((slots,), jnp.float32) if weight_U is None else weight_U.astype(jnp.float32)


def _operands(w: Int4Weight):
    return int4_nibbles(w), w.scale  # bf16 (`supports`): streamed as stored, no converted copy per call


def _interpret_kw(interpret: bool) -> dict:
    if not interpret:
        return {}
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # interpret mode only

    return {"interpret": InterpretGPUParams()}
