"""`python -m bench.compile_adaptive`: what adaptive speculation by call costs to build against the fixed-K engine,
by depth. The fixed-K engine compiles one device loop of K-draft cycles; adaptive by call compiles one loop per K of
its set (`jaxspec.adaptive_calls.spec_loop`, and for K = 0 `probe_loop`, plain decoding that keeps the draft
current) side by side, as `Engine.generate` does (`jaxspec.sharded.compile_programs`: one thread a program): without
plain tails, as a first run builds it (no cost table yet) and as any run does where a call costs less than a plain
step (`PerCallPolicy.built_tails`); with `--tailed` also the set whose tailed K carry their plain tail, as a run
whose table asks for them builds it. Kimi-K2.5 shapes with INT4 experts at batch 1 over a 1k context, built from
shapes alone (nothing is drawn or run), JAX's persistent cache off.

Each build runs in a fresh process: XLA keeps in a process (and in the engine's autotuning directory,
`jaxspec.xla_flags`) the GEMM kernels it timed, so a build after another would skip the autotuning the first one
paid. Two rows a depth: `cold`, each build with an empty autotuning directory of its own (a machine's first run),
and `kept`, each build again with the directory its cold build filled (a later build on the same machine, e.g.
after a setting changed the programs). Writes compile-adaptive-<device>-<date>.json and .md to --out.

    python -m bench.compile_adaptive --layers 4 61
    python -m bench.compile_adaptive --tiny --layers 3 --out /tmp/ca      # a CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.compile_depth import CONTEXT, abstract_target
from bench.cycle import initial_state, spec_configs, spec_pair
from bench.report import fmt, write_report
from bench.step import bench_config
from jaxspec.adaptive_calls import PerCallPolicy, plain_loop, plain_to_the_end, probe_loop, spec_loop, to_plain
from jaxspec.adaptive_calls_run import never_leaving
from jaxspec.models import SpecWeights
from jaxspec.sharded import compile_programs, lower_program
from jaxspec.spec_step import speculative_cycle
from jaxspec.state import on_host, progress
from jaxspec.xla_flags import AUTOTUNE_CACHE_ENV, AUTOTUNE_CACHE_FLAG
from model.kv_cache import round_capacity

MAX_NEW = 128


def abstract_pair(cfg, tiny: bool):
    """(SpecConfig, abstract SpecWeights, abstract SpecState) at `cfg`'s depth."""
    w = abstract_target(cfg)
    spec_cfg, dcfg = spec_configs(cfg, tiny)
    sw = SpecWeights(target=w, draft=jax.eval_shape(lambda: spec_pair(w, cfg, tiny)[2].draft))
    capacity = round_capacity(CONTEXT + MAX_NEW + 16)
    state = jax.eval_shape(lambda: initial_state(cfg, dcfg, 1, CONTEXT, capacity, jax.random.PRNGKey(0)))
    return spec_cfg, sw, state


def fixed_loop_spec(spec_cfg, sw, state, k: int):
    """The fixed-K engine's device loop (`Engine.generate`'s `loop_spec`), greedy, as (fn, args, donate)."""
    cycle = functools.partial(speculative_cycle, cfg=spec_cfg, k=k, greedy=True, max_new_tokens=MAX_NEW)

    def loop(w, s):
        s = jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: cycle(w, s, {}), s)
        return s, on_host(progress(s))

    return loop, (sw, state), (1,)


def per_call_specs(spec_cfg, sw, state, steps: tuple[int, ...], window: int, tails: tuple[int, ...],
                   probe_every: int):
    """Adaptive by call's programs for the K set `steps` (the K in `tails` with their plain tail; K = 0 the plain
    loop that keeps the draft current, or with `probe_every` 0 plain decoding's own loop), as
    `jaxspec.adaptive_calls_run._programs` builds them for the EAGLE-3 draft."""
    specs = []
    for k in steps:
        if k == 0 and probe_every > 0:
            fn = functools.partial(probe_loop, cfg=spec_cfg, greedy=True, max_new_tokens=MAX_NEW, width=probe_every)
            specs.append((lambda w, s, f, fn=fn: fn(w, s, {}, f), (sw, state, plain_to_the_end(0)), (1,)))
        elif k == 0:
            fn = functools.partial(plain_loop, cfg=spec_cfg, greedy=True, max_new_tokens=MAX_NEW)
            specs.append((lambda w, s, n, fn=fn: fn(w, s, {}, n), (sw, jax.eval_shape(to_plain, state),
                                                                    jax.ShapeDtypeStruct((), jnp.int32)), (1,)))
        else:
            fn = functools.partial(spec_loop, cfg=spec_cfg, k=k, window=window, greedy=True, max_new_tokens=MAX_NEW,
                                   plain_tail=k in tails)
            specs.append((lambda w, s, r, fn=fn: fn(w, s, {}, r), (sw, state, never_leaving(0)), (1,)))
    return specs


def timed_compile(specs, lower_all_first: bool = False) -> float:
    jax.clear_caches()  # JAX keeps what it traced and compiled in memory too
    t0 = time.perf_counter()
    (compile_after_lowering_all if lower_all_first else compile_programs)(specs)
    return time.perf_counter() - t0


def compile_after_lowering_all(specs) -> list:
    """`compile_programs` as it was before it overlapped lowering and compiling: every program lowered, then all
    compiled side by side (a comparison for this bench)."""
    lowered = [lower_program(fn, args, donate) for fn, args, donate in specs]
    with ThreadPoolExecutor(max_workers=max(1, min(len(lowered), os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda lw: lw[0].compile(), lowered))


# the fixed loop; the by-call set; the same with the policy's plain tails; the set's largest-K loop alone
BUILDS = ("fixed", "per_call", "per_call_tailed", "slowest")


def build_here(layers: int, k: int, what: str, tiny: bool, lower_all_first: bool = False) -> float:
    """Seconds to build `what` (one of BUILDS) in this process, JAX's persistent cache off."""
    jax.config.update("jax_enable_compilation_cache", False)
    spec_cfg, sw, state = abstract_pair(bench_config(layers, tiny), tiny)
    if what == "fixed":
        return timed_compile([fixed_loop_spec(spec_cfg, sw, state, k)], lower_all_first)
    policy = PerCallPolicy()
    steps, window, tails = policy.compiled(k)
    specs = per_call_specs(spec_cfg, sw, state, steps, window, tails if what == "per_call_tailed" else (),
                           policy.probe_every)
    return timed_compile(specs[-1:] if what == "slowest" else specs, lower_all_first)


def build_fresh(layers: int, k: int, what: str, tiny: bool, autotune_dir: Path, xla_flags: str = "",
                lower_all_first: bool = False) -> float:
    """`build_here` in a new process whose autotuning is kept in `autotune_dir` (and only there), with `xla_flags`
    added to the engine's."""
    env = dict(os.environ, **{AUTOTUNE_CACHE_ENV: str(autotune_dir)})
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(AUTOTUNE_CACHE_FLAG)]
    env["XLA_FLAGS"] = " ".join(flags + xla_flags.split())
    cmd = [sys.executable, "-m", "bench.compile_adaptive", "--one", what, "--layers", str(layers), "--k", str(k)]
    cmd += (["--tiny"] if tiny else []) + (["--lower-all-first"] if lower_all_first else [])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise RuntimeError(f"the {what} build failed: {last[-1500:]}")
    return json.loads(lines[-1])["seconds"]


def _tailed_cells(row: dict) -> str:
    tailed = row.get("per_call_tailed_s")
    return "" if tailed is None else f", with plain tails {tailed:.2f} s ({tailed / row['fixed_s']:.2f}x)"


def markdown(result: dict) -> str:
    lines = [f"# Building adaptive by call against fixed K: {result['device']}, jax {result['jax']}, {result['date']}",
             "", f"Kimi-K2.5 shapes, INT4 experts, batch 1, {result['context']}-token context, greedy, from shapes; "
             f"trace + lower + XLA, seconds, each build in a fresh process. Fixed: one loop of K = {result['k']} "
             f"cycles; by call: the loops of K set {result['steps']} compiled side by side on {result['cpus']} host "
             "cores. Autotuning cold: an empty directory per build; kept: the directory its cold build filled."
             + (f" XLA flags added: `{result['xla_flags']}`." if result.get("xla_flags") else "")
             + (" Every program lowered before any compiles." if result.get("lower_all_first") else ""), "",
             "| layers | autotuning | fixed K loop | by call, all loops | by call / fixed | with plain tails | "
             "tails / fixed | largest-K loop alone |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        tailed = r.get("per_call_tailed_s")
        lines.append(f"| {r['layers']} | {r['autotune']} | {fmt(r['fixed_s'], 2)} | {fmt(r['per_call_s'], 2)} | "
                     f"{fmt(r['per_call_s'] / r['fixed_s'], 2)} | {fmt(tailed, 2)} | "
                     f"{fmt(None if tailed is None else tailed / r['fixed_s'], 2)} | {fmt(r.get('slowest_s'), 2)} |")
    for e in result["errors"]:
        lines.append(f"\nerror: {e}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.compile_adaptive", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 61])
    p.add_argument("--k", type=int, default=4, help="the fixed engine's K and the by-call set's largest")
    p.add_argument("--alone", action="store_true", help="also build the by-call set's largest-K loop alone")
    p.add_argument("--tailed", action="store_true",
                   help="also build the by-call set with the policy's plain tails (where a call costs over a step)")
    p.add_argument("--autotune", nargs="+", choices=["cold", "kept"], default=["cold", "kept"])
    p.add_argument("--label", default="", help="a name for this run's files (beside the device and date)")
    p.add_argument("--xla-flags", default="", help="XLA flags every build adds (a comparison of XLA's options)")
    p.add_argument("--lower-all-first", action="store_true",
                   help="lower every program before XLA compiles any (as the engine did before it overlapped them)")
    p.add_argument("--tiny", action="store_true", help="small dimensions (a CPU smoke run)")
    p.add_argument("--one", choices=BUILDS, default=None, help=argparse.SUPPRESS)  # a child: build, print seconds
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    if args.k < 1 or min(args.layers) < 3:
        p.error("--k must be >= 1 and --layers >= 3 (the draft taps three distinct target layers)")
    if args.one is not None:
        seconds = build_here(args.layers[0], args.k, args.one, args.tiny, args.lower_all_first)
        print(json.dumps(dict(seconds=seconds)), flush=True)
        return None
    dev = jax.devices()[0]
    steps, _, _ = PerCallPolicy().compiled(args.k)
    result = dict(device=dev.device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(),
                  context=CONTEXT, k=args.k, steps=list(steps), cpus=os.cpu_count(), xla_flags=args.xla_flags,
                  lower_all_first=args.lower_all_first, rows=[], errors=[])
    stem = f"compile-adaptive-{dev.platform}-{result['date']}" + (f"-{args.label}" if args.label else "")
    builds = ["fixed", "per_call"] + (["per_call_tailed"] if args.tailed else []) + (["slowest"] if args.alone else [])
    for layers in args.layers:
        with tempfile.TemporaryDirectory(prefix="jaxspec-autotune-") as tmp:
            dirs = {what: Path(tmp) / what for what in builds}  # one autotuning directory per build, kept for "kept"
            for autotune in ["cold", "kept"]:
                if autotune not in args.autotune and not (autotune == "cold" and "kept" in args.autotune):
                    continue
                row = dict(layers=layers, autotune=autotune)
                try:
                    for what in builds:
                        row[f"{what}_s"] = build_fresh(layers, args.k, what, args.tiny, dirs[what], args.xla_flags,
                                                       args.lower_all_first)
                except Exception as e:  # noqa: BLE001 - one row's failure is reported, the others still run
                    result["errors"].append(f"{layers} layers, {autotune}: {type(e).__name__}: {e}"[:2000])
                    print(result["errors"][-1], flush=True)
                    row = None
                if row is not None and autotune in args.autotune:
                    result["rows"].append(row)
                    print(f"{layers:3d} layers, autotuning {autotune}: fixed K={args.k} {row['fixed_s']:.2f} s, by "
                          f"call {row['per_call_s']:.2f} s ({row['per_call_s'] / row['fixed_s']:.2f}x)"
                          + _tailed_cells(row), flush=True)
                write_report(result, Path(args.out), stem, markdown)  # a run cut short keeps what it measured
    return result


if __name__ == "__main__":
    main()
