"""`python -m bench.labs.tma_stream_lab`: how fast TMA pipelines stream one Kimi-K2.5 MoE layer's routed-expert tiles at
one token when they do nothing else (bench/labs/tma_stream.py: no int4 conversion, no wgmma), beside XLA reading the
same experts and the engine's kernels on the same tiles.

The question (bench/results/README.md, runs 19-21): at one token the engine's gate_up kernel streams ~3.4 TB/s and
its down kernel ~3.0, also with the conversion left out, where XLA's lm_head GEMV reads 4.3. If a pure stream over
the same grid is as slow, the grid (1792 programs of 4 steps, 2 in flight) is the limit and persistent programs
(one pipeline a program) are the way; if it is fast, the kernels' own work is. Run 22's answer: neither; at
these sizes every read, XLA's own included, runs at 3.0-3.5 TB/s, and XLA reads a layer's bytes in two dependent
phases (`xla2`) at 1.23-1.31x of the floor (bench/results/README.md, run 22).

Variants (--variants):
  g:STAGES:SPLITS[:s]          gate_up's grid (slot, 64 F rows, split of H): a gate and an up tile a step
  d:STAGES:SPLITS:KSPLITS[:s]  down's grid (64 H rows, token x split of choices x split of F)
  p:STAGES:PROGRAMS[:s]        gate_up's tiles from PROGRAMS persistent programs (consecutive steps each)
  c:STAGES:PROGRAMS            as p over contiguous 8 KB pieces of the same experts
  cd:STAGES:PROGRAMS           as c over the experts' down words
  xla                          XLA's reduction over the same 8 experts' gate and up words and scales
  xla2                         as xla, then (depending on its sum) a reduction over 8 experts' down: a layer's
                               bytes read by XLA in two dependent phases, as the kernels read them
  xlad                         XLA's reduction over 8 experts' down words and scales
  eg:STAGES:SPLITS             the engine's gate_up kernel (moe_wgmma.gate_up_sums) on the same tiles
  ed:STAGES:SPLITS:KSPLITS[:rROWS]  the engine's down kernel (moe_wgmma.down_sums; ROWS: its row_blocks x 64)
  pg:PROGRAMS:STAGES:SPLITS    the persistent gate_up kernel (moe_wgmma_persistent.gate_up_sums)
  pd:PROGRAMS:STAGES:SPLITS:KSPLITS  the persistent down kernel
  layer                        the engine's routed experts at one token (moe_wgmma at wgmma_config_for's splits):
                               beside xla2 in the same call, the layer against a plain read of its bytes
`:s`: the stream also reads each tile's [64, 8] bf16 scales (16-byte rows), as the kernels do; `:rROWS` (g, d, ed):
tiles of ROWS rows (default 64), the grid's row blocks as large.

Each call is timed as in bench.moe_layer: calls chained in a device loop (each on the next 8 experts, so nothing is
hoisted), the difference of a 3 x --reps- and a --reps-call chain over the extra calls, medians of synchronised runs
after warm-up, in round-robin rounds. TB/s = bytes read / time; the byte floor is at 4.3 TB/s. Every stream's
checksums are compared with numpy (bench.labs.tma_stream.checksums_reference) once, untimed. `--tiny`: small dims in
Pallas' interpreter (the CPU check). Writes tma-stream-lab-<platform>-<date>.json and .md to --out.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.bytes_floor import HBM_TBS  # noqa: E402
from bench.report import write_report  # noqa: E402
from bench.moe_layer import REPS, per_call_ms  # noqa: E402
from bench.timing import summarize_rounds  # noqa: E402
from bench.labs.tma_stream import FOLD_S, Stream, bytes_read, checksums_reference, stream_checksums  # noqa: E402
from model.kernels import moe_wgmma, moe_wgmma_persistent, wgmma_config_for  # noqa: E402
from model.kernels.moe_wgmma import ROWS  # noqa: E402
from model.moe import ExpertWeights, experts_gather  # noqa: E402
from model.quant import Int4Weight  # noqa: E402

K2_DIMS = dict(experts=384, f=2048, h=7168, choices=8)
TINY_DIMS = dict(experts=6, f=512, h=512, choices=4)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--variants", nargs="+",
                   default=["xla", "xla2", "g:2:7", "g:2:7:s", "eg:2:7", "p:8:132:s", "p:4:264:s", "c:8:132",
                            "pg:132:8:1", "pg:264:4:1", "d:2:8:2:s", "ed:2:8:2", "pd:132:8:8:2"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=REPS, help="calls in the short chain (the long one: 3x)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=400.0)
    p.add_argument("--tiny", action="store_true", help="small dims in Pallas' interpreter: the CPU check")
    args = p.parse_args(argv)
    for name in ("rounds", "iters", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    for v in args.variants:
        try:
            _parse(v)
        except ValueError as e:
            p.error(f"--variants {v!r}: {e}")
    return args


def _parse(v: str) -> tuple[str, tuple[int, ...], bool, int]:
    """(kind, integer fields, scales flag, rows of a tile) of a --variants entry."""
    kind, *fields = v.split(":")
    rows = ROWS
    while fields and fields[-1][:1] == "r" and fields[-1][1:].isdigit():
        rows = int(fields.pop()[1:])
    scales = bool(fields) and fields[-1] == "s"
    fields = fields[:-1] if scales else fields
    arity = {"xla": 0, "xla2": 0, "xlad": 0, "layer": 0, "g": 2, "d": 3, "p": 2, "c": 2, "cd": 2, "eg": 2, "ed": 3, "pg": 3,
             "pd": 4}
    if kind not in arity:
        raise ValueError(f"unknown kind {kind!r} (one of {', '.join(arity)})")
    bad_flag = (scales and kind not in ("g", "d", "p")) or (rows != ROWS and kind not in ("g", "d", "ed"))
    if len(fields) != arity[kind] or bad_flag:
        raise ValueError(f"{kind} takes {arity[kind]} integer fields" + (" and :s" if kind in "gdp" else "")
                         + (" and :rROWS" if kind in ("g", "d", "ed") else ""))
    try:
        nums = tuple(int(x) for x in fields)
    except ValueError:
        raise ValueError(f"fields must be integers, got {fields}") from None
    if any(n < 1 for n in nums):
        raise ValueError("fields must be at least 1")
    if rows % 8 or not FOLD_S <= rows <= 256:
        raise ValueError(f"rows {rows}: a multiple of 8 from {FOLD_S} to 256")
    return kind, nums, scales, rows


def stream_of(kind: str, nums: tuple[int, ...], scales: bool, rows: int = ROWS) -> Stream | None:
    if kind == "g":
        return Stream("gate_up", stages=nums[0], splits=nums[1], scales=scales, rows=rows)
    if kind == "d":
        return Stream("down", stages=nums[0], splits=nums[1], k_splits=nums[2], scales=scales, rows=rows)
    if kind == "p":
        return Stream("persistent", stages=nums[0], programs=nums[1], scales=scales)
    if kind in ("c", "cd"):
        return Stream("contiguous", stages=nums[0], programs=nums[1])
    return None


def _weights(key, *, dims):
    """Random INT4 experts with random scales (model.init's are constant, under which the scale checksums could not
    tell one tile from another)."""
    e, f, h = dims["experts"], dims["f"], dims["h"]

    def int4(k, out, inp):
        kb, ks = jax.random.split(k)
        return Int4Weight(jax.random.bits(kb, (e, out, inp // 8), jnp.uint32),
                          (0.01 + 0.05 * jax.random.uniform(ks, (e, out, inp // 32))).astype(jnp.bfloat16))

    kg, ku, kd = jax.random.split(key, 3)
    return dict(gate=int4(kg, f, h), up=int4(ku, f, h), down=int4(kd, h, f))


def router_weights(choices: int) -> jax.Array:
    """[1, choices] router weights of the `layer` variant's one token (fixed: the timing does not depend on them)."""
    return jnp.linspace(0.5, 1.0, choices, dtype=jnp.float32)[None]


def _expert_bytes(w: Int4Weight) -> int:
    return (w.packed.nbytes + w.scale.nbytes) // w.packed.shape[0]


def call_of(v: str, weights: dict, dims, interpret: bool):
    """(call(ids_U, weights, x_TH, h_UF), weight and scale bytes a call reads, Stream or None) at one token."""
    kind, nums, scales, rows = _parse(v)
    f, h, choices = dims["f"], dims["h"], dims["choices"]
    gate_up_bytes = choices * (_expert_bytes(weights["gate"]) + _expert_bytes(weights["up"]))
    down_bytes = choices * _expert_bytes(weights["down"])
    s = stream_of(kind, nums, scales, rows)
    if s is not None:
        mats = ("down",) if s.kind == "down" or kind == "cd" else ("gate", "up")

        def call(ids, w, x, hh):
            return stream_checksums(s, ids, tuple(w[m] for m in mats), choices=choices, interpret=interpret)

        return call, bytes_read(s, choices, choices, f, h, mats=len(mats)), s
    if kind in ("xla", "xla2", "xlad"):
        def read(w, first, mats):  # 8 consecutive experts from `first`: the same bytes as 8 routed ones
            start = jnp.minimum(first, w["gate"].packed.shape[0] - choices)
            part = lambda a: jax.lax.dynamic_slice_in_dim(a, start, choices)  # noqa: E731
            words = sum(jnp.sum(part(w[m].packed), dtype=jnp.uint32) for m in mats)
            return words, sum(jnp.sum(part(w[m].scale), dtype=jnp.float32) for m in mats)

        def call(ids, w, x, hh):
            if kind == "xlad":
                return read(w, ids[0], ("down",))
            words, scales = read(w, ids[0], ("gate", "up"))
            if kind == "xla":
                return words, scales
            # the down read starts where the first read's sum says (never moves it, but XLA cannot know)
            after = ids[1] + jnp.where(words == jnp.uint32(12345), 1, 0)
            down_words, down_scales = read(w, after, ("down",))
            return words + down_words, scales + down_scales

        return call, {"xla": gate_up_bytes, "xla2": gate_up_bytes + down_bytes, "xlad": down_bytes}[kind], None
    if kind == "layer":
        experts = ExpertWeights(weights["gate"], weights["up"], weights["down"])
        options = wgmma_config_for(experts, choices, 1)
        router_TK = router_weights(choices)

        def call(ids, w, x, hh):
            return moe_wgmma.routed_experts_wgmma(x, ExpertWeights(w["gate"], w["up"], w["down"]), ids[None],
                                                  router_TK, interpret=interpret, **options)

        return call, gate_up_bytes + down_bytes, None
    if kind == "eg":
        def call(ids, w, x, hh):
            return moe_wgmma.gate_up_sums(x, w["gate"], w["up"], ids, choices=choices, stages=nums[0],
                                          splits=nums[1], interpret=interpret)
    elif kind == "pg":
        def call(ids, w, x, hh):
            return moe_wgmma_persistent.gate_up_sums(x, w["gate"], w["up"], ids, choices=choices, programs=nums[0],
                                                     stages=nums[1], splits=nums[2], interpret=interpret)
    elif kind == "ed":
        def call(ids, w, x, hh):
            return moe_wgmma.down_sums(hh, w["down"], ids, choices=choices, stages=nums[0], splits=nums[1],
                                       k_splits=nums[2], row_blocks=rows // ROWS, interpret=interpret)
    else:  # pd
        def call(ids, w, x, hh):
            return moe_wgmma_persistent.down_sums(hh, w["down"], ids, choices=choices, programs=nums[0],
                                                  stages=nums[1], splits=nums[2], k_splits=nums[3],
                                                  interpret=interpret)
    return call, gate_up_bytes if kind in ("eg", "pg") else down_bytes, None


def chain(call, reps: int, num_experts: int):
    """`reps` calls in one device loop, call i on the experts ids + i (so no call is loop-invariant)."""
    def run(ids_U, weights, x_TH, h_UF):
        out = jax.eval_shape(call, ids_U, weights, x_TH, h_UF)
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), out)
        return jax.lax.fori_loop(0, reps, lambda i, _: call((ids_U + i) % num_experts, weights, x_TH, h_UF), zeros)

    return jax.jit(run)


def check(call, stream: Stream, args, choices: int, down: bool) -> bool:
    """The stream's checksums equal numpy's for the tiles it is meant to read (`down`: of the down matrices)."""
    ids, weights = args[0], args[1]
    got_w, got_s = jax.jit(call)(*args)
    mats = (weights["down"],) if down else (weights["gate"], weights["up"])
    ref_w, ref_s = checksums_reference(stream, ids, mats, choices=choices)
    return bool(np.array_equal(np.asarray(got_w), ref_w) and np.allclose(np.asarray(got_s), ref_s, rtol=1e-4))


def layer_rel_err(call, args) -> float:
    """The engine's routed experts (`layer`) against the plain reference `experts_gather` on the same inputs."""
    ids, w, x, hh = args
    experts = ExpertWeights(w["gate"], w["up"], w["down"])
    got = np.asarray(jax.jit(call)(*args), np.float64)
    ref = np.asarray(jax.jit(experts_gather)(x.astype(jnp.float32), experts, ids[None], router_weights(ids.shape[0])),
                     np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def engine_rel_err(v: str, call, args, choices: int, interpret: bool) -> float:
    """A persistent kernel's sums (pg / pd) against moe_wgmma's kernel with the same splits, over the splits."""
    kind, nums, _, _ = _parse(v)
    ids, w, x, hh = args
    if kind == "pg":
        ref = moe_wgmma.gate_up_sums(x, w["gate"], w["up"], ids, choices=choices, splits=nums[2], interpret=interpret)
    else:
        ref = moe_wgmma.down_sums(hh, w["down"], ids, choices=choices, splits=nums[2], k_splits=nums[3],
                                  interpret=interpret)
    got, ref = (np.asarray(a, np.float64).sum(0) for a in (jax.jit(call)(*args), ref))
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def markdown(result: dict) -> str:
    lines = [f"# TMA streaming lab ({result['device']}, jax {result['jax']}, {result['date']})", "",
             f"One token, {result['dims']}; median of {result['rounds']} round-robin rounds, each call the difference "
             f"of a {3 * result['reps']}- and a {result['reps']}-call chain. Floor at {HBM_TBS} TB/s.", "",
             "| variant | bytes (MB) | us | TB/s | x floor | checksums | rounds (us) |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "ms" not in r:
            lines.append(f"| {r['variant']} | {r['bytes'] / 1e6:.1f} | failed: {r.get('error', '')[:120]} | | | | |")
            continue
        rounds = " ".join(f"{m * 1e3:.1f}" for m in r["round_ms"])
        lines.append(f"| {r['variant']} | {r['bytes'] / 1e6:.1f} | {r['ms'] * 1e3:.1f} | {r['tbs']:.2f} | "
                     f"{r['ratio']:.2f} | {r.get('checksums', '')} | {rounds} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    log = functools.partial(print, flush=True)
    dims = TINY_DIMS if args.tiny else K2_DIMS
    weights = jax.block_until_ready(jax.jit(functools.partial(_weights, dims=dims))(jax.random.PRNGKey(0)))
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.permutation(dims["experts"])[:dims["choices"]].astype(np.int32))
    x_TH = jax.random.normal(jax.random.PRNGKey(2), (1, dims["h"])).astype(jnp.bfloat16)
    h_UF = jax.random.normal(jax.random.PRNGKey(3), (dims["choices"], dims["f"]), jnp.float32)
    call_args = (ids, weights, x_TH, h_UF)
    dev = jax.devices()[0]
    now = datetime.datetime.now(datetime.timezone.utc)
    result = dict(device=dev.device_kind, jax=jax.__version__, date=now.isoformat(timespec="seconds"),
                  dims=dims, rounds=args.rounds, reps=args.reps, rows=[])
    t_start = time.time()
    rows, chains = [], {}
    for v in args.variants:
        call, nbytes, stream = call_of(v, weights, dims, args.tiny)
        row = dict(variant=v, bytes=nbytes, floor_ms=nbytes / (HBM_TBS * 1e12) * 1e3)
        try:
            if stream is not None:
                row["checksums"] = "ok" if check(call, stream, call_args, dims["choices"],
                                                     stream.kind == "down" or v.startswith("cd:")) else "WRONG"
                log(f"{v}: checksums {row['checksums']}")
            elif v == "layer":
                row["rel_err_vs_reference"] = layer_rel_err(call, call_args)
                row["checksums"] = f"rel_err {row['rel_err_vs_reference']:.1e} vs experts_gather"
                log(f"{v}: {row['checksums']}")
            elif v.startswith(("pg:", "pd:")):
                row["rel_err_vs_engine"] = engine_rel_err(v, call, call_args, dims["choices"], args.tiny)
                row["checksums"] = f"rel_err {row['rel_err_vs_engine']:.1e} vs moe_wgmma"
                log(f"{v}: {row['checksums']}")
            chains[v] = tuple(chain(call, n, dims["experts"]) for n in (args.reps, 3 * args.reps))
        except Exception as e:  # a variant that fails to compile must not end the run
            row["error"] = f"{type(e).__name__}: {e}"[:1500]
            log(f"{v} failed: {row['error']}")
        rows.append(row)
    for r in range(args.rounds):  # round-robin: a drift of the machine touches every variant alike
        for row in rows:
            if row["variant"] not in chains or time.time() - t_start > args.budget_s:
                continue
            try:
                row.setdefault("round_ms", []).append(per_call_ms(chains[row["variant"]], call_args, args.iters,
                                                                  args.reps)["ms"])
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:1500]
                chains.pop(row["variant"])
                log(f"{row['variant']} failed: {row['error']}")
                continue
            log(f"round {r} {row['variant']:16s} {row['round_ms'][-1] * 1e3:8.1f} us")
    for row in rows:
        if row.get("round_ms"):
            summary = summarize_rounds(row, row["floor_ms"])
            row["tbs"] = row["bytes"] / (row["ms"] * 1e-3) / 1e12
            log(f"{row['variant']:16s} {summary}  {row['tbs']:.2f} TB/s  {row['bytes'] / 1e6:.1f} MB")
    result["rows"] = rows
    stem = f"tma-stream-lab-{dev.platform}-{now.strftime('%Y%m%d-%H%M')}"
    path = write_report(result, Path(args.out), stem, markdown)
    log(f"wrote {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
