"""Fused routed experts for decode and verify on CUDA cores: Pallas (Triton) gather-GEMV over the selected experts.

Plain reference: `model.moe.experts_gather`. Same two-kernel structure as moe_gather.py (gate_up
over (slot, block of F rows), then down over blocks of H rows looping over the used slots), but the
products are elementwise FMAs accumulated in registers and reduced once per program, not tensor-core dots.
Why: with one token a dot pads the token side to 16 and routes every dequantized tile through shared
memory, which leaves the kernel issue-bound on the dequantization far above the INT4 byte floor.

INT4: nibble j becomes the exact float q + offset_j in one LOP3 (int4_tile.nibble_float), multiplied into
a per-word sum with FMAs; the offsets are removed once per word as sum_j offset_j x_j, which depends on x
alone and is computed by XLA before the kernel (`nibble_offsets_OTW`); the group scale is applied once per
word. Per value at one token: ~0.5 shift, one LOP3, one FFMA. The products are explicit FMAs (PTX
`fma.rn.f32`, model/kernels/triton_ops.py): Triton leaves a * b + c as two instructions, which the first profile
(Nsight Compute) showed as 40% of the kernel's instructions.

Group scales are loaded one per word with an index array (`scale_tile`): the same [rows, words] shape and
layout as the words, so no join/reshape (a layout change through shared memory in Triton) sits in the
loop. `cfg.prefetch` carries the next step's tiles in registers; `cfg.down_splits` splits the down
kernel's loop over slots across programs (partial sums added by XLA), for more programs in flight.

Slots (`cfg.slots`): "unique" gives each distinct expert one slot that computes every token (the routing
weight is 0 for tokens that did not choose it), so an expert shared by tokens is read once but every slot
does T tokens of arithmetic; "pairs" gives each (token, choice) pair its own slot with that one token, so
the arithmetic per byte stays that of one token at any T (verify steps), an expert chosen by two tokens is
read twice (the second read usually from L2: both programs run side by side), and no slot bookkeeping
(sort, scatter) runs in XLA. The down kernel then splits per token: program (rows, token t, split) sums
its share of t's K choices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from model.kernels.int4_tile import nibble_float, nibble_offsets_OTW, repeat_last, shifted_words
from model.kernels.moe_tiles import ExpertSlots, check_shapes, expert_slots, split_range
from model.kernels.triton_ops import div, even_splits, fma, rem
from model.quant import Int4Weight


def scale_tile(s_ref, e, rows: pl.Slice, k0, block_k: int, wpg: int, gather: bool) -> jax.Array:
    """Group scales of expert e for a [rows, block_k words] tile, one per word -> [rows, block_k] f32."""
    if not gather:  # one load per group, then repeated in registers (join + reshape)
        s = s_ref[e, rows, pl.ds(div(k0, wpg), block_k // wpg)]
        return repeat_last(s, wpg).astype(jnp.float32)
    row_R1 = (rows.start + jnp.arange(rows.size, dtype=jnp.int32) * rows.stride)[:, None]
    group_1K = div(k0 + jnp.arange(block_k, dtype=jnp.int32), wpg)[None, :]
    return s_ref[e, row_R1, group_1K].astype(jnp.float32)


def _load_tile(w_ref, s_ref, e, rows, k0, block_k, wpg, gather):
    words = w_ref[e, rows, pl.ds(k0, block_k)]
    if s_ref is None:
        return (words,)
    return words, scale_tile(s_ref, e, rows, k0, block_k, wpg, gather)


def _accumulate(tile, vectors_by_token, offsets_by_token, accs, ptx: bool):
    """For each token: acc += sum over parts of W_part * v_part (scaled), on unreduced [rows, block_k] f32 tiles.

    `tile` is (words,) for bf16 or (words, scales) for int4; `vectors_by_token[t][j]` is the [block_k] f32
    input of part j (inputs parts * w + j); `offsets_by_token[t]` its `nibble_offsets_OTW` ([block_k])."""
    if len(tile) == 1:  # bf16 weights: one part
        v = tile[0].astype(jnp.float32)
        return tuple(fma(v, vs[0][None, :], acc, ptx) for vs, acc in zip(vectors_by_token, accs))
    words, scale = tile
    shifted = shifted_words(words)
    parts = len(vectors_by_token[0])
    sums = [None] * len(vectors_by_token)
    for j in range(parts):
        v = nibble_float(shifted, j, ptx)  # shared by all tokens
        for t, vs in enumerate(vectors_by_token):
            sums[t] = v * vs[j][None, :] if sums[t] is None else fma(v, vs[j][None, :], sums[t], ptx)
    return tuple(fma(sums[t] - offsets_by_token[t][None, :], scale, accs[t], ptx) for t in range(len(sums)))


def _pipelined_loop(n, load, compute, acc, prefetch: bool):
    """acc = compute(i, load(i), acc) for i < n; with `prefetch` the loads of step i + 1 are issued before
    step i's arithmetic (the tiles ride in the loop carry)."""
    if not prefetch:
        return jax.lax.fori_loop(0, n, lambda i, a: compute(i, load(i), a), acc)

    def step(i, carry):
        a, tile = carry
        nxt = load(jnp.minimum(i + 1, n - 1))
        return compute(i, tile, a), nxt

    return jax.lax.fori_loop(0, n, step, (acc, load(0)))[0]


def _gate_up_kernel(expert_ref, num_ref, combine_ref, x_ref, *refs, parts, wpg, rows_per_part, block_f, block_k,
                    tokens, choices, n_k, gather, prefetch, ptx):
    """h[u, j, i, w] for the tokens slot u computes: all `tokens` (unique slots) or token u // choices (pairs).

    x_ref is [parts, T, H/parts] with the offsets [T, H/parts] in refs (XLA laid them out)."""
    if parts > 1:
        xoff_ref, gate_w, gate_s, up_w, up_s, h_ref = refs
    else:
        (gate_w, up_w, h_ref), xoff_ref, gate_s, up_s = refs, None, None, None
    u = pl.program_id(0)
    p0 = pl.program_id(1) * block_f
    token_ids = [div(u, choices)] if choices else list(range(tokens))

    @pl.when(u < num_ref[0])
    def _():
        e = expert_ref[u]
        rows = pl.ds(parts * rem(p0, rows_per_part) + div(p0, rows_per_part), block_f, stride=parts)

        def load(i):
            k0 = i * block_k
            return (_load_tile(gate_w, gate_s, e, rows, k0, block_k, wpg, gather),
                    _load_tile(up_w, up_s, e, rows, k0, block_k, wpg, gather))

        def compute(i, tiles, acc):
            acc_g, acc_u = acc
            k0 = i * block_k
            xs = [[x_ref[j, t, pl.ds(k0, block_k)].astype(jnp.float32) for j in range(parts)] for t in token_ids]
            offs = [None if xoff_ref is None else xoff_ref[t, pl.ds(k0, block_k)] for t in token_ids]
            return (_accumulate(tiles[0], xs, offs, acc_g, ptx),
                    _accumulate(tiles[1], xs, offs, acc_u, ptx))

        zeros = tuple(jnp.zeros((block_f, block_k), jnp.float32) for _ in token_ids)
        acc_g, acc_u = _pipelined_loop(n_k, load, compute, (zeros, zeros), prefetch)
        for i in range(len(token_ids)):
            h = jax.nn.silu(jnp.sum(acc_g[i], axis=1)) * jnp.sum(acc_u[i], axis=1) * combine_ref[u, i]
            h_ref[u, div(p0, rows_per_part), i, pl.ds(rem(p0, rows_per_part), block_f)] = h.astype(h_ref.dtype)


def _down_kernel(expert_ref, num_ref, h_ref, *refs, parts, wpg, rows_per_part, block_h, block_k, tokens, choices, n_k,
                 splits, slots_per_split, gather, prefetch, ptx):
    """y[split, t, rows]: unique slots sum all tokens over split's slots; pairs sum token t's choices of the split."""
    if parts > 1:
        hoff_ref, down_w, down_s, y_ref = refs
    else:
        (down_w, y_ref), hoff_ref, down_s = refs, None, None
    r0 = pl.program_id(0) * block_h
    if choices:  # program (rows, t * splits + split): pairs t * choices + [split's share of 0..choices)
        token, split = div(pl.program_id(1), splits), rem(pl.program_id(1), splits)
        first_slot = token * choices + split * slots_per_split
        slots = jnp.clip(choices - split * slots_per_split, 0, slots_per_split)
        outputs = [(token, 0)]  # (token, index of the token in h's third axis)
    else:
        split = pl.program_id(1)
        first_slot, slots = split_range(num_ref, split, slots_per_split)
        outputs = [(t, t) for t in range(tokens)]

    def load(i):
        u = jnp.minimum(first_slot + div(i, n_k), expert_ref.shape[0] - 1)  # prefetch may look one past
        return _load_tile(down_w, down_s, expert_ref[u], pl.ds(r0, block_h), rem(i, n_k) * block_k, block_k, wpg,
                          gather)

    def compute(i, tile, acc):
        u = first_slot + div(i, n_k)
        k0 = rem(i, n_k) * block_k
        hs = [[h_ref[u, j, c, pl.ds(k0, block_k)].astype(jnp.float32) for j in range(parts)] for _, c in outputs]
        offs = [None if hoff_ref is None else hoff_ref[u, c, pl.ds(k0, block_k)] for _, c in outputs]
        return _accumulate(tile, hs, offs, acc, ptx)

    zeros = tuple(jnp.zeros((block_h, block_k), jnp.float32) for _ in outputs)
    acc = _pipelined_loop(slots * n_k, load, compute, zeros, prefetch)
    for (t, _), a in zip(outputs, acc):
        y_ref[split, t, pl.ds(r0, block_h)] = jnp.sum(a, axis=1)


def _pair_slots(ids_TK, weights_TK) -> ExpertSlots:
    """One slot per (token, choice), in token-major order: slot u holds token u // K."""
    s = ids_TK.size
    return ExpertSlots(ids_TK.reshape(s).astype(jnp.int32), jnp.full((1,), s, jnp.int32),
                       weights_TK.reshape(s, 1).astype(jnp.float32))


def routed_experts_gemv(x_TH, experts, ids_TK, weights_TK, *, cfg, interpret: bool = False) -> jax.Array:
    """Same contract as `model.moe.experts_gather`; `cfg` is a MoEKernelConfig (tiles, warps, slots, splits)."""
    check_shapes(experts, cfg)
    if cfg.slots not in ("unique", "pairs"):
        raise ValueError(f"MoEKernelConfig.slots must be 'unique' or 'pairs', not {cfg.slots!r}")
    t, hidden = x_TH.shape
    num_experts, f, _ = experts.gate.shape
    int4 = isinstance(experts.gate, Int4Weight)
    parts = 8 if int4 else 1
    wpg = experts.gate.group_size // 8 if int4 else 1
    dt = x_TH.dtype
    pairs = cfg.slots == "pairs"
    choices = ids_TK.shape[1] if pairs else 0
    slots = _pair_slots(ids_TK, weights_TK) if pairs else expert_slots(ids_TK, weights_TK, min(num_experts, ids_TK.size), t)
    u = slots.expert_U.shape[0]
    tokens_per_slot = 1 if pairs else t
    # pairs: each token's choices split across programs; unique: all slots split across programs
    splits, slots_per_split = even_splits(choices if pairs else u, cfg.down_splits)
    x_OTW = x_TH.reshape(t, hidden // parts, parts).transpose(2, 0, 1)  # element parts*w + j -> [j, t, w]
    x_off = (nibble_offsets_OTW(x_OTW),) if int4 else ()  # bf16 weights have no nibble offsets
    arrays = lambda w: (w.packed, w.scale) if int4 else (w,)  # noqa: E731
    params = pl_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    common = dict(parts=parts, wpg=wpg, rows_per_part=f // parts, block_k=cfg.block_k, tokens=t, choices=choices,
                  gather=cfg.scales == "gather", prefetch=cfg.prefetch, ptx=not interpret)

    h_UOTW = pl.pallas_call(
        functools.partial(_gate_up_kernel, block_f=cfg.block_f, n_k=hidden // parts // cfg.block_k, **common),
        out_shape=jax.ShapeDtypeStruct((u, parts, tokens_per_slot, f // parts), jnp.float32),  # [slot, j, token, w]
        grid=(u, f // cfg.block_f),
        compiler_params=params,
        interpret=interpret,
        name="moe_gate_up_gemv",
    )(slots.expert_U, slots.num_used, slots.combine_UT, x_OTW, *x_off, *arrays(experts.gate), *arrays(experts.up))
    h_off = (jax.vmap(nibble_offsets_OTW)(h_UOTW),) if int4 else ()

    y_ZTH = pl.pallas_call(
        functools.partial(_down_kernel, block_h=cfg.block_h, n_k=f // parts // cfg.block_k, splits=splits,
                          slots_per_split=slots_per_split, **common),
        out_shape=jax.ShapeDtypeStruct((splits, t, hidden), jnp.float32),
        grid=(hidden // cfg.block_h, t * splits if pairs else splits),
        compiler_params=params,
        interpret=interpret,
        name="moe_down_gemv",
    )(slots.expert_U, slots.num_used, h_UOTW, *h_off, *arrays(experts.down))
    return jnp.sum(y_ZTH, axis=0).astype(dt)
