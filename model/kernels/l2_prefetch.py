"""A weight's leading rows read into the GPU's L2 cache ahead of the GEMV that streams it.

A decode layer's chain alternates bandwidth-bound GEMVs with stretches of small dependent kernels that read next to
nothing: between q_b and o_proj, the query's absorption, the MLA kernels and w_uv. o_proj's weight ([H, N * Dv]
bf16, 117 MB for Kimi-K2.5, 14.7 MB on one device of eight) cannot start streaming until the attention's output
exists, so the HBM idles through that stretch. `l2_prefetch`, started by the stretch's input, loads the weight's
first rows with L2 eviction priority evict_last (on sm_90 Triton lowers it to `createpolicy.fractional.L2::
evict_last` and loads with that cache hint), so o_proj then finds them in L2 and the other lines it streams are
evicted before them. Each program writes the largest value of its tile: an output, so the loads are kept.

`joined` ties the kernel's output into the consumer of o_proj's output at no cost (a zero times one of its values,
added where XLA fuses it into the split-K sum): XLA removes a kernel nobody reads, and a join at o_proj's input
would be a kernel of its own. Adding 0 * (a finite weight) changes no value.

`l2_prefetch_reference` is the plain jnp form of what the kernel computes (the tile maxima, `l2_prefetch_tiles`); what the kernel is for,
time, only a GPU measures (`python -m bench.labs.l2_prefetch`; docs/performance.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

BLOCK_ROWS = 16  # rows of a program's tile
MAX_BLOCK_COLS = 1024  # columns of a program's tile at most (32 KB of bf16 with BLOCK_ROWS)
DEP = 16  # elements of the starting input each program reads (the kernel waits for it)
MB = 1_000_000


def block_cols(cols: int) -> int | None:
    """The widest power-of-two tile width up to MAX_BLOCK_COLS that divides `cols` (None below 16: too narrow)."""
    width = MAX_BLOCK_COLS
    while width >= 16:
        if cols % width == 0:
            return width
        width //= 2
    return None


def prefetch_rows(rows: int, row_bytes: int, budget_bytes: float) -> int:
    """The leading rows read ahead: as many as fit `budget_bytes`, in whole tiles, at most the weight's."""
    fit = min(rows, int(budget_bytes // max(row_bytes, 1)))
    return fit - fit % BLOCK_ROWS


def _kernel(dep_ref, w_ref, out_ref, first_ref, *, col_blocks: int, width: int):
    pid = pl.program_id(0)
    i, j = jax.lax.div(pid, jnp.int32(col_blocks)), jax.lax.rem(pid, jnp.int32(col_blocks))
    tile = pl_triton.load(w_ref.at[pl.ds(i * BLOCK_ROWS, BLOCK_ROWS), pl.ds(j * width, width)],
                          eviction_policy="evict_last")
    dep = dep_ref[0, pl.ds(0, DEP)].astype(jnp.float32)
    peak = jnp.max(tile.astype(jnp.float32)) + 0.0 * jnp.sum(dep)
    out_ref[pid, :] = jnp.zeros((DEP,), jnp.float32) + peak

    @pl.when(pid == 0)
    def _():
        first_ref[...] = jnp.zeros((1,), jnp.float32) + peak


def l2_prefetch(dep_1D: jax.Array, w_RC: jax.Array, rows: int, interpret: bool = False) -> jax.Array:
    """Reads w's first `rows` rows into L2 once `dep` ([1, >= DEP], the stretch's input) exists. Returns [1]
    float32, the first tile's maximum, for `joined` (a value of its own: a slice of the per-program output would be a
    kernel of its own); every program writes its tile's maximum (`l2_prefetch_tiles`), so its loads are kept."""
    return _l2_prefetch(dep_1D, w_RC, rows, interpret)[1]


def l2_prefetch_tiles(dep_1D: jax.Array, w_RC: jax.Array, rows: int, interpret: bool = False) -> jax.Array:
    """The kernel's per-program output: [programs, DEP] float32, each program's tile maximum
    (`l2_prefetch_reference`)."""
    return _l2_prefetch(dep_1D, w_RC, rows, interpret)[0]


def _l2_prefetch(dep_1D, w_RC, rows: int, interpret: bool):
    width = block_cols(w_RC.shape[1])
    if width is None or rows <= 0 or rows % BLOCK_ROWS or rows > w_RC.shape[0] or dep_1D.shape[-1] < DEP:
        raise ValueError(f"l2_prefetch: {rows} rows of a {tuple(w_RC.shape)} weight (dep {tuple(dep_1D.shape)})")
    col_blocks = w_RC.shape[1] // width
    programs = rows // BLOCK_ROWS * col_blocks
    return pl.pallas_call(
        functools.partial(_kernel, col_blocks=col_blocks, width=width),
        out_shape=(jax.ShapeDtypeStruct((programs, DEP), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.float32)),
        grid=(programs,),
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="l2_prefetch",
    )(dep_1D, w_RC)


def l2_prefetch_reference(dep_1D: jax.Array, w_RC: jax.Array, rows: int) -> jax.Array:
    """What `l2_prefetch` returns, in jnp: the maximum of each [BLOCK_ROWS, width] tile of the first `rows` rows,
    row-block major."""
    width = block_cols(w_RC.shape[1])
    tiles = w_RC[:rows].astype(jnp.float32).reshape(rows // BLOCK_ROWS, BLOCK_ROWS, -1, width)
    maxima = tiles.max(axis=(1, 3)).reshape(-1, 1)
    return jnp.broadcast_to(maxima + 0.0 * dep_1D[0, :DEP].astype(jnp.float32), (maxima.shape[0], DEP))


def joined(y: jax.Array, token_1: jax.Array) -> jax.Array:
    """y, made to wait for the prefetch kernel's output (`l2_prefetch`'s [1]: 0 times it added)."""
    return y + (0.0 * token_1).astype(y.dtype)
