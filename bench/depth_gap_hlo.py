"""`python -m bench.depth_gap_hlo PROFILE.json PROGRAM.hlo.txt[.gz]`: bench.depth_gap with each kernel's role read
from the step's optimized HLO (`python -m bench.labs.step_profile --hlo` writes both), not from its place.

bench.depth_gap matches a layer's kernels to roles by launch order, which holds for one compile of one program:
another XLA version or graph mode launches the same kernels in another order (the H200's CONCURRENT command
buffers do). Here a MoE layer is every kernel from just after one routed-experts down kernel (and the residual add
that follows it) to the next, and each kernel's role comes from what its fusion computes: the einsum of its dot
and its output's width for the projections, the custom call's name for the Pallas kernels, and for the rest (the
small kernels) the HLO op itself (add, reduce_sum, mul, scatter, slice, stack), printed so that a reader can see
what each launch does. Bytes per role are the K2.5 dimensions' (bench.depth_gap); a split-K GEMM's reduction is a
small kernel of its own.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

from bench.depth_gap import (BF16, CHOICES, EXPERTS, F, F32, H, HEADS, INT4_MATRIX, KV_LORA, NOPE, Q_LORA, ROPE,
                             SMALL, TBS, V, category_lines, summarize)

ROUTED_DOWN = "anonymous_mosaic_gpu_kernel"  # the second Mosaic GPU kernel of a layer: moe_wgmma's down
# (role, category, bytes at T = 1 with a 1k cache) of the kernels whose role a name or an einsum says
CUSTOM = {
    "mla_partial": ("MLA decode kernel (partials)", "attention over the cache", 1024 * (KV_LORA + ROPE) * BF16),
    "mla_combine": ("MLA decode kernel (combine)", "attention over the cache", 0),
    "router_topk": ("router top-k kernel", "router", 0),
    "router_gemv": ("router logits (GEMV kernel)", "router", EXPERTS * H * F32),
    "nvjet": ("shared expert down (cuBLAS)", "shared expert", F * H * BF16),
}
EINSUMS = {
    "btq,nkq->btnk": ("q_b projection", "attention GEMV", Q_LORA * HEADS * (NOPE + ROPE) * BF16),
    "btnd,ncd->btnc": ("q_nope x W_uk (absorbed k)", "attention absorbed", HEADS * NOPE * KV_LORA * BF16),
    "btnc,nvc->btnv": ("attention x W_uv (absorbed v)", "attention absorbed", HEADS * V * KV_LORA * BF16),
    "btnv,hnv->bth": ("o_proj", "attention GEMV", HEADS * V * H * BF16),
    "th,eh->te": ("router logits (f32)", "router", EXPERTS * H * F32),
}
# a linear's output width -> its role (`model.quant.linear`'s einsum is the same for all of them)
WIDTHS = {
    Q_LORA: ("q_a projection", "attention GEMV", H * Q_LORA * BF16),
    KV_LORA + ROPE: ("kv_a projection", "attention GEMV", H * (KV_LORA + ROPE) * BF16),
    HEADS * (NOPE + ROPE): EINSUMS["btq,nkq->btnk"],
    H: EINSUMS["btnv,hnv->bth"],
    2 * F: ("shared expert gate + up", "shared expert", 2 * F * H * BF16),
}


def hlo_ops(text: str) -> dict[str, dict]:
    """Fusion name as the profiler shows it (`gemm_fusion_dot.73` -> `gemm_fusion_dot_73`) -> {"shape": its output
    type, "op": the source op's name (the einsum for a dot), "kind": fusion kind}."""
    ops = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.+?) fusion\(", line)
        if not m:
            continue
        op = re.search(r'op_name="([^"]*)"', line)
        kind = re.search(r"kind=(\w+)", line)
        parts = op.group(1).split("/") if op else []
        source = parts[-2] if len(parts) >= 2 and parts[-1] == "dot_general" else (parts[-1] if parts else "")
        ops[re.sub(r"\.(\d+)$", r"_\1", m.group(1))] = {"shape": m.group(2), "op": source,
                                                          "kind": kind.group(1) if kind else ""}
    return ops


def _width(shape: str) -> int | None:
    dims = re.match(r"\w+\[([\d,]*)\]", shape)
    return int(dims.group(1).split(",")[-1]) if dims and dims.group(1) else None


def role_of(kernel: str, op: dict | None, nth_mosaic: int) -> tuple[str, str, int]:
    """(role, category, bytes) of one kernel of a layer; `nth_mosaic`: how many Mosaic GPU kernels came before it
    in the layer (gate_up, then down)."""
    if kernel == ROUTED_DOWN:
        return ((f"routed {'gate + up' if nth_mosaic == 0 else 'down'} (moe_wgmma)", "routed experts",
                 CHOICES * (2 if nth_mosaic == 0 else 1) * INT4_MATRIX))
    for prefix, role in CUSTOM.items():
        if kernel.startswith(prefix):
            return role
    if op is None:
        return f"({kernel}: not in the HLO)", SMALL, 0
    if op["op"] in EINSUMS:
        return EINSUMS[op["op"]]
    width = _width(op["shape"])
    if (kernel.startswith("gemm_fusion") or op["op"].endswith("->...o")) and width in WIDTHS:
        return WIDTHS[width]
    return f"{op['op'] or kernel} -> {op['shape'].split('{')[0]}", SMALL, 0


def layer_segments(sequence: list[dict]) -> list[list[dict]]:
    """Each MoE layer after the first: the kernels from two after one routed down kernel (past the residual add
    behind it) to two after the next."""
    downs = [i for i, k in enumerate(sequence) if k["kernel"] == ROUTED_DOWN]
    ends = [downs[j] + 2 for j in range(1, len(downs), 2)]  # the Mosaic kernels come in (gate_up, down) pairs
    return [sequence[a:b] for a, b in zip(ends, ends[1:])]


def analyse(segment: list[dict], ops: dict, tbs: float = TBS) -> dict:
    kernels, mosaic = [], 0
    for k in segment:
        kernels.append((k, *role_of(k["kernel"], ops.get(k["kernel"]), mosaic)))
        mosaic += k["kernel"] == ROUTED_DOWN
    return summarize(kernels, tbs)


def markdown(profile: str, hlo: str, layers: list[dict]) -> str:
    lines = [f"MoE layers at T = 1 from `{profile}`, each kernel's role from `{hlo}` (kernel times are the "
             f"device's, traced; floors at {TBS} TB/s; a layer is the kernels between two routed down kernels).", ""]
    # the layers' boundaries follow launch order, which concurrent graphs vary by a kernel or two: their mean holds
    cats = {}
    for layer in layers:
        for cat, c in layer["categories"].items():
            m = cats.setdefault(cat, {"us": 0.0, "floor_us": 0.0, "kernels": 0})
            for key in m:
                m[key] += c[key] / len(layers)
    us, floor = (sum(L[k] for L in layers) / len(layers) for k in ("us", "floor_us"))
    lines += [f"## Mean over the {len(layers)} layers", ""] + category_lines(cats, us, floor) + [""]
    for n, layer in enumerate(layers):
        lines += [f"## MoE layer {n + 2}", ""] + category_lines(layer["categories"], layer["us"], layer["floor_us"])
        lines += ["", "| # | kernel | role (or HLO op -> output) | us | MB | floor us |", "|---|---|---|---|---|---|"]
        lines += [f"| {i} | {r['kernel']} | {r['role']} | {r['us']:.1f} | {r['MB']:.1f} | {r['floor_us']:.1f} |"
                  for i, r in enumerate(layer["rows"])]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path, help="a bench.labs.step_profile JSON of the K2.5-shaped step")
    ap.add_argument("hlo", type=Path, help="the same program's optimized HLO (step_profile --hlo; .gz read too)")
    args = ap.parse_args(argv)
    try:
        data = json.loads(args.profile.read_text())
        opener = gzip.open if args.hlo.suffix == ".gz" else open
        with opener(args.hlo, "rt") as f:
            ops = hlo_ops(f.read())
    except (OSError, ValueError) as e:
        raise SystemExit(f"depth_gap_hlo: {e}")
    if not ops:
        raise SystemExit(f"depth_gap_hlo: {args.hlo}: no fusion in it (not an optimized HLO module?)")
    try:
        sequence = next(r for r in data["rows"] if r.get("tokens") == 1)["sequence"]
    except (KeyError, TypeError, StopIteration):
        raise SystemExit(f"depth_gap_hlo: {args.profile}: no T = 1 kernel sequence")
    layers = [analyse(s, ops) for s in layer_segments(sequence)]
    if not layers:
        raise SystemExit(f"depth_gap_hlo: {args.profile}: fewer than two MoE layers after the first in the sequence")
    print(markdown(str(args.profile), str(args.hlo), layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
