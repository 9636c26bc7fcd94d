"""`python -m bench.labs.moe_wgmma_lab`: the TMA-pipelined Mosaic GPU MoE (model/kernels/moe_wgmma.py) beside the engine's
Triton kernel, on one Kimi-K2.5 INT4 MoE layer.

Per token count: the plain reference's output, the engine's Triton kernel (model.kernels.kernel_config_for) and
each wgmma variant (pipeline stages, gate_up splits of H, down splits of the choices, overlapped wgmmas, int4
conversion): error against the reference, time of one call (bench.moe_layer.per_call_ms: the difference of two
chain lengths; with `--rounds`, the median of round-robin rounds), the byte
floor of the unique experts read, and the kernels one call launches (the optimized HLO's fusions and custom
calls). `--gate-up-alone` also times the first kernel by itself against its own floor. Records whether XLA copies
the weights when it reinterprets the uint32 words as int4 (an s4 write in the optimized HLO). `--profile` runs
one variant for Nsight Compute (`LAB=moe_wgmma_lab bash bench/scripts/h200_profile.sh`).
Writes moe-wgmma-lab-<device>-<date>.json to --out.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.bytes_floor import HBM_TBS, floor_ms, nbytes  # noqa: E402
from bench.labs.moe_kernel_lab import inputs, moe_layer, run_for_profiler  # noqa: E402
from bench.moe_layer import _rel_err, chain_pair, per_call_ms  # noqa: E402
from bench.report import write_json  # noqa: E402
from bench.timing import summarize_rounds  # noqa: E402
from model.configs import known_config  # noqa: E402
from model.kernels import kernel_config_for, routed_experts_pallas  # noqa: E402
from model.kernels.moe_wgmma import gate_up_sums, routed_experts_wgmma  # noqa: E402
from model.kernels.moe_wgmma_chained import permute_gate_up_rows, routed_experts_chained  # noqa: E402
from model.kernels.moe_wgmma_blocked_down import routed_experts_blocked_down  # noqa: E402
from model.kernels.moe_wgmma_fused import fused_down_layout, routed_experts_fused  # noqa: E402
from model.kernels.moe_wgmma_grouped import routed_experts_grouped  # noqa: E402
from model.kernels.moe_wgmma_persistent import routed_experts_persistent  # noqa: E402
from model.moe import experts_gather  # noqa: E402
from model.router import route  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    p.add_argument("--variants", nargs="+", default=["2:4:8:0:p", "2:4:8:0:m", "2:4:4:0:p", "3:4:8:0:p"],
                   help="STAGES:GATE_UP_SPLITS:DOWN_SPLITS:OVERLAP:CONVERT"
                        "[:PERMUTE_H[:DOWN_STAGES[:ORDER[:DOWN_K_SPLITS[:HALVES[:GROUPS[:DOWN_ROW_BLOCKS]]]]]]] "
                        "(CONVERT p pairs, m mosaic; "
                        "PERMUTE_H a after SiLU (default), b before; DOWN_STAGES the down kernel's, default STAGES; "
                        "ORDER gate_up's grid, o slot slowest (default), i slot fastest; DOWN_K_SPLITS the down "
                        "kernel's splits of F, default 1; HALVES bits 1 gate_up, 2 down: each tile converted and "
                        "multiplied by column halves, default 0; GROUPS: each token's choices in that many groups, "
                        "each its own gate_up -> down chain that CONCURRENT graph scheduling may overlap with the "
                        "next group's, default 1; DOWN_ROW_BLOCKS: blocks of 64 H rows a down step streams, "
                        "default 1) of the wgmma kernel; g:STAGES:GATE_UP_SPLITS[:t|:s] "
                        "the expert-grouped kernel "
                        "(moe_wgmma_grouped.py; :t every group through the token tiles, :s each path in a kernel of "
                        "its own); f[:STAGES[:DOWN_STAGES[:OVERLAP[:DOWN_TILES[:BIASED[:CONVERT]]]]]] the "
                        "one-kernel decode path (moe_wgmma_fused.py; down laid out once before the timings). "
                        "OVERLAP 0 converts each tile after the previous wgmma finished, 1 all of a step's tiles "
                        "first, 2 each while the previous one's wgmma runs; CONVERT n (either kernel): a diagnostic "
                        "with wrong results, ones in place of each int4 tile (streamed, never converted); "
                        "d:GATE_UP_SPLITS:DOWN_SPLITS:DOWN_K_SPLITS "
                        "moe_wgmma's gate_up with the down kernel over F-blocked tiles (moe_wgmma_blocked_down.py); "
                        "c:STAGES:DOWN_STAGES:GATE_UP_SPLITS:DOWN_K_SPLITS[:PERMUTED[:H_PROGRAMS]] gate_up and down in "
                        "one launch, down's programs waiting on semaphores (moe_wgmma_chained.py; PERMUTED 1: gate / "
                        "up rows laid out once in down's nibble-pair order before the timings, down converting by "
                        "pairs; H_PROGRAMS 1: h's B built once per slot and share of F and streamed by down); "
                        "P:PROGRAMS:STAGES:DOWN_PROGRAMS:DOWN_STAGES:GATE_UP_SPLITS:DOWN_SPLITS:DOWN_K_SPLITS both "
                        "kernels with persistent programs, each streaming a run of work items through one pipeline "
                        "(moe_wgmma_persistent.py)")
    p.add_argument("--routing", choices=ROUTINGS, default="random",
                   help="the tokens' inputs: random (each token its own experts), near (token 0's input plus 0.7 x "
                        "noise: mostly shared experts), same (token 0's input: all tokens choose the same 8)")
    p.add_argument("--gate-up-alone", action="store_true", help="also time each variant's gate_up kernel alone")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every candidate this many times, round-robin (machines drift within a call); the row "
                        "keeps each round's time and reports their median")
    p.add_argument("--budget-s", type=float, default=400.0)
    p.add_argument("--profile",
                   help="VARIANT:T (e.g. 2:4:8:0:p:4): run that variant at T tokens 3 times (for ncu) and exit")
    return p.parse_args(argv)


ROUTINGS = ("random", "near", "same")


def routed_inputs(cfg, router, bias, t, key, routing: str):
    """`inputs`, with the tokens' inputs drawn as `--routing` says (verify tokens of one sequence often share
    experts; random inputs rarely do)."""
    x_TH, ids_TK, weights_TK = inputs(cfg, router, bias, t, key)
    if routing == "random" or t == 1:
        return x_TH, ids_TK, weights_TK
    noise = 0.7 if routing == "near" else 0.0
    x_TH = (x_TH[:1].astype(jnp.float32) + noise * x_TH.astype(jnp.float32)).astype(jnp.bfloat16)
    weights_TK, ids_TK = route(x_TH, router, bias, cfg)
    return x_TH, ids_TK, weights_TK


def _on_experts(fn):
    """fn(x, experts, ..) as a candidate: candidates take (experts, fused down layout or None)."""
    return lambda x_TH, pair, ids_TK, weights_TK: fn(x_TH, pair[0], ids_TK, weights_TK)


def _with_fused_down(kernel, x_TH, pair, ids_TK, weights_TK, **options):
    """kernel(x, experts, fused down layout, ids, weights) as a candidate."""
    return kernel(x_TH, pair[0], pair[1], ids_TK, weights_TK, **options)


def _candidate(v: str):
    """(name, fn) of one --variants entry; fn(x, (experts, fused down layout or None, experts with gate / up rows
    permuted or None), ids, weights)."""
    name, fn = _candidate_on_experts(v) if not v.startswith(("f", "d:", "c:")) else (None, None)
    if fn is not None:
        return name, _on_experts(fn)
    if v.startswith("c:"):
        st, dst, gus, dks = v.split(":")[1:5]
        perm, h = _chained_flags(v)
        fn = functools.partial(routed_experts_chained, stages=int(st), down_stages=int(dst), gate_up_splits=int(gus),
                               down_k_splits=int(dks), gate_up_rows_permuted=perm, h_programs=h)
        if perm:  # gate / up rows laid out once before the timings (permute_gate_up_rows)
            return f"chained_{v[2:]}", lambda x_TH, pair, ids_TK, weights_TK: fn(x_TH, pair[2], ids_TK, weights_TK)
        return f"chained_{v[2:]}", _on_experts(fn)
    if v.startswith("d:"):
        _, gus, ds, dks = v.split(":")
        return f"blocked_down_{v[2:]}", functools.partial(_with_fused_down, routed_experts_blocked_down,
                                                          gate_up_splits=int(gus), down_splits=int(ds),
                                                          down_k_splits=int(dks))
    _, *st = v.split(":")
    options = dict(zip(("stages", "down_stages", "overlap", "down_tiles", "biased"), map(int, st[:5])))
    if len(st) > 5:
        options["convert"] = {"p": "pairs", "n": "none"}[st[5]]
    return f"fused_{v}", functools.partial(_with_fused_down, routed_experts_fused, **options)


def _chained_flags(v: str) -> tuple[bool, bool]:
    """(PERMUTED, H_PROGRAMS) of a c:... variant."""
    flags = v.split(":")[5:] + ["0", "0"]
    return flags[0] == "1", flags[1] == "1"


def _candidate_on_experts(v: str):
    if v.startswith("P:"):
        keys = ("programs", "stages", "down_programs", "down_stages", "gate_up_splits", "down_splits", "down_k_splits")
        fields = v.split(":")[1:]
        if len(fields) != len(keys):
            raise ValueError(f"variant {v!r}: P: takes {':'.join(k.upper() for k in keys)}")
        return f"persistent_{v[2:]}", functools.partial(routed_experts_persistent, **dict(zip(keys, map(int, fields))))
    if v.startswith("g:"):
        _, st, gus, *layout = v.split(":")
        paths = {(): "both", ("t",): "tokens", ("s",): "split"}[tuple(layout)]
        return f"grouped_{v[2:]}", functools.partial(routed_experts_grouped, stages=int(st), gate_up_splits=int(gus),
                                                     paths=paths)
    return f"wgmma_{v}", functools.partial(routed_experts_wgmma, **_variant(v))


def _variant(v: str) -> dict:
    st, gus, ds, ov, conv, *rest = v.split(":")
    perm = rest[0] if rest else "a"
    down_st = rest[1] if len(rest) > 1 else st
    order = rest[2] if len(rest) > 2 else "o"
    down_ks = rest[3] if len(rest) > 3 else "1"
    halves = rest[4] if len(rest) > 4 else "0"
    groups = rest[5] if len(rest) > 5 else "1"
    row_blocks = rest[6] if len(rest) > 6 else "1"
    return dict(stages=int(st), gate_up_splits=int(gus), down_splits=int(ds), overlap=int(ov), halves=int(halves),
                convert={"p": "pairs", "m": "mosaic", "n": "none"}[conv], permute_h={"a": "after", "b": "before"}[perm],
                down_stages=int(down_st), slots_inner={"o": False, "i": True}[order], down_k_splits=int(down_ks),
                choice_groups=int(groups), down_row_blocks=int(row_blocks))


def _gate_up_alone(x_TH, experts, ids_TK, weights_TK, *, stages, gate_up_splits, down_splits, overlap, convert,
                   permute_h, down_stages, slots_inner, down_k_splits, halves, choice_groups, down_row_blocks):
    """The gate_up kernel, its output summed to one number so the chained timing has an [T, H] result."""
    del down_splits, permute_h, down_stages, down_k_splits, choice_groups, down_row_blocks
    t, k = ids_TK.shape
    gu = gate_up_sums(x_TH, experts.gate, experts.up, ids_TK.reshape(t * k), choices=k, stages=stages,
                      splits=gate_up_splits, overlap=overlap, convert=convert, slots_inner=slots_inner,
                      halves=bool(halves & 1))
    return jnp.broadcast_to(jnp.sum(gu[:, :, :, :1]), x_TH.shape).astype(x_TH.dtype)


def launches(hlo: str) -> list[str]:
    """The kernels one call launches: the entry computation's fusions and custom calls in the optimized HLO."""
    entry = hlo[hlo.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    return [f"{m.group(1)} {m.group(2)}" for m in re.finditer(r"%(\S+) = (\S+) (?:fusion|custom-call)\(", entry)]


def weight_copies(hlo: str) -> list[str]:
    """Lines of the optimized HLO that write an s4 array (a copy of the reinterpreted weights would show here)."""
    return [ln.strip()[:200] for ln in hlo.splitlines() if re.search(r"=\s*s4\[", ln) and "bitcast" not in ln]


def main(argv=None):
    args = parse_args(argv)
    log = functools.partial(print, flush=True)
    cfg = known_config("kimi-k2.5")
    experts, router, bias = jax.jit(moe_layer, static_argnums=0)(cfg, jax.random.PRNGKey(0))
    jax.block_until_ready(experts)
    per_expert = nbytes(experts) // experts.num_experts
    wanted = [args.profile.rsplit(":", 1)[0]] if args.profile else args.variants
    blocked = any(v.startswith(("f", "d:")) for v in wanted)
    down_fused = jax.jit(fused_down_layout)(experts.down) if blocked else None
    permuted = any(v.startswith("c:") and _chained_flags(v)[0] for v in wanted)
    gate_up_permuted = jax.jit(permute_gate_up_rows)(experts) if permuted else None
    pair = (experts, jax.block_until_ready(down_fused), jax.block_until_ready(gate_up_permuted))
    if args.profile:
        v, t = args.profile.rsplit(":", 1)
        run_for_profiler(_candidate(v)[1], cfg, router, bias, pair, int(t), v, log)
        return
    dev = jax.devices()[0]
    now = datetime.datetime.now(datetime.timezone.utc)
    result = dict(device=dev.device_kind, jax=jax.__version__, date=now.isoformat(timespec="seconds"),
                  routing=args.routing, rows=[])
    t_start = time.time()
    for t in args.tokens:
        x_TH, ids_TK, weights_TK = routed_inputs(cfg, router, bias, t, jax.random.PRNGKey(t), args.routing)
        unique = int(np.unique(np.asarray(ids_TK)).size)
        floor = floor_ms(unique * per_expert + 2 * x_TH.nbytes, HBM_TBS)
        try:
            ref = jax.block_until_ready(jax.jit(experts_gather)(x_TH, experts, ids_TK, weights_TK))
            ref_name = "reference"
        except Exception as e:  # the plain gather of 64+ tokens' experts does not fit: errors against the Triton kernel
            log(f"T={t} reference failed ({type(e).__name__}); rel_err is against the Triton kernel")
            ref = None
            ref_name = "triton"
        candidates = [("triton", _on_experts(functools.partial(routed_experts_pallas,
                                                                 cfg=kernel_config_for(t, experts))))]
        for v in args.variants:
            candidates.append(_candidate(v))
            if args.gate_up_alone and not v.startswith(("g:", "f", "d:", "c:", "P:")):
                candidates.append((f"gate_up_{v}", _on_experts(functools.partial(_gate_up_alone, **_variant(v)))))
        rows, chains = [], {}
        for name, fn in candidates:
            if time.time() - t_start > args.budget_s:
                break
            fl = floor_ms(unique * per_expert * 2 // 3 + x_TH.nbytes, HBM_TBS) if name.startswith("gate_up") else floor
            row = dict(name=name, tokens=t, unique_experts=unique, floor_ms=fl)  # gate_up alone: 2 of 3 matrices
            try:
                compiled = jax.jit(fn).lower(x_TH, pair, ids_TK, weights_TK).compile()  # error and launches
                if ref is None and name == "triton":
                    ref = compiled(x_TH, pair, ids_TK, weights_TK)
                elif not name.startswith("gate_up"):
                    row["rel_err"] = _rel_err(compiled(x_TH, pair, ids_TK, weights_TK), ref)
                    row["rel_err_against"] = ref_name
                if name.startswith(("wgmma", "grouped", "fused", "blocked", "chained", "persistent")):
                    hlo = compiled.as_text()
                    row["launches"] = launches(hlo)
                    log(f"{name}: {len(row['launches'])} launches: {row['launches']}")
                    if "weight_copies" not in result:
                        result["weight_copies"] = weight_copies(hlo)
                        log(f"s4 writes in the optimized HLO: {result['weight_copies'] or 'none'}")
                chains[name] = chain_pair(fn)
            except Exception as e:  # a variant that fails to compile must not end the run
                row["error"] = f"{type(e).__name__}: {e}"[:1500]
                log(f"T={t} {name:18s} failed: {row['error'][:1500]}")
            rows.append(row)
        for r in range(args.rounds):  # round-robin, so a drift of the machine touches every candidate alike
            for row in rows:
                if row["name"] not in chains or time.time() - t_start > args.budget_s:
                    continue
                try:
                    stats = per_call_ms(chains[row["name"]], (x_TH, pair, ids_TK, weights_TK))
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"[:1500]
                    chains.pop(row["name"])
                    log(f"T={t} {row['name']:18s} failed: {row['error'][:1500]}")
                    continue
                row.setdefault("round_ms", []).append(stats["ms"])
                row.setdefault("round_chained_ms", []).append(stats["chained_ms"])
                log(f"T={t} round {r} {row['name']:18s} {row['round_ms'][-1] * 1e3:8.1f} us")
        for row in rows:
            if row.get("round_ms"):
                log(f"T={t} {row['name']:18s} {summarize_rounds(row, row['floor_ms'])}  rel_err "
                    f"{row.get('rel_err', float('nan')):.1e}  rounds " + " ".join(f"{m * 1e3:.1f}" for m in row["round_ms"]))
        result["rows"] += rows
    path = write_json(result, Path(args.out), f"moe-wgmma-lab-{dev.platform}-{now.strftime('%Y%m%d-%H%M')}")
    log(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
