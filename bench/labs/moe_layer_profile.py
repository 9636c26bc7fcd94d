"""`python -m bench.labs.moe_layer_profile`: where one MoE layer call's time goes when it is timed alone.

The "MoE layer alone" rows (bench.step, bench.moe_layer, the labs) time the engine's routed experts as calls
chained in one device loop (bench.moe_layer._chained). Up to run 12 a call was a REPS-call chain's time / REPS;
inside a decode step the same kernels took less (run 12: 193 us against 229.5 at four tokens). Per token count
this tool times, each the median of synchronised runs after warm-up:
- `chained_us`: that old figure, a REPS-call chain / REPS;
- `call_us`: one call as the difference of a LONG_REPS-call chain and a REPS-call chain (bench.moe_layer.per_call_ms,
  what the benchmarks report now), so the chain's fixed cost per run cancels;
- `grouped_us`: the same with `--calls-per-iteration` calls written out in each loop iteration (the loop's own
  per-iteration cost shared among them);
- `harness_us`: the chain with the layer replaced by one elementwise op (the loop and the chaining add);
and traces one REPS-call chain with jax.profiler: the kernels of one call in launch order with the gaps before
them, kernel time, the union of kernel intervals (busy) and span per call, the steady span per call over the
second half of the chain, and every kernel's start in the JSON's `timeline`.
On a CPU the XLA thunks of the host trace stand in for kernels (smoke check only).
Writes moe-layer-profile-<platform>-<date>.json and .md to --out.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.bytes_floor import HBM_TBS, floor_ms, nbytes  # noqa: E402
from bench.labs.moe_kernel_lab import inputs, moe_layer  # noqa: E402
from bench.moe_layer import LONG_REPS, REPS, chain_pair, per_call_ms  # noqa: E402
from bench.report import write_json  # noqa: E402
from bench.labs.step_profile import busy_ns, by_kernel, traced_events  # noqa: E402
from model.configs import known_config  # noqa: E402
from model.kernels import moe_kernel_for, moe_wgmma, routed_experts_for_backend, wgmma_config_for  # noqa: E402


def _scale_layer(x_TH, experts, ids_TK, weights_TK):
    """The harness with the layer replaced by one elementwise op (a layer of zeros, XLA folds the chain away):
    what the loop and the chaining cost around the call."""
    del experts, ids_TK
    return x_TH * weights_TK[:, :1].astype(x_TH.dtype)


def trace_chain(chain, args) -> dict:
    """Trace one (warm) call of the chain: per-layer-call kernel table, busy / span / kernel sums."""
    events, _ = traced_events(lambda: chain(*args))
    ordered = sorted(events, key=lambda e: e["start_ns"])
    per_call = round(len(events) / REPS)
    half = (REPS // 2) * per_call  # the first kernel of the chain's second half, past its start-up
    middle = ordered[half:half + per_call]  # one call away from the loop's ends
    end_ns = ordered[-1]["start_ns"] + ordered[-1]["duration_ns"]
    span_ns = end_ns - ordered[0]["start_ns"]
    return dict(
        kernels_per_call=len(events) / REPS,
        kernel_us_per_call=sum(e["duration_ns"] for e in events) / 1e3 / REPS,
        busy_us_per_call=busy_ns(events) / 1e3 / REPS,
        span_us_per_call=span_ns / 1e3 / REPS,
        steady_span_us_per_call=(end_ns - ordered[half]["start_ns"]) / 1e3 / (REPS - REPS // 2),
        one_call=[dict(kernel=e["name"], us=e["duration_ns"] / 1e3,
                       gap_before_us=(e["start_ns"] - p["start_ns"] - p["duration_ns"]) / 1e3 if p else None)
                  for p, e in zip([None, *middle[:-1]], middle)],
        # every kernel of the traced run in launch order: start (us from the first) and duration
        timeline=[(e["name"][:60], round((e["start_ns"] - ordered[0]["start_ns"]) / 1e3, 2),
                   round(e["duration_ns"] / 1e3, 2)) for e in ordered],
        kernels=[dict(kernel=g["kernel"], us_per_call=g["ns"] / 1e3 / REPS, calls_per_call=g["count"] / REPS)
                 for g in by_kernel(events)],
    )


def markdown(result: dict) -> str:
    lines = [f"# MoE layer profile: {result['device']}, jax {result['jax']}, {result['date']}", "",
             "One Kimi-K2.5 INT4 MoE layer's routed experts as the engine dispatches them, chained in one device loop "
             f"(bench.moe_layer._chained). call = (chain of {LONG_REPS} - chain of {REPS}) / {LONG_REPS - REPS}; "
             f"chained = chain of {REPS} / {REPS} (the figure up to run 12); grouped = call with "
             f"{result['calls_per_iteration']} calls per loop iteration; harness = call with the layer replaced by one "
             f"elementwise op. Medians of synchronised runs after warm-up; the kernel columns come from one traced "
             f"chain of {REPS} (device times; steady span over its second half).", "",
             "| T | kernel | floor us | call us | x floor | chained us | x floor | grouped us | harness us | "
             "kernels / call | kernel us | busy us | span us | steady span us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        tr = r["trace"]
        lines.append(
            f"| {r['tokens']} | {r['kernel']} | {r['floor_us']:.1f} | {r['call_us']:.1f} | "
            f"{r['call_us'] / r['floor_us']:.2f} | {r['chained_us']:.1f} | {r['chained_us'] / r['floor_us']:.2f} | "
            f"{r['grouped_us']:.1f} | {r['harness_us']:.1f} | {tr['kernels_per_call']:.1f} | "
            f"{tr['kernel_us_per_call']:.1f} | {tr['busy_us_per_call']:.1f} | {tr['span_us_per_call']:.1f} | "
            f"{tr['steady_span_us_per_call']:.1f} |")
    for r in result["rows"]:
        lines += ["", f"## T = {r['tokens']}: one call in launch order (traced)", "",
                  "| kernel | us | gap before (us) |", "|---|---|---|"]
        for k in r["trace"]["one_call"]:
            gap = "-" if k["gap_before_us"] is None else f"{k['gap_before_us']:.1f}"
            lines.append(f"| {k['kernel'][:80]} | {k['us']:.1f} | {gap} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    p.add_argument("--calls-per-iteration", type=int, default=5,
                   help=f"layer calls written out per loop iteration in the grouped chain (must divide {REPS})")
    p.add_argument("--iters", type=int, default=10, help="synchronised timed runs per chain")
    p.add_argument("--tiny", action="store_true", help="small dims (CPU smoke run)")
    p.add_argument("--hlo", action="store_true",
                   help="also write the chain's optimized HLO per T (moe-layer-profile-...-T<t>.hlo.txt)")
    p.add_argument("--out", default=str(Path(__file__).parents[1] / "results"))
    p.add_argument("--choice-groups", type=int, default=1,
                   help="the Mosaic GPU kernel with each token's choices in this many groups (moe_wgmma's "
                        "choice_groups; 1 = the engine's dispatch as it is)")
    return p.parse_args(argv)


def _with_choice_groups(groups: int):
    """The engine's dispatch, its Mosaic GPU kernel run with `choice_groups` (the other kernels as they are)."""
    if groups == 1:
        return routed_experts_for_backend

    def layer(x_TH, experts, ids_TK, weights_TK):
        if moe_kernel_for(x_TH.shape[0], experts) != "wgmma":
            return routed_experts_for_backend(x_TH, experts, ids_TK, weights_TK)
        return moe_wgmma.routed_experts_wgmma(x_TH, experts, ids_TK, weights_TK, choice_groups=groups,
                                              **wgmma_config_for(experts, ids_TK.shape[1], x_TH.shape[0]))

    return layer


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.calls_per_iteration < 1 or REPS % args.calls_per_iteration:  # LONG_REPS is a multiple of REPS
        raise SystemExit(f"--calls-per-iteration must divide {REPS}, got {args.calls_per_iteration}")
    if args.iters < 1 or any(t < 1 for t in args.tokens):
        raise SystemExit("--iters and --tokens must be >= 1")
    log = functools.partial(print, flush=True)
    cfg = known_config("kimi-k2.5")
    if args.tiny:
        from bench.step import TINY_DIMS

        cfg = cfg.replace(**{**TINY_DIMS, "moe_intermediate_size": 256})
    experts, router, bias = jax.jit(moe_layer, static_argnums=0)(cfg, jax.random.PRNGKey(0))
    jax.block_until_ready(experts)
    per_expert = nbytes(experts) // experts.num_experts
    dev = jax.devices()[0]
    now = datetime.datetime.now(datetime.timezone.utc)
    result = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__,
                  date=now.isoformat(timespec="seconds"), reps=REPS, calls_per_iteration=args.calls_per_iteration,
                  choice_groups=args.choice_groups,
                  rows=[])
    layer = _with_choice_groups(args.choice_groups)
    chains = dict(call=chain_pair(layer),
                  grouped=chain_pair(layer, calls_per_iteration=args.calls_per_iteration),
                  harness=chain_pair(_scale_layer))
    for t in args.tokens:
        x_TH, ids_TK, weights_TK = inputs(cfg, router, bias, t, jax.random.PRNGKey(t))
        call = (x_TH, experts, ids_TK, weights_TK)
        unique = int(np.unique(np.asarray(ids_TK)).size)
        row = dict(tokens=t, kernel=moe_kernel_for(t, experts) if dev.platform == "gpu" else "plain",
                   unique_experts=unique,
                   floor_us=floor_ms(unique * per_expert + 2 * x_TH.nbytes, HBM_TBS) * 1e3)
        for name, pair in chains.items():  # one after another, so a drifting machine moves each alike
            timing = per_call_ms(pair, call, args.iters)
            row[f"{name}_us"] = timing["ms"] * 1e3
            if name == "call":
                row["chained_us"] = timing["chained_ms"] * 1e3
        if args.hlo:
            hlo_path = Path(args.out) / f"moe-layer-profile-{dev.platform}-{now.strftime('%Y%m%d-%H%M')}-T{t}.hlo.txt"
            hlo_path.parent.mkdir(parents=True, exist_ok=True)
            hlo_path.write_text(chains["call"][0].lower(*call).compile().as_text())
            log(f"wrote {hlo_path}")
        row["trace"] = trace_chain(chains["call"][0], call)
        tr = row["trace"]
        log(f"T={t} ({row['kernel']}): call {row['call_us']:.1f} us (chained {row['chained_us']:.1f}), "
            f"{args.calls_per_iteration} per iteration {row['grouped_us']:.1f}, harness {row['harness_us']:.1f}; "
            f"floor {row['floor_us']:.1f}; traced: {tr['kernels_per_call']:.1f} kernels, kernel sum "
            f"{tr['kernel_us_per_call']:.1f}, busy {tr['busy_us_per_call']:.1f}, span {tr['span_us_per_call']:.1f}, "
            f"steady span {tr['steady_span_us_per_call']:.1f} us/call")
        for k in tr["one_call"]:
            gap = "" if k["gap_before_us"] is None else f" (gap {k['gap_before_us']:.1f})"
            log(f"    {k['us']:8.1f} us{gap}  {k['kernel'][:80]}")
        result["rows"].append(row)
    stem = f"moe-layer-profile-{dev.platform}-{now.strftime('%Y%m%d-%H%M')}"
    path = write_json(result, Path(args.out), stem)
    path.with_suffix(".md").write_text(markdown(result))
    log(f"wrote {path} and .md")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
