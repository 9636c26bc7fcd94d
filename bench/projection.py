"""`python -m bench.projection`: the full 61-layer Kimi-K2.5 projected on one device from measured steps (issue 36).

Two `bench.step` results go in:

- `--depth`: a run with `--prefix-layers` whose `layer_slope` rows give one MoE layer at depth (device loop) for some
  T, with their prefix rows. The prefix's time minus its MoE layers is what a step costs beyond its layers
  (embedding, the dense layer, the lm_head).
- `--cycles`: a 4-layer run with device-loop rows for the verify steps T = K + 1 and the cycles K at the same
  batch and context. Its cycle minus its verify is the draft's part of a cycle, which does not grow with the
  target's depth.

A T not measured at depth is interpolated linearly between the nearest measured ones. Projected: step(T) = fixed(T)
+ 60 x layer(T) (Kimi-K2.5: 61 layers, the first dense), cycle(K) = step(K + 1) + draft(K). The break-even acceptance
length is cycle(K) / step(1): the tokens a cycle must emit to match plain decoding. The speed-up at acceptance
length L is L x step(1) / cycle(K). It is a time projection for one device holding every weight, which no single
device can; per-device figures for 8 devices need measurements this does not take.
Writes projection-<date>.json and .md to --out.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np

from bench.report import publish
from convert.json_input import parse_json

KIMI_LAYERS = 61
KIMI_DENSE_LAYERS = 1
# the public Kimi-K2.5 EAGLE-3 drafter's acceptance lengths at K = 3 (tokens a verify emits; REFERENCE.md section 10)
PUBLISHED_K3 = {"MT-Bench": 2.69, "GSM8K": 3.20, "HumanEval": 3.29}


def _interpolated(ts: list[int], values: list[float], t: int) -> tuple[float, bool]:
    """The value at t, linear between the measured T around it (held flat past the ends); and whether t was
    measured."""
    order = np.argsort(ts)
    xs, ys = np.asarray(ts, float)[order], np.asarray(values, float)[order]
    return float(np.interp(t, xs, ys)), t in ts


def depth_rows(depth: dict, routing: str | None) -> tuple[str, dict[int, dict]]:
    """(routing, T -> {layer_ms, fixed_ms, ...}) from the device-loop layer slopes at B = 1 (of `routing`, or of
    the only one there is)."""
    rows = [s for s in depth.get("layer_slope") or [] if s["batch"] == 1 and s.get("device_loop_ms") is not None]
    routings = sorted({s.get("routing", "model") for s in rows})
    if routing is None:
        if len(routings) > 1:
            raise SystemExit(f"--depth holds routings {routings}: choose one with --routing")
        routing = routings[0] if routings else "model"
    rows = [s for s in rows if s.get("routing", "model") == routing]
    if not rows:
        raise SystemExit(f"--depth: no device-loop layer slope at B = 1 with routing {routing!r} "
                         "(run bench.step with --prefix-layers and --loop-steps)")
    out = {}
    for s in rows:
        prefix = s["prefix_row"]
        moe_in_prefix = s["prefix_layers"] - KIMI_DENSE_LAYERS
        out[s["tokens"]] = dict(layer_ms=s["device_loop_ms"],
                                fixed_ms=prefix["device_loop_ms"] - moe_in_prefix * s["device_loop_ms"],
                                unique_experts=float(np.mean(s["unique_experts"])), context=s["context"])
    return routing, out


def draft_ms(cycles: dict, batch: int, context: int) -> dict[int, float]:
    """K -> the draft's part of a cycle: the cycle's device loop minus the verify step's (T = K + 1), same run."""
    steps = {r["tokens"]: r["device_loop_ms"] for r in cycles.get("steps") or []
             if (r["batch"], r["context"]) == (batch, context) and r.get("moe_path", "kernel") == "kernel"
             and r.get("device_loop_ms") is not None}
    out = {}
    for c in cycles.get("cycles") or []:
        if (c["batch"], c["context"]) == (batch, context) and c.get("device_loop_ms") is not None \
                and c["k"] + 1 in steps:
            out[c["k"]] = c["device_loop_ms"] - steps[c["k"] + 1]
    if not out:
        raise SystemExit(f"--cycles: no cycle K with a device-loop verify step T = K + 1 at B = {batch}, "
                         f"context {context}")
    return out


def decode_and_cycles(step, drafts: dict[int, float]) -> tuple[dict, list[dict]]:
    """(step(1), a row per K of `drafts`): the verify step(K + 1), the cycle = verify + the draft's part, the
    break-even acceptance length cycle / decode, and at K = 3 the speed-ups at PUBLISHED_K3. `step(t)` returns a
    dict with the step's "ms"."""
    decode = step(1)
    table = []
    for k in sorted(drafts):
        verify = step(k + 1)
        cycle = verify["ms"] + drafts[k]
        row = dict(k=k, verify=verify, draft_ms=drafts[k], cycle_ms=cycle, break_even_length=cycle / decode["ms"])
        if k == 3:
            row["speedup_at_published"] = {name: length * decode["ms"] / cycle for name, length in PUBLISHED_K3.items()}
        table.append(row)
    return decode, table


def project(depth: dict, cycles: dict, routing: str | None = None) -> dict:
    routing, rows = depth_rows(depth, routing)
    ts = sorted(rows)
    context = rows[ts[0]]["context"]
    drafts = draft_ms(cycles, 1, context)

    def step(t: int) -> dict:
        layer, measured = _interpolated(ts, [rows[x]["layer_ms"] for x in ts], t)
        fixed, _ = _interpolated(ts, [rows[x]["fixed_ms"] for x in ts], t)
        moe_layers = KIMI_LAYERS - KIMI_DENSE_LAYERS
        return dict(tokens=t, layer_us=1e3 * layer, fixed_ms=fixed, measured_at_depth=measured,
                    ms=fixed + moe_layers * layer)

    decode, table = decode_and_cycles(step, drafts)
    return dict(routing=routing, context=context, decode=decode, cycles=table,
                depth_source=dict(device=depth.get("device"), date=depth.get("date")),
                cycles_source=dict(device=cycles.get("device"), date=cycles.get("date")))


def markdown(result: dict) -> str:
    d = result["decode"]
    lines = [
        f"# Kimi-K2.5 (61 layers) projected from measured steps, {result['date']}",
        "",
        f"Layers at depth: {result['inputs']['depth']} ({result['depth_source']['device']}, "
        f"{result['depth_source']['date']}), routing {result['routing']}, B = 1, context {result['context']}. "
        f"Draft part of a cycle: {result['inputs']['cycles']} ({result['cycles_source']['date']}). "
        "Device-loop times; T not measured at depth interpolated (see bench/projection.py). One device holding "
        "every weight: a time projection, not a deployable configuration.",
        "",
        f"Decode (T = 1): one MoE layer {d['layer_us']:.1f} us, beyond the layers {d['fixed_ms']:.3f} ms, "
        f"step {d['ms']:.2f} ms.",
        "",
        "| K | verify T | one MoE layer us | verify ms | draft ms | cycle ms | cycle / decode = break-even length |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["cycles"]:
        v = r["verify"]
        lines.append(f"| {r['k']} | {v['tokens']}{'' if v['measured_at_depth'] else ' (interpolated)'} | "
                     f"{v['layer_us']:.1f} | {v['ms']:.2f} | {r['draft_ms']:.3f} | {r['cycle_ms']:.2f} | "
                     f"{r['break_even_length']:.2f} |")
    lines += published_speedups(result["cycles"])
    return "\n".join(lines) + "\n"


def published_speedups(cycles: list[dict]) -> list[str]:
    """Markdown lines: the K = 3 row's speed-ups at PUBLISHED_K3 (none without a K = 3 row)."""
    k3 = next((r for r in cycles if r["k"] == 3), None)
    if k3 is None:
        return []
    return ["", "Speed-up over plain decoding at the public Kimi-K2.5 EAGLE-3 drafter's acceptance lengths (K = 3): "
            + ", ".join(f"{name} {PUBLISHED_K3[name]:.2f} -> {s:.2f}x"
                        for name, s in k3["speedup_at_published"].items()) + "."]


def load_json(flag: str, path: Path) -> dict:
    """The JSON object a flag's file holds (a bench's result); SystemExit naming the flag and the file where it cannot
    be read or is not an object."""
    try:
        doc = parse_json(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{flag} {path}: {e}") from None
    if not isinstance(doc, dict):
        raise SystemExit(f"{flag} {path}: a JSON {type(doc).__name__}, not a bench's result (an object)")
    return doc


def merged_depth(docs: list[dict]) -> dict:
    """Several `--depth` results as one: their layer slopes, a later file's row replacing an earlier one's at the
    same batch, T and routing (a kernel measured at some T over a run of another at every T); the first file's
    device, the dates of all."""
    rows = {}
    for doc in docs:
        for s in doc.get("layer_slope") or []:
            rows[(s["batch"], s["tokens"], s.get("routing", "model"))] = s
    return dict(layer_slope=list(rows.values()), device=docs[0].get("device"),
                date=" + ".join(str(d.get("date")) for d in docs))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.projection", description=__doc__.split("\n")[0])
    p.add_argument("--depth", type=Path, nargs="+", required=True,
                   help="bench.step JSON with --prefix-layers layer slopes; several: a later file's rows replace an "
                        "earlier one's at the same T and routing")
    p.add_argument("--cycles", type=Path, required=True,
                   help="bench.step JSON (4 layers) with device-loop verify steps and cycles at B = 1")
    p.add_argument("--routing", default=None, help="the routing of --depth's rows to use (when it holds several)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    depth = merged_depth([load_json("--depth", path) for path in a.depth])
    result = project(depth, load_json("--cycles", a.cycles), a.routing)
    now = datetime.datetime.now(datetime.timezone.utc)
    result.update(date=now.isoformat(timespec="seconds"),
                  inputs={"depth": " + ".join(str(d) for d in a.depth), "cycles": str(a.cycles)})
    publish(result, a.out, f"projection-{now.strftime('%Y%m%d-%H%M')}", markdown, print)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
