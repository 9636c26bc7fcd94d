"""`python -m bench.labs.gpu_census`: the kernels a GPU program launches a layer, counted on a machine WITHOUT a GPU.

XLA compiles a program for an H200 ahead of time from a description of the device (`H200_TARGET`, the facts its
fusion and GEMM heuristics read), so the GPU's optimised HLO, and with it every kernel a step launches, can be read
on a CPU-only host. The programs are bench.per_device's (`--shard-of 8`: one device of the 8-way mesh; `--shard-of
1`: the whole model on one device), traced as for a Hopper GPU (model.kernels.target.compiling_for) and compiled
for the device the description names. Nothing runs and no weight is drawn: every argument is a shape.

    # a virtual environment of its own: with the CUDA plugin installed, jax looks for a GPU at every start
    python -m venv /tmp/census-env && . /tmp/census-env/bin/activate
    pip install "jax[cuda12]==JAX_VERSION" -e '.[test]'   # the CUDA plugin (~5 GB with its libraries); no GPU needed
    python -m bench.labs.gpu_census --shard-of 8 --tokens 1 4 --cycle-k 3 --out /tmp/census

Rows per step (T tokens): `kernels_per_layer` = (launches at `--layers` N - launches at N - 2) / 2, as the device
census of bench.per_device takes it from two compiled programs; `kernels_in_series_per_layer`, the same difference
of the longest chain of kernels each waiting for the one before (`kernels_in_series`), and of the dependency
graph's edges, joins and forks (`graph_shape`); with `--cycle-k`, the whole cycle's kernels and kernels in series at
N layers beside the verify of K + 1 tokens alone (the difference is what the drafts and the acceptance launch); and
the middle MoE layer's kernels in program order (a layer ends at its routed experts' last kernel,
`LAYER_END_TARGET`), each with its fusion name and output shape. What it cannot
tell: time. Autotuning needs the device, so a GEMM's tiles (not its count) may differ, and the XLA inside this
host's jax may fuse a little differently from the GPU host's (docs/performance.md compares the two on the same
program).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # the CUDA plugin loads without a GPU to check

import argparse  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from bench import per_device  # noqa: E402
from bench.per_device import (FREE_OPS, Kernel, hlo_computations, kernels_in_order,  # noqa: E402
                              launching_computations)
from model.config import Kernels  # noqa: E402
from model.kernels.target import compiling_for  # noqa: E402

H200_TARGET = Path(__file__).with_name("h200_target.txtpb")
# the routed experts' down kernel (moe_wgmma, Mosaic GPU): the last kernel of a MoE layer
LAYER_END_TARGET = "mosaic_gpu"
HOPPER = "9.0"


def gpu_devices(count: int = 1, target_config: Path = H200_TARGET) -> list:
    """The devices of a one-host topology of `count` GPUs described by `target_config` (a GpuTargetConfigProto in
    text form): jit compiles for them without the GPUs present."""
    from jax.experimental import topologies

    text = target_config.read_text()
    try:
        topology = topologies.get_topology_desc("", "cuda", topology=f"1x1x{count}", target_config=text)
    except Exception as e:  # the plugin is missing or cannot describe the device
        raise SystemExit(f"gpu_census: no CUDA topology from {target_config} ({type(e).__name__}: {e}); install "
                         "jax's CUDA plugin of this jax's version (no GPU is needed)") from None
    return list(topology.devices)


def gpu_device(target_config: Path = H200_TARGET):
    """A device of a one-GPU topology described by `target_config` (`gpu_devices`)."""
    return gpu_devices(1, target_config)[0]


def compile_for(fn, args, donate, device) -> str:
    """The optimised HLO of `fn` compiled for `device` from abstract `args` (arrays or ShapeDtypeStructs)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), args)
    with compiling_for("gpu", HOPPER):
        lowered = jax.jit(fn, donate_argnums=donate).trace(*shapes).lower(lowering_platforms=("cuda",))
    return lowered.compile().as_text()


_OPERAND = re.compile(r"%([\w.\-]+)")


def _kernel_predecessors(instrs) -> dict[str, set[str]]:
    """Each kernel of one computation (instructions in printed order, an instruction after its operands) -> the
    kernels it waits for directly: its operands' producers, looking through values, views and tuples."""
    names, through, preds = {ins.name for ins in instrs}, {}, {}
    for ins in instrs:
        args = ins.rest.split("), ")[0] if "), " in ins.rest else ins.rest
        waits = set().union(*(through.get(a, set()) for a in _OPERAND.findall(args) if a in names))
        if ins.op in FREE_OPS:
            through[ins.name] = waits
        else:
            through[ins.name], preds[ins.name] = {ins.name}, waits
    return preds


def _busiest(hlo_text: str) -> list:
    """The computation of the module that launches the most kernels (a step loop's body; fusion bodies launch none)."""
    comps, entry = hlo_computations(hlo_text)
    return max((comps[c] for c in launching_computations(comps, entry)),
               key=lambda instrs: sum(i.op not in FREE_OPS for i in instrs))


def kernels_in_series(hlo_text: str) -> int:
    """The most kernels one chain of data dependencies runs in series, in the computation of the module that
    launches the most kernels (a step loop's body): each kernel is one more than the longest chain among the
    kernels it waits for. Kernels beside the chain (cache writes, the shared expert) do not count; on a GPU they
    overlap it."""
    preds, depth = _kernel_predecessors(_busiest(hlo_text)), {}
    for name, waits in preds.items():  # in printed order: a kernel after those it waits for
        depth[name] = 1 + max((depth[w] for w in waits), default=0)
    return max(depth.values(), default=0)


def graph_shape(hlo_text: str) -> dict:
    """The dependency graph of the computation that launches the most kernels, as a CUDA graph of its kernels
    would hold it: `edges` (a kernel waiting for another), `joins` (kernels waiting for two or more), `forks`
    (kernels two or more wait for). Branches overlap on the device, but each join waits for all of its branches."""
    preds = _kernel_predecessors(_busiest(hlo_text))
    fed = Counter(w for waits in preds.values() for w in waits)
    return dict(edges=sum(len(w) for w in preds.values()), joins=sum(len(w) >= 2 for w in preds.values()),
                forks=sum(n >= 2 for n in fed.values()))


def layer_segments(kernels: list[Kernel], end_marker: str = LAYER_END_TARGET, per_layer: int = 2) -> list[list]:
    """The kernels cut after every `per_layer`-th kernel whose kind contains `end_marker` (a MoE layer runs two
    routed-experts kernels): [before the first MoE layer's end, the first MoE layer, ...,  after the last]."""
    segments, current, seen = [], [], 0
    for k in kernels:
        current.append(k)
        if end_marker in k.kind:
            seen += 1
            if seen % per_layer == 0:
                segments.append(current)
                current = []
    segments.append(current)
    return segments


def census_rows(args, device, log) -> list[dict]:
    kernels = Kernels(moe=args.moe_kernel)
    cfg = per_device.per_device_config(args.layers, False).replace(kernels=kernels)
    rows, cycle_rows = [], []
    for layers in (args.layers, args.layers - 2):
        lcfg = per_device.prefix_config(cfg, layers)
        w = jax.eval_shape(lambda c=lcfg: per_device.local_weights(c, args.shard_of, False, "repeated"))
        cycle_k = [str(k) for k in args.cycle_k] if layers == args.layers else []
        pargs = per_device.parse_args(["--layers", str(layers), "--prefix-layers", "0", "--tokens",
                                       *map(str, args.tokens), "--cycle-k", *cycle_k, "--routing", "neighbour",
                                       "--shard-of", str(args.shard_of)])
        with compiling_for("gpu", HOPPER):
            _, steps, cycles, _ = per_device.build_programs(w, lcfg, pargs, 0)
        for e in cycles:  # the whole cycle at N layers: the drafts and the acceptance beside the verify
            p = e["program"]
            text = compile_for(p.fn, p.args, p.donate, device)
            cycle_rows.append(dict(k=e["k"], layers=layers, kernels=len(kernels_in_order(text)),
                                   kernels_in_series=kernels_in_series(text)))
            log(f"cycle K = {e['k']}, {layers} layers: {cycle_rows[-1]['kernels']} kernels, "
                f"{cycle_rows[-1]['kernels_in_series']} in series")
        for e in steps:
            p = e["program"]
            t0 = time.perf_counter()
            text = compile_for(p.fn, p.args, p.donate, device)
            kernels = kernels_in_order(text)
            log(f"T = {e['tokens']}, {layers} layers: {len(kernels)} kernels a step, compiled in "
                f"{time.perf_counter() - t0:.1f} s")
            if args.hlo:
                out = Path(args.out)
                out.mkdir(parents=True, exist_ok=True)
                with gzip.open(out / f"census-shard{args.shard_of}-T{e['tokens']}-L{layers}.hlo.txt.gz", "wt") as f:
                    f.write(text)
            rows.append(dict(tokens=e["tokens"], layers=layers, kernels=kernels, series=kernels_in_series(text),
                             shape=graph_shape(text)))
    result = []
    for t in args.tokens:
        full, short = (next(r for r in rows if r["tokens"] == t and r["layers"] == n)
                       for n in (args.layers, args.layers - 2))
        diff = Counter(k.kind for k in full["kernels"])
        diff.subtract(Counter(k.kind for k in short["kernels"]))
        segments = layer_segments(full["kernels"])
        middle = segments[len(segments) // 2] if len(segments) > 2 else []
        result.append(dict(tokens=t, layers=args.layers, shard_of=args.shard_of,
                           kernels_per_layer=(len(full["kernels"]) - len(short["kernels"])) / 2,
                           kernels_in_series_per_layer=(full["series"] - short["series"]) / 2,
                           graph_per_layer={k: (full["shape"][k] - short["shape"][k]) / 2 for k in full["shape"]},
                           kinds_per_layer={k: v / 2 for k, v in sorted(diff.items()) if v},
                           middle_layer=[k._asdict() for k in middle],
                           moe_layer_segments=[len(s) for s in segments[1:-1]]))
    for c in cycle_rows:  # beside the verify of K + 1 tokens at the same depth, where that step was counted
        verify = next((r for r in rows if r["tokens"] == c["k"] + 1 and r["layers"] == args.layers), None)
        result.append(dict(cycle_k=c["k"], layers=args.layers, shard_of=args.shard_of, kernels=c["kernels"],
                           kernels_in_series=c["kernels_in_series"],
                           beside_the_verify=None if verify is None else len(verify["kernels"]),
                           beside_the_verify_in_series=None if verify is None else verify["series"]))
    return result


def markdown(result: dict) -> str:
    lines = [f"# GPU kernel census without a GPU ({result['target']}, jax {result['jax']}, {result['date']})", "",
             f"`{result['command']}`", ""]
    for row in result["rows"]:
        if "cycle_k" in row:
            lines += [f"## The cycle K = {row['cycle_k']}, one device of {row['shard_of']}, {row['layers']} layers",
                      "", f"{row['kernels']} kernels, {row['kernels_in_series']} in series; the verify of "
                      f"{row['cycle_k'] + 1} tokens alone: {row['beside_the_verify']}, "
                      f"{row['beside_the_verify_in_series']} in series.", ""]
            continue
        lines += [f"## T = {row['tokens']}, one device of {row['shard_of']}, {row['layers']} layers", "",
                  f"Kernels a layer ((N - (N - 2)) / 2): **{row['kernels_per_layer']:g}**, of them in series "
                  f"(`kernels_in_series`): **{row['kernels_in_series_per_layer']:g}**; the MoE layers' segments: "
                  f"{row['moe_layer_segments']}", "", "The dependency graph a layer (`graph_shape`): "
                  + ", ".join(f"{k} {v:g}" for k, v in row["graph_per_layer"].items()), "",
                  "| kind | a layer |", "|---|---|"]
        lines += [f"| {k} | {v:g} |" for k, v in row["kinds_per_layer"].items()]
        lines += ["", f"The middle MoE layer, in program order ({len(row['middle_layer'])} kernels):", "",
                  "| # | kernel | kind | output |", "|---|---|---|---|"]
        lines += [f"| {i} | {k['name']} | {k['kind']} | `{k['shape'][:80]}` |"
                  for i, k in enumerate(row["middle_layer"], 1)]
        lines.append("")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.labs.gpu_census", description=__doc__.split("\n")[0])
    p.add_argument("--shard-of", type=int, default=per_device.SHARD_OF,
                   help="devices of the 1 x N mesh this device is one of (1: the whole model on one device)")
    p.add_argument("--layers", type=int, default=6, help="target layers N (the census also compiles N - 2)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    p.add_argument("--cycle-k", type=int, nargs="*", default=[],
                   help="also count the speculative cycle of K drafts at --layers (bench.per_device's)")
    p.add_argument("--moe-kernel", choices=per_device.KERNEL_PATH_MOE, default="auto")
    p.add_argument("--target-config", type=Path, default=H200_TARGET)
    p.add_argument("--hlo", action="store_true", help="also write each program's optimised HLO (gzipped)")
    p.add_argument("--out", default="bench/results")
    a = p.parse_args(argv)
    if a.layers < 5:
        p.error("--layers must be at least 5 (N - 2 must still hold two MoE layers after the dense one)")
    return a


def log(*a):
    print(*a, flush=True)


def write_result(result: dict, markdown_text: str, out: str, stem: str) -> Path:
    """`result` as <stem>.json and its markdown as <stem>.md under `out`; returns their path less the suffix."""
    path = Path(out) / stem
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(result, indent=1))
    path.with_suffix(".md").write_text(markdown_text)
    return path


def run_header(module: str, argv, device) -> dict:
    """What a census result starts with: the device it compiled for, the jax, the date and the command."""
    return dict(target=device.device_kind, jax=jax.__version__, date=time.strftime("%Y%m%d-%H%M"),
                command=f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]))


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = gpu_device(args.target_config)
    result = dict(**run_header("bench.labs.gpu_census", argv, device), rows=census_rows(args, device, log))
    stem = f"gpu-census-shard{args.shard_of}-{result['date']}"
    path = write_result(result, markdown(result), args.out, stem)
    for row in (r for r in result["rows"] if "tokens" in r):
        log(f"T = {row['tokens']}: {row['kernels_per_layer']:g} kernels a layer, "
            f"{row['kernels_in_series_per_layer']:g} in series; the MoE layers' segments {row['moe_layer_segments']}")
    log(f"wrote {path}.json and .md")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
