"""`python -m bench.labs.sharded_census`: the sharded engine's own programs compiled for a host of N H200s on a machine
WITHOUT a GPU, and every collective they run: its kind, the bytes it moves, the implementation XLA chose, and whether
it runs every step (inside the device loop).

bench.labs.gpu_census counts kernels of bench.per_device's one-device program, whose collectives are cut; this one
compiles what `generate --mesh 8` would run: the engine's step functions (jaxspec.baseline_step, spec_step,
the target's forward as a verify) traced inside the mesh and placed by model/sharding.py's rules
(`jaxspec.sharded.lower_program`), compiled by the XLA of jax's CUDA plugin for N devices described by
`bench/labs/h200_target.txtpb`. Nothing runs and no weight is drawn. The GPU compiler partitions some operations
differently from XLA:CPU's (the 8-CPU-device tests), and that is what this sees: a one-token lookup of the
vocabulary-sharded embedding table was partitioned by all-gathering the whole table every step until
`model.embedding` looked it up per device, and the server's sampled loop gathered its probabilities over the
vocabulary until each device processed its own slots' rows (`model.shard_local.per_device_rows`). It exits 1
where a step moves more than --max-step-mb through one collective.

    python -m venv /tmp/census-env && . /tmp/census-env/bin/activate   # as bench.labs.gpu_census says
    pip install "jax[cuda12]==JAX_VERSION" -e '.[test]'
    python -m bench.labs.sharded_census --devices 8 --layers 6 --out /tmp/sharded-census

Rows per program (prefill of --prompt tokens; decode, verify of K + 1 tokens and the K cycle, each as one step and as
the device loop the engine runs; the server's loop over --serve-batch slots, greedy and sampled): the collectives,
each with its bytes (the largest array it produces) and XLA's `kernel_strategy` (a Triton one-shot or two-shot
all-reduce kernel, or the default library collective); and for the loops at --layers and --layers - 2, a device's
kernels a layer in one iteration (collectives apart) and the longest chain of them each waiting for the one before
(`kernels_in_series`, the collectives' start and done in it). What it cannot tell: time.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # the CUDA plugin loads without a GPU to check

import argparse  # noqa: E402
import functools  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import per_device  # noqa: E402
from bench.cycle import spec_configs  # noqa: E402
from bench.labs.gpu_census import (H200_TARGET, HOPPER, gpu_devices, kernels_in_series, log,  # noqa: E402
                                   run_header, write_result)
from bench.per_device import hlo_computations, kernels_in_order  # noqa: E402
from jaxspec.baseline_step import baseline_step  # noqa: E402
from jaxspec.models import SpecWeights  # noqa: E402
from jaxspec.prefill import baseline_prefill, spec_prefill  # noqa: E402
from jaxspec.sampling import SamplingParams  # noqa: E402
from jaxspec.serving.slot_cycle import run_cycles  # noqa: E402
from jaxspec.serving.slots import init_slots  # noqa: E402
from jaxspec.sharded import lower_program  # noqa: E402
from jaxspec.spec_step import speculative_cycle  # noqa: E402
from model.decoder import forward, fuse_attention_inputs  # noqa: E402
from model.init import init_draft_weights, init_kimi_weights  # noqa: E402
from model.kernels.target import compiling_for  # noqa: E402
from model.sharding import make_mesh  # noqa: E402

COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# `%name = TYPE op(` where op is a collective, or the -start half of an asynchronous one (its -done only waits)
_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) (" + "|".join(COLLECTIVE_OPS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}
_STRATEGY = re.compile(r'"kernel_strategy":"KERNEL_STRATEGY_([A-Z_]+)"')
_BODY = re.compile(r"\bbody=%([\w.\-]+)")


def largest_array_bytes(shape_text: str) -> int:
    """The bytes of the largest array in an HLO shape (an all-gather-start's (input, output) tuple: its output)."""
    sizes = [_BYTES[dt] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
             for dt, dims in _ARRAY.findall(shape_text)]
    return max(sizes, default=0)


def collectives(hlo_text: str) -> list[dict]:
    """Every collective of an optimised HLO module in printed order: {name, op, shape, bytes, strategy,
    computation, in_loop} (`in_loop`: in a while loop's body, so it runs every iteration)."""
    comps, _ = hlo_computations(hlo_text)
    bodies = set(_BODY.findall(hlo_text))
    where = {ins.name: comp for comp, instrs in comps.items() for ins in instrs}
    out = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.match(line)
        if not m:
            continue
        name, shape, op = m.groups()
        strategy = _STRATEGY.search(line)
        comp = where.get(name)
        out.append(dict(name=name, op=op, shape=shape, bytes=largest_array_bytes(shape),
                        strategy=strategy.group(1).lower() if strategy else "-", computation=comp,
                        in_loop=comp in bodies))
    return out


def kernels_apart_from_collectives(hlo_text: str) -> int:
    return sum(1 for k in kernels_in_order(hlo_text) if not any(k.kind.startswith(op) for op in COLLECTIVE_OPS))


def engine_programs(layers: int, k: int, prompt: int, capacity: int, max_new: int, serve_batch: int = 0,
                    sampled_batch: int = 0) -> dict:
    """{name: (fn, abstract args, donated args)} of the engine's programs for a Kimi-K2.5-shaped pair of `layers`
    target layers (bench.cycle's one-layer draft); the steps and loops donate their state, as the engine's do.
    `serve_batch`: also the server's device loop over that many slots (jaxspec.serving.slot_cycle.run_cycles,
    greedy and with sampled rows), as `serve` runs it. `sampled_batch`: also the engine's sampled cycle loop over
    a batch of that many prompts (`generate --batch-file` with a temperature)."""
    cfg = per_device.per_device_config(layers, tiny=False)
    spec_cfg, dcfg = spec_configs(cfg, tiny=False)
    target = jax.eval_shape(lambda key: init_kimi_weights(cfg, key, jnp.bfloat16, experts="int4"), jax.random.key(0))
    draft = jax.eval_shape(lambda key: init_draft_weights(dcfg, key, jnp.bfloat16,
                                                          d2t=np.zeros(dcfg.draft_vocab_size, np.int32)),
                           jax.random.key(0))
    w = SpecWeights(jax.eval_shape(fuse_attention_inputs, target), draft)  # as jaxspec.sharded.weights_to_run
    sp = SamplingParams().as_arrays()
    prompt_args = (jax.ShapeDtypeStruct((1, prompt), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32),
                   jax.random.key(0), sp)
    kw = dict(cfg=spec_cfg, capacity=capacity, greedy=True, max_new_tokens=max_new)
    base = jax.eval_shape(functools.partial(baseline_prefill, **kw), w, *prompt_args)
    spec = jax.eval_shape(functools.partial(spec_prefill, **kw, k=k, max_cycles=max_new), w, *prompt_args)
    step = functools.partial(baseline_step, cfg=spec_cfg, greedy=True, max_new_tokens=max_new)
    cycle = functools.partial(speculative_cycle, cfg=spec_cfg, k=k, greedy=True, max_new_tokens=max_new)
    tokens = jax.ShapeDtypeStruct((1, k + 1), jnp.int32)

    def verify(w, tokens_BT, positions_BT, cache):  # the target's forward and greedy pick, as a cycle runs them
        out = forward(w.target, spec_cfg.target, tokens_BT, positions_BT, cache)
        return jnp.argmax(out.logits, -1), out.cache

    def loop(body):  # the engine's device loop (Engine.generate): steps until every row is done
        return lambda w, s, sp: jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: body(w, s, sp), s)

    served = {}
    if serve_batch:
        slots = jax.eval_shape(lambda w: init_slots(spec_cfg, w, serve_batch, capacity, jnp.bfloat16, True), w)
        cancel = jax.ShapeDtypeStruct((serve_batch,), jnp.bool_)
        for sampled in (False, True):
            fn = functools.partial(run_cycles, cfg=spec_cfg, k=k, sampled=sampled, cycles=4)
            served[f"serve B = {serve_batch}, {'sampled' if sampled else 'greedy'}"] = (fn, (w, slots, cancel), (1,))
    if sampled_batch:
        sp_sampled = SamplingParams(0.8, 0, 0.9).as_arrays()
        batch_args = (jax.ShapeDtypeStruct((sampled_batch, prompt), jnp.int32),
                      jax.ShapeDtypeStruct((sampled_batch,), jnp.int32), jax.random.key(0), sp_sampled)
        sampled_kw = dict(kw, greedy=False)
        batch_spec = jax.eval_shape(functools.partial(spec_prefill, **sampled_kw, k=k, max_cycles=max_new), w,
                                    *batch_args)
        sampled_cycle = functools.partial(speculative_cycle, cfg=spec_cfg, k=k, greedy=False, max_new_tokens=max_new)
        served[f"cycle K = {k} loop, B = {sampled_batch}, sampled"] = (loop(sampled_cycle),
                                                                       (w, batch_spec, sp_sampled), (1,))
    return {
        "prefill": (functools.partial(baseline_prefill, **kw), (w, *prompt_args), ()),
        "decode step": (step, (w, base, sp), (1,)),
        "decode loop": (loop(step), (w, base, sp), (1,)),
        f"verify T = {k + 1}": (verify, (w, tokens, tokens, base.target_cache), (3,)),
        f"cycle K = {k}": (cycle, (w, spec, sp), (1,)),
        f"cycle K = {k} loop": (loop(cycle), (w, spec, sp), (1,)),
        **served,
    }


def compile_text(fn, args, mesh, donate: tuple = ()) -> str:
    with compiling_for("gpu", HOPPER):
        lowered, _ = lower_program(fn, args, donate, mesh)
        return lowered.compile().as_text()


def census(args, log) -> dict:
    mesh = make_mesh((1, args.devices), gpu_devices(args.devices, args.target_config))
    rows, kernels = [], {}
    for layers in (args.layers, args.layers - 2):
        programs = engine_programs(layers, args.k, args.prompt, args.capacity, args.max_new, args.serve_batch,
                                   args.sampled_batch)
        for name, (fn, fargs, donate) in programs.items():
            if layers != args.layers and not ("loop" in name or name.startswith("serve")):
                continue
            t0 = time.perf_counter()
            text = compile_text(fn, fargs, mesh, donate)
            kernels[name, layers] = kernels_apart_from_collectives(text), kernels_in_series(text)
            if layers == args.layers:
                found = collectives(text)
                rows.append(dict(program=name, layers=layers, collectives=found,
                                 largest_mb=max((c["bytes"] for c in found), default=0) / 2 ** 20))
                log(f"{name}: {len(found)} collectives, the largest {rows[-1]['largest_mb']:.3f} MB "
                    f"(compiled in {time.perf_counter() - t0:.1f} s)")
    for row in rows:
        if (row["program"], args.layers - 2) in kernels:
            (n_full, series_full), (n_short, series_short) = (kernels[row["program"], n]
                                                              for n in (args.layers, args.layers - 2))
            row["kernels_per_layer"] = (n_full - n_short) / 2
            row["kernels_in_series_per_layer"] = (series_full - series_short) / 2
    return dict(rows=rows)


def heavy_collectives(rows: list[dict], max_mb: float) -> list[tuple[str, str, float]]:
    """(program, op, MB) of each collective inside a loop's body that moves more than `max_mb`."""
    return [(r["program"], c["op"], c["bytes"] / 2 ** 20) for r in rows for c in r["collectives"]
            if c["in_loop"] and c["bytes"] > max_mb * 2 ** 20]


def markdown(result: dict) -> str:
    lines = [f"# The sharded engine's programs on {result['devices']} x {result['target']}, compiled on a CPU "
             f"(jax {result['jax']}, {result['date']})", "", f"`{result['command']}`", ""]
    for row in result["rows"]:
        per_layer = (f"; a device's kernels a layer, collectives apart: {row['kernels_per_layer']:g} "
                     f"({row['kernels_in_series_per_layer']:g} in series, collectives included)"
                     if "kernels_per_layer" in row else "")
        lines += [f"## {row['program']}, {row['layers']} layers", "",
                  f"{len(row['collectives'])} collectives, the largest {row['largest_mb']:.3f} MB{per_layer}", "",
                  "| collective | result | MB | XLA's kernel | every iteration of the loop |", "|---|---|---|---|---|"]
        lines += [f"| {c['op']} | `{c['shape'][:70]}` | {c['bytes'] / 2 ** 20:.3f} | {c['strategy']} | "
                  f"{'yes' if c['in_loop'] else '-'} |" for c in row["collectives"]]
        lines.append("")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.labs.sharded_census", description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=per_device.SHARD_OF, help="GPUs of the host (a 1 x N mesh)")
    p.add_argument("--layers", type=int, default=6, help="target layers N (the loops are also compiled at N - 2)")
    p.add_argument("--k", type=int, default=3, help="drafts a cycle")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens of the prefill")
    p.add_argument("--capacity", type=int, default=1088, help="cache slots")
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--serve-batch", type=int, default=64, help="slots of the server's loop (0: leave it out)")
    p.add_argument("--sampled-batch", type=int, default=8,
                   help="prompts of the engine's sampled cycle loop (0: leave it out)")
    # the sampled server's one all-to-all of its target logits ([B, K + 1, V / N] f32 a device, 20 MB at B = 64,
    # K = 3) is what exact sampling over a split vocabulary has to move; a gathered vocabulary is 8x that
    p.add_argument("--max-step-mb", type=float, default=32.0,
                   help="exit 1 where a collective inside a device loop moves more than this")
    p.add_argument("--target-config", type=Path, default=H200_TARGET)
    p.add_argument("--out", default="bench/results")
    a = p.parse_args(argv)
    if a.layers < 5:
        p.error("--layers must be at least 5 (N - 2 must still hold two MoE layers after the dense one)")
    if a.devices < 2:
        p.error("--devices must be at least 2 (one device runs no collective)")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    result = dict(**run_header("bench.labs.sharded_census", argv, gpu_devices(1, args.target_config)[0]),
                  devices=args.devices, **census(args, log))
    path = write_result(result, markdown(result), args.out, f"sharded-census-{args.devices}gpu-{result['date']}")
    log(f"wrote {path}.json and .md")
    heavy = heavy_collectives(result["rows"], args.max_step_mb)
    for program, op, mb in heavy:
        log(f"sharded_census: {program}: an {op} of {mb:.1f} MB every iteration (over --max-step-mb "
            f"{args.max_step_mb:g})")
    return 1 if heavy else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
