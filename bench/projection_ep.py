"""`python -m bench.projection_ep`: the 61-layer Kimi-K2.5 on 8 devices (a 1 x 8 mesh, model/sharding.py's rules), on
paper, per device (issue 36).

What a device holds and runs per MoE layer (model/sharding.py, model/moe_parallel.py): 1/8 of the heads of q_b, the
absorbed k / v products and o_proj, 1/8 of the shared expert's FFN, 48 of the 384 experts (the choices of other
devices' experts skipped by moe_wgmma); the q_a / kv_a projections, norms, the router and the MLA kernel over the
whole latent cache replicated; two all-reduces (`python -m bench.all_reduce` counts them in the sharded program).

Inputs, all measured on one H200 or on the CPU mesh:
- `--profile`: a traced 4-layer step at T = 1 (bench.labs.step_profile), split into kernels by role
  (bench.depth_gap). A device's layer at T = 1 is the sum of its kernels: each sharded kernel's time / 8 (not below
  `--min-kernel-us`, the launch-bound kernels' median in the same trace), the replicated ones as measured, and the
  routed experts from `--ep-slots`. The kernels' sum has no overlap between kernels (the device loop's layer ran
  12-20% below the sum on one device), so it is an upper bound of the compute.
- `--ep-slots`: one device's share of the routed experts timed on the H200 (bench.labs.ep_slots) at two counts of
  local slots; a line through them prices a slot. A step waits for its busiest device: the expected maximum of local
  slots over the 8 devices under `--routing` (bench.routes' regimes, 2000 draws).
- T > 1: every kernel but the routed experts is held at its T = 1 time (GEMVs over the same bytes; the MLA kernel
  grows a little with T, which this leaves out).
- `--all-reduce`: all-reduces per MoE layer (bench.all_reduce); their latency is a parameter (`--all-reduce-us`,
  default 0 and the CPU mesh's figure from the same file). The CPU figure is 8 threads of one process exchanging
  through memory, not a property of an NVLink machine: the columns bracket, they do not predict.
- beyond the layers: the one-device step's (bench.projection's fixed part) with the lm_head's kernel / 8 (vocab
  sharded); the dense layer 0 is kept at its one-device time.
- `--cycles`: the draft's part of a cycle (replicated: every device runs the whole draft), from a 4-layer run.
Writes projection-ep-<date>.json and .md to --out.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import jax
import numpy as np

from bench import depth_gap
from bench.projection import (KIMI_DENSE_LAYERS, KIMI_LAYERS, decode_and_cycles, depth_rows, draft_ms, load_json,
                              published_speedups)
from bench.report import publish
from bench.routes import regime_ids

DEVICES = 8
EXPERTS, CHOICES = 384, 8
# kernels a device runs over 1/8 of the weights (heads or FFN sharded); every other kernel is replicated
SHARDED_ROLES = ("q_b projection", "q_nope x W_uk (absorbed k)", "attention x W_uv (absorbed v)", "o_proj",
                 "shared expert gate + up", "shared expert down")
ROUTED = "routed experts"


def busiest_device_slots(tokens: int, routing: str, draws: int = 2000, seed: int = 0) -> float:
    """E[max over devices of the (token, choice) slots whose expert the device holds] for one step of `tokens`."""
    ids = np.asarray(regime_ids(jax.random.PRNGKey(seed), draws, tokens, EXPERTS, CHOICES, routing))
    device_P = (ids // (EXPERTS // DEVICES)).reshape(draws, tokens * CHOICES)
    counts = np.stack([(device_P == d).sum(axis=1) for d in range(DEVICES)], axis=1)
    return float(counts.max(axis=1).mean())


def slot_price(ep: dict) -> tuple[float, float]:
    """(us of a call, us per local slot): the line through the ep_slots lab's skipping rows."""
    pts = sorted((r["local_slots"], 1e3 * r["skip"]["ms"]) for r in ep["rows"])
    if len(pts) < 2 or pts[0][0] == pts[-1][0]:
        raise SystemExit("--ep-slots: needs rows at two different counts of local slots")
    (s0, t0), (s1, t1) = pts[0], pts[-1]
    per_slot = (t1 - t0) / (s1 - s0)
    return t0 - per_slot * s0, per_slot


def device_layer(profile_rows: list[dict], min_kernel_us: float) -> dict:
    """One device's MoE layer at T = 1 without its routed experts: (replicated us, sharded us on one device, the
    same kernels on a device of 8)."""
    replicated = sum(r["us"] for r in profile_rows if r["role"] not in SHARDED_ROLES and r["category"] != ROUTED)
    sharded = [r["us"] for r in profile_rows if r["role"] in SHARDED_ROLES]
    return dict(replicated_us=replicated, sharded_one_device_us=sum(sharded),
                sharded_us=sum(max(us / DEVICES, min_kernel_us) for us in sharded),
                routed_one_device_us=sum(r["us"] for r in profile_rows if r["category"] == ROUTED))


def project(profile: dict, depth: dict, ep: dict, all_reduce: dict, cycles: dict, routing: str,
            latencies_us: list[float], depth_routing: str | None = None) -> dict:
    rows = depth_gap.mean_layer(profile)
    small = [r["us"] for r in rows if r["category"] == depth_gap.SMALL]
    min_kernel = statistics.median(small)
    layer = device_layer(rows, min_kernel)
    base, per_slot = slot_price(ep)
    n_ar = {r["tokens"]: r["all_reduces_per_moe_layer"] for r in all_reduce["rows"]}
    ar_count = n_ar.get(1, max(n_ar.values()))
    _, one_device = depth_rows(depth, depth_routing)  # its fixed part (beyond the layers) only
    lm_head_us = profile["lm_head_us"]
    fixed_ms = one_device[1]["fixed_ms"] - (1 - 1 / DEVICES) * lm_head_us / 1e3
    drafts = draft_ms(cycles, 1, one_device[1]["context"])
    moe_layers = KIMI_LAYERS - KIMI_DENSE_LAYERS

    def step(t: int, ar_us: float) -> dict:
        slots = busiest_device_slots(t, routing)
        routed = base + per_slot * slots
        layer_us = layer["replicated_us"] + layer["sharded_us"] + routed + ar_count * ar_us
        return dict(tokens=t, busiest_device_slots=slots, routed_us=routed, layer_us=layer_us,
                    ms=fixed_ms + moe_layers * layer_us / 1e3)

    tables = []
    for ar_us in latencies_us:
        decode, cyc = decode_and_cycles(lambda t, ar_us=ar_us: step(t, ar_us), drafts)
        tables.append(dict(all_reduce_us=ar_us, decode=decode, cycles=cyc))
    return dict(routing=routing, devices=DEVICES, layer=layer, min_kernel_us=min_kernel, slot_base_us=base,
                slot_us=per_slot, all_reduces_per_layer=ar_count, fixed_ms=fixed_ms, lm_head_us=lm_head_us,
                cpu_all_reduce_us={r["tokens"]: r["all_reduce_us"] for r in all_reduce["rows"]}, tables=tables)


def markdown(result: dict) -> str:
    L = result["layer"]
    lines = [
        f"# Kimi-K2.5 (61 layers) on 8 devices, per device, on paper: {result['date']}",
        "",
        f"Inputs: {', '.join(f'{k} `{v}`' for k, v in result['inputs'].items())}. Routing {result['routing']}. "
        "Method and assumptions: bench/projection_ep.py.",
        "",
        f"A device's MoE layer at T = 1 without routed experts: replicated kernels {L['replicated_us']:.1f} us, "
        f"sharded kernels {L['sharded_us']:.1f} us (one device: {L['sharded_one_device_us']:.1f}; each at least "
        f"{result['min_kernel_us']:.1f} us); routed experts {result['slot_base_us']:.1f} us + "
        f"{result['slot_us']:.2f} us per local slot of the busiest device (one device, all 384 experts: "
        f"{L['routed_one_device_us']:.1f} us). {result['all_reduces_per_layer']} all-reduces per layer. Beyond the "
        f"layers {result['fixed_ms']:.3f} ms (the lm_head's {result['lm_head_us']:.0f} us / 8).",
        "",
    ]
    for tab in result["tables"]:
        d = tab["decode"]
        lines += [f"## All-reduce latency {tab['all_reduce_us']:.1f} us",
                  "",
                  f"Decode: busiest device {d['busiest_device_slots']:.2f} slots, "
                  f"one MoE layer {d['layer_us']:.1f} us, "
                  f"step {d['ms']:.2f} ms.",
                  "",
                  "| K | verify T | busiest device's slots | one MoE layer us | verify ms | draft ms | cycle ms | "
                  "break-even length |", "|---|---|---|---|---|---|---|---|"]
        for r in tab["cycles"]:
            v = r["verify"]
            lines.append(f"| {r['k']} | {v['tokens']} | {v['busiest_device_slots']:.2f} | {v['layer_us']:.1f} | "
                         f"{v['ms']:.2f} | {r['draft_ms']:.3f} | {r['cycle_ms']:.2f} | {r['break_even_length']:.2f} |")
        lines += published_speedups(tab["cycles"]) + [""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.projection_ep", description=__doc__.split("\n")[0])
    p.add_argument("--profile", type=Path, required=True, help="bench.labs.step_profile JSON (4 layers, T = 1)")
    p.add_argument("--depth", type=Path, required=True, help="bench.step JSON with --prefix-layers layer slopes")
    p.add_argument("--ep-slots", type=Path, required=True, help="bench.labs.ep_slots JSON")
    p.add_argument("--all-reduce", type=Path, required=True, help="bench.all_reduce JSON")
    p.add_argument("--cycles", type=Path, required=True, help="bench.step JSON (4 layers) with device-loop cycles")
    p.add_argument("--routing", default="neighbour", help="bench.routes regime of the busiest device's slots")
    p.add_argument("--depth-routing", default=None, help="the routing of --depth's rows (when it holds several)")
    p.add_argument("--all-reduce-us", type=float, nargs="*", default=None,
                   help="latencies to tabulate (default: 0 and the CPU mesh's T = 1 figure)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    files = {"--profile": a.profile, "--depth": a.depth, "--ep-slots": a.ep_slots, "--all-reduce": a.all_reduce,
             "--cycles": a.cycles}
    data = {flag: load_json(flag, path) for flag, path in files.items()}
    profile = depth_gap.load_profile(data["--profile"], a.profile)
    ar = data["--all-reduce"]
    latencies = a.all_reduce_us if a.all_reduce_us is not None else [0.0] + [
        r["all_reduce_us"] for r in ar["rows"] if r["tokens"] == 1]
    result = project(profile, data["--depth"], data["--ep-slots"], ar, data["--cycles"], a.routing, latencies,
                     a.depth_routing)
    now = datetime.datetime.now(datetime.timezone.utc)
    result.update(date=now.isoformat(timespec="seconds"), inputs={k: str(v) for k, v in files.items()})
    publish(result, a.out, f"projection-ep-{now.strftime('%Y%m%d-%H%M')}", markdown, print)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
