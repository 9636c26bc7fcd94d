"""A diagnostic kernel: TMA pipelines that stream the weight tiles of one MoE layer's routed experts and do no
int4 conversion and no wgmma, so what they take is the streaming alone (bench/labs/tma_stream_lab.py times them).

Each program adds the first 4 rows of every landed tile (the first 16 of its scales) into a small checksum in shared
memory and stores it at its end; `checksums_reference` computes the same sums with numpy, which is how the CPU test
holds the index maps to the tiles they are meant to read (random tiles differ in their first rows). One add a tile:
folding all 64 rows (16 dependent read-modify-writes of shared memory a tile) took ~1.7 us a step with one program an
SM, which timed the checksum, not the stream (tma-stream-lab-gpu-20261130-2246). The streams:
- "gate_up": moe_wgmma's gate_up grid (slot, block of 64 F rows, split of H), `steps` = the split's tiles; each step
  one gate and one up tile ([64 rows, 256 int4] = 64 rows of 128 bytes), with `scales` their [64, 8] bf16 scales
  (`rows`: tiles of that many rows instead of 64, the grid's row blocks as large);
- "down": moe_wgmma's down grid (block of 64 H rows, token x split of choices x split of F) at one token;
- "persistent": the gate_up steps in (slot, row block, k) order, `programs` programs each streaming one run of
  consecutive steps through one pipeline (one ramp a program; the last program's run is clamped to the last step,
  so a few tiles are read twice and counted);
- "contiguous": as "persistent" over 8 KB pieces of the same experts' words read as they lie in memory.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from model.kernels.moe_wgmma import ROWS, TILE_K, _interpret_kw

WORDS = TILE_K // 8  # uint32 words of a tile row: 128 bytes
SCALES = TILE_K // 32  # bf16 scales of a tile row (group size 32)
FOLD_W, FOLD_S = 4, 16  # checksum rows of a tile / its scales: one value a thread of the warpgroup


@dataclasses.dataclass(frozen=True)
class Stream:
    kind: str  # "gate_up" | "down" | "persistent" | "contiguous"
    stages: int = 2
    splits: int = 1  # gate_up: splits of H; down: splits of the choices
    k_splits: int = 1  # down: splits of F
    programs: int = 132  # persistent / contiguous
    scales: bool = False
    rows: int = ROWS  # weight rows of a tile (moe_wgmma's: one wgmma's M)

    def __post_init__(self):
        if self.kind not in ("gate_up", "down", "persistent", "contiguous"):
            raise ValueError(f"stream kind must be gate_up, down, persistent or contiguous, not {self.kind!r}")
        if self.rows % 8 or not FOLD_S <= self.rows <= 256:
            raise ValueError(f"stream rows={self.rows}: a multiple of 8 from {FOLD_S} to 256 (a TMA box)")
        if min(self.stages, self.splits, self.k_splits, self.programs) < 1:
            raise ValueError(f"stream {self}: stages, splits, k_splits and programs must be at least 1")
        if self.kind == "contiguous" and self.scales:
            raise ValueError("the contiguous stream reads no scales")


def grid_of(s: Stream, slots: int, choices: int, f: int, h: int) -> tuple[int, int, tuple[int, ...]]:
    """(programs, steps a program, pipeline grid) of stream `s` over `slots` = T x `choices` slots."""
    if s.kind == "gate_up":
        tiles = h // TILE_K
        if tiles % s.splits:
            raise ValueError(f"gate_up splits={s.splits} must divide the {tiles} tiles of H")
        return slots * (f // s.rows) * s.splits, tiles // s.splits, (tiles // s.splits,)
    if s.kind == "down":
        tiles = f // TILE_K
        if choices % s.splits or tiles % s.k_splits:
            raise ValueError(f"down splits={s.splits} / k_splits={s.k_splits} must divide {choices} choices / "
                             f"{tiles} tiles of F")
        per = choices // s.splits
        steps = per * (tiles // s.k_splits)
        return (h // s.rows) * (slots // choices) * s.splits * s.k_splits, steps, (per, tiles // s.k_splits)
    total = slots * (f // s.rows) * (h // TILE_K)  # gate / up steps; contiguous: the same number of pieces
    steps = math.ceil(total / s.programs)
    return s.programs, steps, (steps,)


def _dims(s: Stream, mats) -> tuple[int, int, int]:
    """(experts, F, H) of the stream's matrices: gate / up are [E, F, H], down [E, H, F]."""
    e, out_dim, in_dim = mats[0].shape
    return (e, in_dim, out_dim) if s.kind == "down" else (e, out_dim, in_dim)


def step_tile(s: Stream, slots: int, choices: int, f: int, h: int, p, j: tuple, minimum=min) -> tuple:
    """(slot, row block, k tile) that pipeline step j (its grid indices) of program p reads; for "contiguous"
    (slot, piece, 0). Plain ints here and in `tiles_read`; traced values with `minimum=jnp.minimum` in the kernel's
    index maps, so the checksums' reference follows the very mapping the kernel streams."""
    _, steps, grid = grid_of(s, slots, choices, f, h)
    if s.kind == "gate_up":
        slot, rb, split = p // ((f // s.rows) * s.splits), p // s.splits % (f // s.rows), p % s.splits
        return slot, rb, split * steps + j[0]
    if s.kind == "down":
        per, n_k = grid
        ts = s.splits * s.k_splits
        rb, rest = p // ((slots // choices) * ts), p % ((slots // choices) * ts)
        t, split, ks = rest // ts, rest % ts // s.k_splits, rest % s.k_splits
        return t * choices + split * per + j[0], rb, ks * n_k + j[1]
    per_slot = (f // s.rows) * (h // TILE_K)
    g = minimum(p * steps + j[0], slots * per_slot - 1)
    if s.kind == "persistent":
        return g // per_slot, g // (h // TILE_K) % (f // s.rows), g % (h // TILE_K)
    return g // per_slot, g % per_slot, 0


def tiles_read(s: Stream, slots: int, choices: int, f: int, h: int) -> list[tuple[int, int, int, int]]:
    """(program, slot, row block, k tile) of every step in pipeline order (for "contiguous": (program, slot, piece,
    0)); what the checksums cover and the bytes counted."""
    programs, _, grid = grid_of(s, slots, choices, f, h)
    return [(p, *step_tile(s, slots, choices, f, h, p, j)) for p in range(programs) for j in np.ndindex(*grid)]


def bytes_read(s: Stream, slots: int, choices: int, f: int, h: int, mats: int = 2) -> int:
    """Weight (and scale) bytes the stream reads over `mats` matrices (gate and up; "down": one), repeats included."""
    per_tile = s.rows * WORDS * 4 + (s.rows * SCALES * 2 if s.scales else 0)
    return len(tiles_read(s, slots, choices, f, h)) * per_tile * (1 if s.kind == "down" else mats)


def stream_checksums(s: Stream, expert_U, mats, *, choices: int, interpret: bool = False):
    """Run stream `s`: `mats` = (gate, up) or (down,) Int4Weights [E, out, in]; returns per program the sums over its
    tiles of their first rows ([programs, FOLD_W, WORDS] uint32 of the words, [programs, FOLD_S, SCALES] f32 of the
    scales)."""
    e, f, h = _dims(s, mats)
    slots = expert_U.shape[0]
    programs, _, grid = grid_of(s, slots, choices, f, h)
    per_slot = (f // s.rows) * (h // TILE_K)

    def index(ids_ref, p, *j):
        """(expert, row block, k tile) of pipeline step j of program p (for "contiguous": (piece, 0, 0))."""
        slot, a, b = step_tile(s, slots, choices, f, h, p, j, minimum=jnp.minimum)
        return (ids_ref[slot] * per_slot + a, 0, 0) if s.kind == "contiguous" else (ids_ref[slot], a, b)

    def kernel(ids_ref, *refs):
        n_in = len(refs) - 2
        ins, out_w, out_s = refs[:n_in], refs[n_in], refs[n_in + 1]
        p = jax.lax.axis_index("p")

        def body(acc_w, acc_s):
            acc_w[...] = jnp.zeros((FOLD_W, WORDS), jnp.uint32)
            acc_s[...] = jnp.zeros((FOLD_S, SCALES), jnp.float32)

            def step(_, *tiles):
                per = 2 if s.scales else 1
                for m in range(len(tiles) // per):
                    w = tiles[m * per]
                    acc_w[...] += w[:FOLD_W, :]
                    if s.scales:
                        acc_s[...] += tiles[m * per + 1][:FOLD_S, :].astype(jnp.float32)

            w_spec = plgpu.BlockSpec((None, s.rows, WORDS), lambda *j: index(ids_ref, p, *j))
            s_spec = plgpu.BlockSpec((None, s.rows, SCALES), lambda *j: index(ids_ref, p, *j))
            specs = [w_spec, s_spec] * (n_in // 2) if s.scales else [w_spec] * n_in
            plgpu.emit_pipeline(step, grid=grid, in_specs=specs, max_concurrent_steps=s.stages)(*ins)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(acc_w, out_w.at[p])
            plgpu.copy_smem_to_gmem(acc_s, out_s.at[p])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(body, plgpu.SMEM((FOLD_W, WORDS), jnp.uint32), plgpu.SMEM((FOLD_S, SCALES), jnp.float32))

    ins = []
    for m in mats:
        words = m.packed
        if s.kind == "contiguous":  # the expert's words as consecutive [s.rows, WORDS] pieces
            words = words.reshape(e * per_slot, s.rows, WORDS)
        ins += [words, m.scale] if s.scales else [words]
    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((programs, FOLD_W, WORDS), jnp.uint32),
                  jax.ShapeDtypeStruct((programs, FOLD_S, SCALES), jnp.float32)),
        grid=(programs,), grid_names=("p",),
        **_interpret_kw(interpret),
    )(expert_U.astype(jnp.int32), *ins)


def checksums_reference(s: Stream, expert_U, mats, *, choices: int):
    """numpy: the same folded sums from `tiles_read`."""
    e, f, h = _dims(s, mats)
    slots = int(expert_U.shape[0])
    programs, _, _ = grid_of(s, slots, choices, f, h)
    ids = np.asarray(expert_U)
    words = [np.asarray(m.packed) for m in mats]
    scales = [np.asarray(m.scale.astype(jnp.float32)) for m in mats]
    acc_w = np.zeros((programs, FOLD_W, WORDS), np.uint32)
    acc_s = np.zeros((programs, FOLD_S, SCALES), np.float32)
    per_slot = (f // s.rows) * (h // TILE_K)
    for p, slot, a, b in tiles_read(s, slots, choices, f, h):
        for w, sc in zip(words, scales):
            if s.kind == "contiguous":
                tile = w.reshape(e * per_slot, s.rows, WORDS)[ids[slot] * per_slot + a]
            else:
                tile = w[ids[slot], a * s.rows:(a + 1) * s.rows, b * WORDS:(b + 1) * WORDS]
                if s.scales:
                    acc_s[p] += sc[ids[slot], a * s.rows:a * s.rows + FOLD_S, b * SCALES:(b + 1) * SCALES]
            acc_w[p] += tile[:FOLD_W]
    return acc_w, acc_s
