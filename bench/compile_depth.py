"""`python -m bench.compile_depth`: what it costs to build the engine's programs at a depth. For each depth and
program (a decode step, a verify step of T tokens, a speculative cycle of K drafts, all Kimi-K2.5-shaped with INT4
experts at batch 1 over a 1k context), jax's trace, its lowering to StableHLO and XLA's compile are timed apart,
beside the size of the lowered text and the custom calls (Pallas kernels) in it. Programs are built from shapes
alone: nothing is drawn or run, so a 61-layer program costs its compile and no memory.

`--cache-dir DIR` (a new, empty directory) points JAX's persistent compilation cache there, so the compiles are
cold and their programs are kept; a second process with `--warm` and the same directory then times what a later run
of the engine pays: each compile a load (the table marks hits). `--profile PROGRAM ...` records XLA's cold compile
of those programs at the deepest depth with the JAX profiler and keeps the events that took the most time (where a
compile's seconds go, pass by pass). Writes compile-depth-<device>-<date>.json and .md to --out.

    python -m bench.compile_depth --layers 4 10 61 --programs decode verify4 cycle3 --cache-dir /tmp/cc
    python -m bench.compile_depth --layers 61 --programs decode --cache-dir /tmp/cc --warm
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.cycle import initial_state, make_cycle, spec_configs, spec_pair
from bench.report import fmt, publish, write_report
from bench.step import bench_config, make_step
from jaxspec.models import SpecWeights
from model.config import Kernels
from model.decoder import fuse_attention_inputs
from model.init import init_kimi_weights
from model.kv_cache import init_latent_cache, round_capacity

CONTEXT = 1024
PROGRAM_RE = re.compile(r"^(decode|verify(\d+)|cycle(\d+))$")


def parse_program(name: str) -> tuple[str, int]:
    """'decode' -> ('step', 1); 'verifyT' -> ('step', T); 'cycleK' -> ('cycle', K)."""
    m = PROGRAM_RE.match(name)
    if not m:
        raise argparse.ArgumentTypeError(f"a program is decode, verifyT (T tokens) or cycleK (K drafts), not {name!r}")
    if m.group(1) == "decode":
        return "step", 1
    return ("step", int(m.group(2))) if m.group(2) else ("cycle", int(m.group(3)))


def abstract_target(cfg):
    """The weights' shapes as the engine runs them (attention inputs fused), with nothing allocated."""
    return jax.eval_shape(lambda: fuse_attention_inputs(init_kimi_weights(cfg, jax.random.PRNGKey(0), experts="int4")))


def program_and_args(cfg, kind: str, n: int, tiny: bool):
    """(jitted function, abstract arguments) of one program at `cfg`'s depth."""
    w = abstract_target(cfg)
    capacity = round_capacity(CONTEXT + 16)
    if kind == "step":
        tokens = jax.ShapeDtypeStruct((1, n), jnp.int32)
        cache = jax.eval_shape(lambda: init_latent_cache(cfg, 1, capacity, jnp.bfloat16))
        return make_step(cfg, Kernels()), (w, tokens, tokens, cache)
    spec_cfg, dcfg = spec_configs(cfg, tiny)
    sw = SpecWeights(target=w, draft=jax.eval_shape(lambda: spec_pair(w, cfg, tiny)[2].draft))
    state = jax.eval_shape(lambda: initial_state(cfg, dcfg, 1, CONTEXT, capacity, jax.random.PRNGKey(0)))
    return make_cycle(spec_cfg, n, Kernels()), (sw, state)


def custom_calls(text: str) -> int:
    return text.count("stablehlo.custom_call")


CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}
cache_counts = {"hits": 0, "misses": 0}


def _count_cache_event(event: str, **_) -> None:
    if event in CACHE_EVENTS:
        cache_counts[CACHE_EVENTS[event]] += 1


jax.monitoring.register_event_listener(_count_cache_event)


def build(fn, args, cache_dir: Path | None) -> dict:
    """Trace, lower and compile `fn` at `args`, each timed; with `cache_dir`, whether the compile was a load from
    the persistent cache (`compile_cache_hit`)."""
    t0 = time.perf_counter()
    traced = fn.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    text = lowered.as_text()
    t3 = time.perf_counter()
    hits = cache_counts["hits"]
    lowered.compile()
    t4 = time.perf_counter()
    hit = cache_counts["hits"] > hits
    row = dict(trace_s=t1 - t0, lower_s=t2 - t1, compile_s=t4 - t3, text_mb=len(text) / 1e6,
               custom_calls=custom_calls(text), function_calls=text.count("call @"))
    row["total_s"] = row["trace_s"] + row["lower_s"] + row["compile_s"]
    if cache_dir is not None:
        row["compile_cache_hit"] = hit
    return row


def profiled_compile(fn, args, top: int) -> list[dict]:
    """The events of XLA's compile of `fn` that took the most time in all (inclusive: a pass pipeline counts its
    passes too), from the JAX profiler's trace; Python's frames are left out."""
    jax.clear_caches()  # JAX keeps what it compiled in memory too
    lowered = fn.trace(*args).lower()
    cache_on = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # compile, whatever a cache holds
    try:
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                lowered.compile()
            paths = list(Path(d).rglob("*.trace.json.gz"))
            events = json.loads(gzip.open(paths[0]).read())["traceEvents"] if paths else []
    finally:
        jax.config.update("jax_enable_compilation_cache", cache_on)
    total, count = defaultdict(float), defaultdict(int)
    for e in events:
        if e.get("ph") == "X" and "dur" in e and not str(e.get("name", "$")).startswith("$"):  # not Python frames
            name = re.sub(r"\.\d+$", "", str(e.get("name", "")))
            total[name] += e["dur"] / 1e6
            count[name] += 1
    ranked = sorted(total, key=total.get, reverse=True)[:top]
    return [dict(event=n, seconds=total[n], count=count[n]) for n in ranked]


def markdown(result: dict) -> str:
    lines = [f"# Building the engine's programs by depth: {result['device']}, jax {result['jax']}, {result['date']}",
             "", "Kimi-K2.5 shapes, INT4 experts, batch 1, 1k context, built from shapes alone. Seconds; the lowered "
             "program's StableHLO text in MB and the custom calls (Pallas kernels) in it.", "",
             "| layers | program | trace | lower | XLA compile | total | lowered MB | custom calls |",
             "|---|---|---|---|---|---|---|---|"]
    hit = {True: " (hit)", False: " (miss)", None: ""}
    for r in result["rows"]:
        lines.append(f"| {r['layers']} | {r['program']} | {fmt(r['trace_s'], 2)} | {fmt(r['lower_s'], 2)} | "
                     f"{fmt(r['compile_s'], 2)}{hit[r.get('compile_cache_hit')]} | {fmt(r['total_s'], 2)} | "
                     f"{fmt(r['text_mb'], 2)} | {r['custom_calls']} |")
    for p in result.get("profiles", []):
        lines += ["", f"XLA compile of {p['program']} at {p['layers']} layers, host events by total time:", "",
                  "| event | seconds | count |", "|---|---|---|"]
        lines += [f"| `{e['event'][:90]}` | {fmt(e['seconds'], 2)} | {e['count']} |" for e in p["events"]]
    for e in result["errors"]:
        lines.append(f"\nerror: {e}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.compile_depth", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 10, 61])
    p.add_argument("--programs", type=parse_program, nargs="+", default=[("step", 1), ("step", 4), ("cycle", 3)],
                   metavar="PROGRAM", help="decode, verifyT (T tokens), cycleK (K drafts)")
    p.add_argument("--cache-dir", type=Path, help="a new, empty directory: compile each program again from it")
    p.add_argument("--warm", action="store_true",
                   help="--cache-dir holds what an earlier process compiled there: each compile is a load")
    p.add_argument("--profile", nargs="*", default=[], metavar="PROGRAM",
                   help="profile XLA's compile of these programs at the deepest depth")
    p.add_argument("--profile-top", type=int, default=40)
    p.add_argument("--tiny", action="store_true", help="small dimensions (a CPU smoke run)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    if args.cache_dir is not None:
        if not args.warm and args.cache_dir.exists() and any(args.cache_dir.iterdir()):
            raise SystemExit(f"--cache-dir {args.cache_dir}: not empty (the first compile must be cold; --warm to "
                             "load what an earlier run wrote there)")
        args.cache_dir.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(args.cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    dev = jax.devices()[0]
    result = dict(device=dev.device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(),
                  context=CONTEXT, rows=[], profiles=[], errors=[])
    names = {("step", 1): "decode"}
    stem = f"compile-depth-{dev.platform}-{result['date']}"
    for layers in args.layers:
        cfg = bench_config(layers, args.tiny)
        for kind, n in args.programs:
            program = names.get((kind, n), f"{'verify' if kind == 'step' else 'cycle'}{n}")
            try:
                fn, fargs = program_and_args(cfg, kind, n, args.tiny)
                row = dict(layers=layers, program=program, **build(fn, fargs, args.cache_dir))
                result["rows"].append(row)
                print(f"{layers:3d} layers {program:8s}: trace {row['trace_s']:.2f} s, lower {row['lower_s']:.2f} s, "
                      f"compile {row['compile_s']:.2f} s, lowered {row['text_mb']:.2f} MB, "
                      f"{row['custom_calls']} custom calls", flush=True)
                if program in args.profile and layers == max(args.layers):
                    result["profiles"].append(dict(layers=layers, program=program,
                                                   events=profiled_compile(fn, fargs, args.profile_top)))
            except Exception as e:  # noqa: BLE001 - one program's failure is reported, the others still run
                result["errors"].append(f"{layers} layers {program}: {type(e).__name__}: {e}"[:2000])
                print(result["errors"][-1], flush=True)
            write_report(result, Path(args.out), stem, markdown)  # a run cut short keeps what it measured
    publish(result, Path(args.out), stem, markdown, print)
    return result


if __name__ == "__main__":
    main()
