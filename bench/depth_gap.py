"""`python -m bench.depth_gap PROFILE.json`: where one MoE layer's time goes at one token, kernel by kernel,
against the bytes each kernel must read (issue 36: a decode layer at depth runs at ~1.45x its floor while the
4-layer step reads 1.22x, because half of that step's bytes are the lm_head, which runs at its floor).

Input: a `bench.labs.step_profile` trace of the 4-layer K2.5-shaped step (its `rows[0].sequence`: the device's
kernels of one decode step in launch order). A MoE layer is the 32 kernels from its input norm to the residual
add after the routed experts. Kernel names are XLA's fusion names, which carry no source: each kernel's role
is read from its place in the layer (LAYER below, checked against the trace: a name that does not match stops
the script; `bench.depth_gap_hlo` reads roles from the optimized HLO instead, for traces in another launch order)
and its bytes from the K2.5 dimensions (REFERENCE.md); the GEMVs' times agree with those bytes to within 10-50%,
which is how the roles were matched, and the HLO of a later compile of the same step corrected four of them.
Prints one table per layer and a summary by category.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

H, Q_LORA, KV_LORA, ROPE, NOPE, V, HEADS, F, CHOICES, EXPERTS = 7168, 1536, 512, 64, 128, 128, 64, 2048, 8, 384
BF16, F32 = 2, 4
TBS = 4.3  # the H200's HBM bandwidth of the floors, TB/s
INT4_MATRIX = F * H // 2 + F * (H // 32) * BF16  # one expert matrix: packed int4 + bf16 scales of group 32


SMALL = "small kernels (norms, rope, cache slices, layouts, adds)"


def _mb(n: float) -> float:
    return n / 1e6


# (kernel name prefix, role, category, bytes it must read at T = 1 with a 1k cache): one MoE layer in launch order
LAYER = [
    ("input_reduce_fusion", "input RMSNorm", SMALL, 0),
    ("loop_multiply_fusion", "norm scale", SMALL, 0),
    ("gemm_fusion_dot", "q_a projection", "attention GEMV", H * Q_LORA * BF16),
    ("loop_reduce_fusion", "q_a GEMM's split-K sum", SMALL, 0),
    ("input_reduce_fusion", "a LoRA norm's mean of squares", SMALL, 0),
    ("loop_multiply_fusion", "norm scale", SMALL, 0),
    ("gemm_fusion_dot", "q_b projection", "attention GEMV", Q_LORA * HEADS * (NOPE + ROPE) * BF16),
    ("input_reduce_fusion", "q_nope x W_uk (absorbed k)", "attention absorbed", HEADS * NOPE * KV_LORA * BF16),
    ("input_concatenate_fusion", "rope / query layout", SMALL, 0),
    ("loop_dynamic_slice_fusion", "cache slice", SMALL, 0),
    # the optimized HLO names this fusion's op: the [576] kv_a GEMV, which XLA runs as a reduction
    ("input_reduce_fusion", "kv_a projection", "attention GEMV", H * (KV_LORA + ROPE) * BF16),
    ("input_reduce_fusion", "a LoRA norm's mean of squares", SMALL, 0),
    ("loop_dynamic_update_slice_fusion", "cache write", SMALL, 0),
    ("loop_dynamic_slice_fusion", "cache slice", SMALL, 0),
    ("loop_dynamic_update_slice_fusion", "cache write", SMALL, 0),
    ("mla_partial", "MLA decode kernel (partials)", "attention over the cache", 1024 * (KV_LORA + ROPE) * BF16),
    ("mla_combine", "MLA decode kernel (combine)", "attention over the cache", 0),
    ("input_reduce_fusion", "attention x W_uv (absorbed v)", "attention absorbed", HEADS * V * KV_LORA * BF16),
    ("gemm_fusion_dot", "o_proj", "attention GEMV", HEADS * V * H * BF16),
    ("loop_add_fusion", "residual add", SMALL, 0),
    ("input_reduce_fusion", "post-attention RMSNorm", SMALL, 0),
    ("loop_multiply_fusion", "norm scale", SMALL, 0),
    ("gemm_fusion_dot", "shared expert gate + up", "shared expert", 2 * F * H * BF16),
    ("loop_multiply_fusion", "shared expert SiLU x up", SMALL, 0),
    ("nvjet", "shared expert down", "shared expert", F * H * BF16),
    ("input_reduce_fusion", "router logits (f32)", "router", EXPERTS * H * F32),
    ("router_topk", "router top-k kernel", "router", 0),
    ("loop_slice_fusion", "block-diagonal x (moe_wgmma's input)", SMALL, 0),
    ("anonymous_mosaic_gpu_kernel", "routed gate + up (moe_wgmma)", "routed experts", CHOICES * 2 * INT4_MATRIX),
    ("loop_slice_fusion", "SiLU x up, block-diagonal layout", SMALL, 0),
    ("anonymous_mosaic_gpu_kernel", "routed down (moe_wgmma)", "routed experts", CHOICES * INT4_MATRIX),
    ("loop_add_fusion", "splits' sum + residual add", SMALL, 0),
]


def layers_of(sequence: list[dict]) -> list[list[dict]]:
    """The MoE layers of one step: each run of len(LAYER) kernels that starts after a routed-experts down kernel
    (the first MoE layer starts after the dense layer's MLP, so the layers after the first routed experts are
    taken) and matches LAYER's names."""
    starts = [i + 2 for i in range(len(sequence) - 1)
              if sequence[i]["kernel"] == "anonymous_mosaic_gpu_kernel"
              and i >= 2 and sequence[i - 2]["kernel"] == "anonymous_mosaic_gpu_kernel"]
    layers = []
    for s in starts:
        chunk = sequence[s:s + len(LAYER)]
        if len(chunk) == len(LAYER):
            layers.append(chunk)
    return layers


def check(chunk: list[dict]) -> None:
    for k, (prefix, role, *_rest) in zip(chunk, LAYER):
        if not k["kernel"].startswith(prefix):
            raise SystemExit(f"depth_gap: kernel {k['kernel']!r} where the layer's {role!r} ({prefix}*) was expected: "
                             "the trace's layer is not the one LAYER describes")


def summarize(kernels: list[tuple[dict, str, str, int]], tbs: float) -> dict:
    """(trace kernel, role, category, bytes it must read) of one layer -> its rows, the sums by category and the
    layer's totals against the floor at `tbs` TB/s."""
    rows, cats = [], {}
    for k, role, cat, nbytes in kernels:
        floor_us = nbytes / tbs / 1e6
        rows.append({"kernel": k["kernel"], "role": role, "category": cat, "us": k["us"], "MB": _mb(nbytes),
                     "floor_us": floor_us})
        c = cats.setdefault(cat, {"us": 0.0, "floor_us": 0.0, "kernels": 0})
        c["us"] += k["us"]
        c["floor_us"] += floor_us
        c["kernels"] += 1
    return {"rows": rows, "categories": cats, "us": sum(r["us"] for r in rows),
            "floor_us": sum(r["floor_us"] for r in rows), "MB": sum(r["MB"] for r in rows)}


def analyse(chunk: list[dict], tbs: float) -> dict:
    check(chunk)
    return summarize([(k, role, cat, nbytes) for k, (_, role, cat, nbytes) in zip(chunk, LAYER)], tbs)


def category_lines(cats: dict, us: float, floor_us: float, us_header: str = "us") -> list[str]:
    """The by-category table, largest excess over the floor first, and the layer's row (kernel counts may be
    means)."""
    lines = [f"| category | kernels | {us_header} | floor us | x floor | excess us |", "|---|---|---|---|---|---|"]
    for cat, c in sorted(cats.items(), key=lambda kv: -(kv[1]["us"] - kv[1]["floor_us"])):
        ratio = f"{c['us'] / c['floor_us']:.2f}" if c["floor_us"] > 0 else "-"
        lines.append(f"| {cat} | {c['kernels']:g} | {c['us']:.1f} | {c['floor_us']:.1f} | {ratio} | "
                     f"{c['us'] - c['floor_us']:.1f} |")
    lines.append(f"| **layer** | {sum(c['kernels'] for c in cats.values()):g} | {us:.1f} | {floor_us:.1f} | "
                 f"{us / floor_us:.2f} | {us - floor_us:.1f} |")
    return lines


def markdown(result: dict) -> str:
    lines = [f"One MoE layer at T = 1 from `{result['profile']}` (the mean over its {result['layer_count']} MoE layers "
             f"after the first; kernel times are the device's, traced; floors at {result['tbs']} TB/s). "
             "The kernels' sum overstates the layer's time where the graph runs independent kernels side by side.", ""]
    lines += category_lines(result["categories"], result["us"], result["floor_us"], "us (mean over layers)")
    lines += ["", "| # | kernel | role | us | MB | floor us |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(result["rows"]):
        lines.append(f"| {i} | {r['kernel']} | {r['role']} | {r['us']:.1f} | {r['MB']:.1f} | {r['floor_us']:.1f} |")
    return "\n".join(lines) + "\n"


def load_profile(data: dict, path) -> dict:
    """A step_profile result -> {"layers": [analyse(...) per MoE layer after the first], "lm_head_us": the step's
    last kernel (the lm_head GEMV)}; SystemExit naming `path` where it holds no such layer."""
    try:
        sequence = next(r for r in data["rows"] if r.get("tokens") == 1)["sequence"]
    except (KeyError, TypeError, StopIteration) as e:
        raise SystemExit(f"depth_gap: {path}: no T = 1 kernel sequence ({type(e).__name__}: {e})")
    layers = [analyse(chunk, TBS) for chunk in layers_of(sequence)]
    if not layers:
        raise SystemExit(f"depth_gap: {path}: no MoE layer found in the T = 1 sequence")
    return {"layers": layers, "lm_head_us": sequence[-1]["us"]}


def mean_layer(profile: dict) -> list[dict]:
    """The kernels of the profile's MoE layers, each row's time the mean over the layers."""
    layers = profile["layers"]
    return [dict(r, us=sum(L["rows"][i]["us"] for L in layers) / len(layers)) for i, r in enumerate(layers[0]["rows"])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path, help="a bench.labs.step_profile JSON of the K2.5-shaped step")
    args = ap.parse_args(argv)
    try:
        data = json.loads(args.profile.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"depth_gap: {args.profile}: {e}")
    profile = load_profile(data, args.profile)
    layers = profile["layers"]
    n = len(layers)
    cats = {c: dict(v, us=sum(L["categories"][c]["us"] for L in layers) / n)
            for c, v in layers[0]["categories"].items()}
    result = {"profile": str(args.profile), "layer_count": n, "tbs": TBS, "rows": mean_layer(profile),
              "categories": cats, "us": sum(L["us"] for L in layers) / n, "floor_us": layers[0]["floor_us"],
              "MB": layers[0]["MB"], "per_layer_us": [L["us"] for L in layers]}
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
