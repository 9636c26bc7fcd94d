"""`python -m bench.labs.l2_prefetch`: can a GEMV's weight rows be read into L2 while the latency-bound kernels before
it run, so that the GEMV, which is bandwidth-bound, finishes sooner?

A decode layer's chain has stretches where the HBM idles: between q_b and o_proj the absorption, the MLA kernels and
w_uv read ~20 MB in ~20 us, then o_proj streams 117 MB. Here a Triton kernel (`l2_prefetch`), started by q_b's
output, loads o_proj's first `rows` rows with L2 eviction priority evict_last while that stretch runs, and its
output is joined after o_proj (0 times it added in the split-K sum XLA runs anyway). H100 / H200 L2: 50 MB. The
engine carried it as `Kernels(prefetch=...)` at commit 2d1ca24; it gained nothing there and cost this lab's layer
1.5-8.9% (docs/performance.md, "o_proj read into L2 while the attention runs"), so only the lab keeps it.

The lab's layer, `--layers` of them with their own weights so no layer finds another's rows in L2:
    q = x[:1536] @ w_qb [1536, 8192]                                  (q_b, 25 MB)
    stretch: q by head @ w_uk [64, 128, 512] -> scores over a [1024, 512] latent cache -> softmax -> context
             @ w_uv [64, 512, 128] -> o [8192]                        (~18 MB)
    y = w_o [7168, 8192] @ o                                          (o_proj as the engine lays it out, 117 MB)
    x' = the next input from y @ w_big [7168, 14336]                  (a MoE-sized read, 205 MB: L2 is flushed)
timed as a device loop of `--steps` passes over the layers (median of `--rounds` interleaved rounds), per layer.
Variants: no read-ahead; one tile row (the kernel and its join at no bytes: what the structure costs); `--rows`.
`--hlo DIR` compiles them for an H200 description on a CPU host (the CUDA plugin, no GPU: `bench.labs.gpu_census`)
and writes each optimised HLO.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

HIDDEN, HEADS, NOPE, LATENT, V_DIM, CONTEXT, Q_LORA = 7168, 64, 128, 512, 128, 1024, 1536

# --- the read-ahead kernel (`Kernels(prefetch=...)` at 2d1ca24) ------------------------------------------------
BLOCK_ROWS = 16  # rows of a program's tile
MAX_BLOCK_COLS = 1024  # columns of a program's tile at most (32 KB of bf16 with BLOCK_ROWS)
DEP = 16  # elements of the starting input each program reads (the kernel waits for it)


def block_cols(cols: int) -> int | None:
    """The widest power-of-two tile width up to MAX_BLOCK_COLS that divides `cols` (None below 16: too narrow)."""
    width = MAX_BLOCK_COLS
    while width >= 16:
        if cols % width == 0:
            return width
        width //= 2
    return None


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
    """What `l2_prefetch_tiles` returns, in jnp: the maximum of each [BLOCK_ROWS, width] tile of the first `rows`
    rows, row-block major."""
    width = block_cols(w_RC.shape[1])
    tiles = w_RC[:rows].astype(jnp.float32).reshape(rows // BLOCK_ROWS, BLOCK_ROWS, -1, width)
    maxima = tiles.max(axis=(1, 3)).reshape(-1, 1)
    return jnp.broadcast_to(maxima + 0.0 * dep_1D[0, :DEP].astype(jnp.float32), (maxima.shape[0], DEP))


def joined(y: jax.Array, token_1: jax.Array) -> jax.Array:
    """y, made to wait for the prefetch kernel's output (`l2_prefetch`'s [1]: 0 times it added)."""
    return y + (0.0 * token_1).astype(y.dtype)


# --- the lab ---------------------------------------------------------------------------------------------------
BIG = 2 * HIDDEN
ROW_BYTES = HEADS * V_DIM * 2  # one row of o_proj's weight [H, N * Dv], bf16


def make_layers(n: int, key) -> list[dict]:
    layers = []
    for i in range(n):
        k = jax.random.split(jax.random.fold_in(key, i), 6)
        def draw(kk, shape, fan):
            return (jax.random.normal(kk, shape, jnp.float32) / fan ** 0.5).astype(jnp.bfloat16)
        layers.append(dict(w_qb=draw(k[0], (Q_LORA, HEADS * NOPE), Q_LORA),
                           w_uk=draw(k[1], (HEADS, NOPE, LATENT), NOPE),
                           cache=draw(k[2], (CONTEXT, LATENT), 1.0),
                           w_uv=draw(k[3], (HEADS, LATENT, V_DIM), LATENT),
                           w_o=draw(k[4], (HIDDEN, HEADS * V_DIM), HEADS * V_DIM),
                           w_big=draw(k[5], (HIDDEN, BIG), HIDDEN)))
    return layers


def layer(x_1H, w: dict, rows: int, interpret: bool = False):
    """One lab layer (module docstring)."""
    q_1Q = x_1H[:, :Q_LORA] @ w["w_qb"]
    q_NDh = q_1Q.reshape(HEADS, NOPE)
    token = l2_prefetch(q_1Q, w["w_o"], rows, interpret) if rows else None
    lat_NL = jnp.einsum("nd,ndl->nl", q_NDh, w["w_uk"], preferred_element_type=jnp.float32)
    s_NS = lat_NL @ w["cache"].astype(jnp.float32).T / LATENT ** 0.5
    ctx_NL = jax.nn.softmax(s_NS, axis=-1) @ w["cache"].astype(jnp.float32)
    o_1O = jnp.einsum("nl,nlv->nv", ctx_NL.astype(jnp.bfloat16), w["w_uv"]).reshape(1, HEADS * V_DIM)
    y_1H = jnp.einsum("bo,ho->bh", o_1O, w["w_o"])
    y_1H = y_1H if token is None else joined(y_1H, token)
    h_1B = y_1H @ w["w_big"]
    x = h_1B[:, :HIDDEN] * jax.nn.sigmoid(h_1B[:, HIDDEN:].astype(jnp.float32)).astype(jnp.bfloat16)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32))) + 1e-6).astype(jnp.bfloat16)
    return x.astype(jnp.bfloat16)


def stack_loop(layers, x_1H, steps, *, rows: int, interpret: bool = False):
    """`steps` passes over the layers in one device loop."""
    def body(_, x):
        for w in layers:
            x = layer(x, w, rows, interpret)
        return x

    return jax.lax.fori_loop(0, steps, body, x_1H)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="passes over the layers a timed call")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--rows", type=int, nargs="+", default=[960, 1952, 2928],
                   help="o_proj weight rows read ahead (16 KB a row: 976 rows are 16 MB)")
    p.add_argument("--hlo", type=Path, default=None, help="compile for an H200 description on this host, write HLO")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    for r in args.rows:
        if r <= 0 or r % BLOCK_ROWS or r > HEADS * V_DIM:
            p.error(f"--rows {r}: a multiple of {BLOCK_ROWS} in 1..{HEADS * V_DIM}")
    chosen = [("none", 0), ("one_tile_row", BLOCK_ROWS)] + [(f"rows{r}", r) for r in args.rows]

    if args.hlo is not None:
        from bench.labs.gpu_census import compile_for, gpu_device
        args.hlo.mkdir(parents=True, exist_ok=True)
        shapes = jax.eval_shape(lambda: make_layers(args.layers, jax.random.key(0)))
        x = jax.ShapeDtypeStruct((1, HIDDEN), jnp.bfloat16)
        for name, rows in chosen:
            fn = functools.partial(stack_loop, steps=2, rows=rows)
            text = compile_for(fn, (shapes, x), (), gpu_device())
            (args.hlo / f"{name}.hlo.txt").write_text(text)
            print(f"{name}: {text.count('custom_call_target=')} custom calls", flush=True)
        return 0

    dev = jax.devices()[0]
    layers = make_layers(args.layers, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, HIDDEN), jnp.float32).astype(jnp.bfloat16)
    progs = {}
    for name, rows in chosen:
        progs[name] = jax.jit(functools.partial(stack_loop, steps=args.steps, rows=rows))
        jax.block_until_ready(progs[name](layers, x))  # compile and warm
        jax.block_until_ready(progs[name](layers, x))
    outputs = {name: prog(layers, x) for name, prog in progs.items()}
    identical = {name: bool(jnp.array_equal(out, outputs["none"])) for name, out in outputs.items()}
    rounds = {name: [] for name in progs}
    for r in range(args.rounds):
        order = list(progs)[r % len(progs):] + list(progs)[:r % len(progs)]
        for name in order:
            t0 = time.perf_counter()
            jax.block_until_ready(progs[name](layers, x))
            rounds[name].append((time.perf_counter() - t0) * 1e6 / (args.steps * args.layers))
    ref = statistics.median(rounds["none"])
    rows_out = []
    for name, rows in chosen:
        med = statistics.median(rounds[name])
        row = dict(variant=name, rows=rows, mb_read_ahead=rows * ROW_BYTES / 1e6,
                   layer_us=med, min_us=min(rounds[name]), max_us=max(rounds[name]), over_none=med / ref,
                   output_identical=identical[name])
        rows_out.append(row)
        print(f"{name:14s} {row['mb_read_ahead']:6.1f} MB  layer {med:7.2f} us ({row['min_us']:.2f}-"
              f"{row['max_us']:.2f})  x{row['over_none']:.4f} of no read-ahead; output identical: "
              f"{identical[name]}", flush=True)
    result = dict(device=str(dev.device_kind), jax=jax.__version__, date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  layers=args.layers, steps=args.steps, rounds=args.rounds, rows=rows_out,
                  note="median of interleaved rounds, us per lab layer (q_b, MLA stretch, o_proj, 205 MB read)")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "l2-prefetch.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
