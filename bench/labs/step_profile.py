"""`python -m bench.labs.step_profile`: where a decode / verify step's time goes, kernel by kernel (JAX profiler).

Runs `--steps` target steps inside one jitted loop (as `Engine.generate` does) under `jax.profiler.trace`, then
reads the device's kernel events from the trace (jax.profiler.ProfileData): per step, the time of each kernel
(grouped by kernel name), each kernel of one step in launch order, the sum of kernel time, and the span and wall
time of the loop; what the kernels do not cover is launch gaps and idle time. With `--cycle-k K` it also traces
speculative cycles (a K2.5-shaped one-layer draft) two ways, one dispatch per cycle (as `Engine.stream` runs them)
and in one device loop (as `Engine.generate` does): run 13 measured synchronised B=8 32k cycles ~9.7 ms slower
than the loop's, which these two rows can take apart. On a CPU the XLA thunks of the host trace stand in for
kernels (smoke check only). Writes step-profile-<platform>-<date>.json and .md to --out.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import collections  # noqa: E402
import functools  # noqa: E402
import glob  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.bytes_floor import HBM_TBS, floor_ms, step_bytes  # noqa: E402
from bench.report import run_stamp, write_json  # noqa: E402
from bench.step import (KERNEL_PATH_MOE, bench_config, draw_weights, make_step, make_step_loop,  # noqa: E402
                        random_cache, step_inputs)
from bench.routes import ROUTINGS  # noqa: E402
from model.config import Kernels  # noqa: E402
from model.decoder import fuse_attention_inputs  # noqa: E402
from model.kv_cache import round_capacity  # noqa: E402


def kernel_events(xplane_path: str) -> list[dict]:
    """Device kernel events of a trace: name, HLO op, start and duration (ns). Without a device plane (CPU),
    the host events that carry an `hlo_op` stat (XLA's thunks)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xplane_path)
    planes = list(data.planes)
    device = [p for p in planes if p.name.startswith("/device:") and "CUSTOM" not in p.name]
    events = []
    for plane in device or planes:
        lines = list(plane.lines)
        streams = [ln for ln in lines if ln.name.startswith("Stream")]
        for line in streams or lines:  # a device plane's streams hold the kernels (other lines summarise them)
            for ev in line.events:
                stats = dict(ev.stats)
                if not device and "hlo_op" not in stats:
                    continue
                events.append(dict(name=ev.name, hlo_op=str(stats.get("hlo_op", ev.name)), start_ns=ev.start_ns,
                                   duration_ns=ev.duration_ns, line=line.name))
    return events


def busy_ns(events: list[dict]) -> float:
    """Union of the events' intervals: time at least one kernel ran."""
    spans = sorted((e["start_ns"], e["start_ns"] + e["duration_ns"]) for e in events)
    total, end = 0.0, float("-inf")
    for s, t in spans:
        if t > end:
            total += t - max(s, end)
            end = t
    return total


def _traced(run, read):
    """`run()` (already warm) once under jax.profiler.trace -> (`read(path of the trace's .xplane.pb)`, wall ms)."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            wall_ms = (time.perf_counter() - t0) * 1e3
        paths = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        if not paths:
            raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {tmp}")
        return read(paths[0]), wall_ms


def traced_events(run) -> tuple[list[dict], float]:
    """`run()` (already warm) once under jax.profiler.trace: its kernel events (`kernel_events`) and wall ms."""
    events, wall_ms = _traced(run, kernel_events)
    if not events:
        raise RuntimeError("the trace holds no kernel events")
    return events, wall_ms


def by_kernel(events: list[dict], tag: str = "hlo_op") -> list[dict]:
    """The events grouped by name, most time first: kernel (the name), ns, count, max_ns and the first non-empty
    `tag` of the group (for kernels the HLO op: on a GPU the command buffer, the CUDA graph, that launched them;
    for host events their line, the thread)."""
    groups = collections.defaultdict(lambda: {"ns": 0.0, "count": 0, tag: "", "max_ns": 0.0})
    for e in events:
        row = groups[e["name"]]
        row["ns"] += e["duration_ns"]
        row["max_ns"] = max(row["max_ns"], e["duration_ns"])
        row["count"] += 1
        row[tag] = row[tag] or e[tag]
    return sorted(({"kernel": k, **v} for k, v in groups.items()), key=lambda r: -r["ns"])


def profile_loop(run, steps: int) -> dict:
    """Trace one call of `run()` (already warm); per-step kernel table and busy / wall times."""
    events, wall_ms = traced_events(run)
    ops = by_kernel(events)
    span_ns = max(e["start_ns"] + e["duration_ns"] for e in events) - min(e["start_ns"] for e in events)
    ordered = sorted(events, key=lambda e: e["start_ns"])
    first_step = ordered[:round(len(events) / steps)]  # the kernels of one step, in launch order
    return dict(
        sequence=[dict(kernel=e["name"], us=e["duration_ns"] / 1e3) for e in first_step],
        wall_ms_per_step=wall_ms / steps,
        span_ms_per_step=span_ns / 1e6 / steps,
        busy_ms_per_step=busy_ns(events) / 1e6 / steps,
        kernel_ms_per_step=sum(e["duration_ns"] for e in events) / 1e6 / steps,
        kernels_per_step=len(events) / steps,
        ops=[dict(hlo_op=r["hlo_op"], kernel=r["kernel"], us_per_step=r["ns"] / 1e3 / steps, longest_us=r["max_ns"] / 1e3,
                  calls_per_step=r["count"] / steps) for r in ops],
    )


def host_events(xplane_path: str, min_us: float = 20.0) -> list[dict]:
    """Host events of a trace (every /host: plane line: the Python thread, XLA's executor threads with their
    thunks, the CUDA driver API calls) of at least `min_us`: name, line, start and duration (ns)."""
    from jax.profiler import ProfileData

    events = []
    for plane in ProfileData.from_file(xplane_path).planes:
        if not plane.name.startswith("/host:"):
            continue
        for line in plane.lines:
            for ev in line.events:  # the profiler's own Python frames span the whole trace: left out
                if ev.duration_ns >= min_us * 1e3 and not ev.name.startswith(("$profiler.py", "$contextlib.py")):
                    events.append(dict(name=ev.name, line=line.name, start_ns=ev.start_ns, duration_ns=ev.duration_ns))
    return events


def idle_gaps(events: list[dict], min_us: float = 20.0) -> list[dict]:
    """Stretches of at least `min_us` in which no kernel ran, with the kernels on either side, in time order."""
    ordered = sorted(events, key=lambda e: e["start_ns"])
    gaps, end, before = [], None, None
    for index, e in enumerate(ordered):
        if end is not None and e["start_ns"] - end >= min_us * 1e3:
            gaps.append(dict(us=(e["start_ns"] - end) / 1e3, before=before, after=e["name"], kernel_index=index))
        if end is None or e["start_ns"] + e["duration_ns"] > end:
            end, before = e["start_ns"] + e["duration_ns"], e["name"]
    return gaps


def loop_call_profile(run_loop, steps: int) -> dict:
    """One traced call of `run_loop(steps)` (already warm): where a device-loop call's time goes beyond its steps.

    The device side: kernels, busy and span, the idle gaps of >= 20 us (where they fall: between which kernels),
    and how long after the call's first host event the first kernel began and before its end the last one ended.
    The host side: its events of >= 20 us grouped by name (the executor's thunks, the driver's graph launches and
    waits). Comparing a call of N steps with one of 3N takes the per-step part out (`bench.timing` times the
    same two lengths)."""
    (kernels, host), wall_ms = _traced(lambda: run_loop(steps), lambda path: (kernel_events(path), host_events(path)))
    first_k = min(e["start_ns"] for e in kernels)
    last_k = max(e["start_ns"] + e["duration_ns"] for e in kernels)
    calls = [e for e in host if e["name"].startswith("PjitFunction")]
    call = max(calls, key=lambda e: e["duration_ns"]) if calls else None
    gaps = idle_gaps(kernels)
    return dict(
        steps=steps, wall_ms=wall_ms, kernels=len(kernels), busy_ms=busy_ns(kernels) / 1e6,
        span_ms=(last_k - first_k) / 1e6,
        call_ms=call["duration_ns"] / 1e6 if call else None,
        first_kernel_after_call_ms=(first_k - call["start_ns"]) / 1e6 if call else None,
        call_end_after_last_kernel_ms=(call["start_ns"] + call["duration_ns"] - last_k) / 1e6 if call else None,
        gaps_over_20us=len(gaps), gaps_ms=sum(g["us"] for g in gaps) / 1e3,
        longest_gaps=sorted(gaps, key=lambda g: -g["us"])[:8],
        host=[dict(name=g["kernel"], line=g["line"], ms=g["ns"] / 1e6, count=g["count"], longest_us=g["max_ns"] / 1e3)
              for g in by_kernel(host, tag="line")[:15]],
    )


def profile_loop_fixed_cost(w, cfg, args, log) -> dict:
    """`--loop-fixed`: one device-loop call of `--steps` decode steps and one of 3 x `--steps`, traced
    (`loop_call_profile`); the difference is the steps, the rest the fixed cost of a call."""
    loop = make_step_loop(cfg, Kernels())
    key = jax.random.PRNGKey(1)
    capacity = round_capacity(args.context + 16 + 20 * args.steps)
    holder = {"cache": random_cache(cfg, args.batch, capacity, args.context, key)}
    tokens_BT, positions_BT = step_inputs(cfg, args.batch, 1, args.context, key)

    def run_loop(n):
        out, holder["cache"] = loop(w, tokens_BT, positions_BT, holder["cache"], jnp.int32(n))
        return out

    for n in (args.steps, 3 * args.steps):  # compile (one program for both) and warm
        jax.block_until_ready(run_loop(n))
    short, long = (loop_call_profile(run_loop, n) for n in (args.steps, 3 * args.steps))
    per_step = {k: (long[k] - short[k]) / (2 * args.steps) for k in ("wall_ms", "busy_ms", "span_ms", "kernels")}
    fixed = {k: short[k] - args.steps * per_step[k] for k in per_step}
    for label, r in (("short", short), ("long", long)):
        log(f"loop of {r['steps']}: wall {r['wall_ms']:.3f} ms, span {r['span_ms']:.3f}, busy {r['busy_ms']:.3f}, "
            f"{r['kernels']} kernels, first kernel {r['first_kernel_after_call_ms']} ms after the call began, "
            f"{r['gaps_over_20us']} gaps >= 20 us ({r['gaps_ms']:.3f} ms)")
        for g in r["longest_gaps"][:4]:
            log(f"    gap {g['us']:8.1f} us  after {g['before'][:40]}  before {g['after'][:40]} (#{g['kernel_index']})")
        for h in r["host"][:8]:
            log(f"    host {h['ms']:8.3f} ms  {h['count']:4d}x  max {h['longest_us']:8.1f} us  {h['name'][:60]}")
    log(f"per step: {per_step}; fixed per call: {fixed}")
    return dict(label="device-loop call, fixed cost", tokens=1, short=short, long=long, per_step=per_step,
                fixed=fixed)


def _log_top_ops(row: dict, log, n: int = 8) -> None:
    for op in row["ops"][:n]:
        log(f"    {op['us_per_step']:8.1f} us  {op['calls_per_step']:4.1f}x  max {op['longest_us']:7.1f}  "
            f"{op['kernel'][:70]}")


def profile_cycles(w, cfg, args, k: int, log) -> list[dict]:
    """Two rows for speculative cycles of K drafts: `--steps` cycles each its own dispatch (queued, one wait at the
    end: what `Engine.stream` dispatches) and `--steps` cycles in one jitted loop (what `Engine.generate` runs)."""
    from bench.cycle import cycle_floor, initial_state, make_cycle, make_cycle_loop, spec_pair

    spec_cfg, dcfg, sw = spec_pair(w, cfg, args.tiny)
    capacity = round_capacity(args.context + 16 + (6 + 4 * args.steps) * (k + 1))  # warm-ups + both profiles
    holder = {"state": initial_state(spec_cfg.target, dcfg, args.batch, args.context, capacity,
                                     jax.random.PRNGKey(100 + k))}
    cycle, loop = make_cycle(spec_cfg, k, Kernels()), make_cycle_loop(
        spec_cfg, k, Kernels())

    def one_per_dispatch():
        ids = None
        for _ in range(args.steps):
            holder["state"], ids = cycle(sw, holder["state"])
        return ids

    def in_a_loop():
        holder["state"] = loop(sw, holder["state"], jnp.int32(args.steps))
        return holder["state"].generated

    ids = np.asarray(one_per_dispatch())  # warm-up (compiles), and the router ids for the byte floor
    floor = floor_ms(cycle_floor(sw, spec_cfg, args.batch, args.context, k, ids)["total"], HBM_TBS)
    rows = []
    for label, run in ((f"cycle K = {k}, one dispatch per cycle", one_per_dispatch),
                       (f"cycle K = {k}, cycles in one device loop", in_a_loop)):
        jax.block_until_ready(run())
        row = profile_loop(run, args.steps)
        row.update(tokens=k + 1, label=label, floor_ms_4p3=floor)
        rows.append(row)
        log(f"{label}: busy {row['busy_ms_per_step']:.3f} ms/cycle, span {row['span_ms_per_step']:.3f}, "
            f"{row['kernels_per_step']:.0f} kernels/cycle, floor {floor:.3f}")
        _log_top_ops(row, log)
    return rows


def markdown(result: dict, top: int) -> str:
    lines = [f"# Step profile: {result['device']}, jax {result['jax']}, {result['date']}", "",
             f"{result['layers']} layers, batch {result['batch']}, context {result['context']}, routed experts "
             f"{result.get('moe_kernel', 'auto')}, routing {result.get('routing', 'model')}, {result['steps']} steps "
             "in one jitted loop, traced with jax.profiler after warm-up. Kernel times are the device's own (per step); "
             "'busy' is the union of kernel intervals, so wall - busy is launch gaps and idle time.", ""]
    for row in result["rows"]:
        small = [k for k in row["sequence"] if k["us"] < 6.0]
        lines += [f"## {row.get('label') or 'T = %d' % row['tokens']}", "",
                  f"One step in launch order (the JSON's `sequence`): {len(row['sequence'])} kernels, {len(small)} of "
                  f"them under 6 us ({sum(k['us'] for k in small):.0f} us together).", "",
                  f"wall {row['wall_ms_per_step']:.3f} ms/step (traced; tracing adds overhead), kernels span "
                  f"{row['span_ms_per_step']:.3f}, busy {row['busy_ms_per_step']:.3f}, {row['kernels_per_step']:.0f} "
                  f"kernels/step; byte floor {row['floor_ms_4p3']:.3f} ms at {HBM_TBS} TB/s "
                  f"(busy / floor {row['busy_ms_per_step'] / row['floor_ms_4p3']:.2f})", "",
                  "| kernel | HLO op | us / step | calls / step | longest call (us) | % of busy |", "|---|---|---|---|---|---|"]
        busy_us = row["busy_ms_per_step"] * 1e3
        for op in row["ops"][:top]:
            lines.append(f"| {op['kernel'][:70]} | {op['hlo_op'][:40]} | {op['us_per_step']:.1f} | "
                         f"{op['calls_per_step']:.1f} | {op['longest_us']:.1f} | {100 * op['us_per_step'] / busy_us:.1f} |")
        rest = sum(op["us_per_step"] for op in row["ops"][top:])
        lines += [f"| (the other {max(0, len(row['ops']) - top)} kernels) | | {rest:.1f} | | | {100 * rest / busy_us:.1f} |",
                  ""]
    if "loop_fixed" in result:
        lines += _loop_fixed_markdown(result["loop_fixed"])
    return "\n".join(lines) + "\n"


def _loop_fixed_markdown(lf: dict) -> list[str]:
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = ["## A device-loop call's fixed cost (decode, T = 1; `--loop-fixed`)", "",
             "| | wall ms | kernel span | busy | kernels | first kernel after the call began | call end after the last "
             "kernel | idle gaps >= 20 us (ms) |", "|---|---|---|---|---|---|---|---|"]
    for r in (lf["short"], lf["long"]):
        lines.append(f"| loop of {r['steps']} | {r['wall_ms']:.3f} | {r['span_ms']:.3f} | {r['busy_ms']:.3f} | "
                     f"{r['kernels']} | {fmt(r['first_kernel_after_call_ms'])} | "
                     f"{fmt(r['call_end_after_last_kernel_ms'])} | {r['gaps_over_20us']} ({r['gaps_ms']:.3f}) |")
    ps, fx = lf["per_step"], lf["fixed"]
    lines += [f"| per step (slope) | {ps['wall_ms']:.3f} | {ps['span_ms']:.3f} | {ps['busy_ms']:.3f} | "
              f"{ps['kernels']:.1f} | | | |",
              f"| fixed per call | {fx['wall_ms']:.3f} | {fx['span_ms']:.3f} | {fx['busy_ms']:.3f} | {fx['kernels']:.1f} "
              "| | | |", ""]
    for r in (lf["short"], lf["long"]):
        lines += [f"Loop of {r['steps']}: longest idle gaps (us, between kernels): "
                  + "; ".join(f"{g['us']:.0f} after `{g['before'][:40]}` before `{g['after'][:40]}` (#{g['kernel_index']})"
                              for g in r["longest_gaps"]) + ".", "",
                  "| host event | line | ms | count | longest us |", "|---|---|---|---|---|"]
        lines += [f"| {h['name'][:60]} | {h['line'][:30]} | {h['ms']:.3f} | {h['count']} | {h['longest_us']:.1f} |"
                  for h in r["host"]]
        lines.append("")
    return lines


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 4],
                   help="target steps of these many tokens (none: only the --cycle-k rows)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cycle-k", type=int, nargs="*", default=[],
                   help="also profile speculative cycles of these K (a K2.5-shaped one-layer draft), --steps of them "
                        "called one per dispatch and --steps in one device loop, so the two can be compared kernel "
                        "by kernel")
    p.add_argument("--top", type=int, default=25, help="ops listed in the markdown table")
    p.add_argument("--loop-fixed", action="store_true",
                   help="also trace a device-loop call of --steps decode steps and one of 3 x --steps: where a call's "
                        "fixed cost (bench.timing's device_loop_fixed_ms) goes, device and host")
    p.add_argument("--moe-kernel", choices=KERNEL_PATH_MOE, default="auto",
                   help="the target steps' routed experts (model.config.Kernels.moe)")
    p.add_argument("--routing", choices=ROUTINGS, default="model",
                   help="the target steps' expert choices (bench.routes: model, independent, neighbour, shared)")
    p.add_argument("--tiny", action="store_true", help="small dims (CPU smoke run)")
    p.add_argument("--out", default=str(Path(__file__).parents[1] / "results"))
    p.add_argument("--hlo", action="store_true",
                   help="also write the loop's optimized HLO per T (step-profile-...-T<t>.hlo.txt): maps kernel names "
                        "to the ops they fuse")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    checks = [("--steps", args.steps), ("--layers", args.layers), ("--batch", args.batch)]
    checks += [("--tokens", t) for t in args.tokens] + [("--cycle-k", k) for k in args.cycle_k]
    for flag, v in checks:
        if v < 1:
            raise SystemExit(f"{flag} must be >= 1, not {v}")
    if not args.tokens and not args.cycle_k and not args.loop_fixed:
        raise SystemExit("nothing to profile: give --tokens or --cycle-k")
    log = functools.partial(print, flush=True)
    stamp = run_stamp()
    cfg = bench_config(args.layers, args.tiny)
    w = fuse_attention_inputs(draw_weights(cfg, args.tiny))  # the layout the engines run
    kernels = Kernels(moe=args.moe_kernel)
    loop = make_step_loop(cfg, kernels, args.routing)
    step = make_step(cfg, kernels, args.routing)
    result = dict(**stamp.fields, layers=args.layers, batch=args.batch, context=args.context,
                  steps=args.steps, moe_kernel=args.moe_kernel, routing=args.routing, rows=[])
    for t in args.tokens:
        key = jax.random.PRNGKey(t)
        holder = {"cache": random_cache(cfg, args.batch, round_capacity(args.context + 16), args.context, key)}
        tokens_BT, positions_BT = step_inputs(cfg, args.batch, t, args.context, key)
        _, holder["cache"], ids_LTK = step(w, tokens_BT, positions_BT, holder["cache"])  # for the byte count

        def run():
            out, holder["cache"] = loop(w, tokens_BT, positions_BT, holder["cache"], jnp.int32(args.steps))
            return out

        for _ in range(2):
            jax.block_until_ready(run())
        if args.hlo:
            hlo = loop.lower(w, tokens_BT, positions_BT, holder["cache"], jnp.int32(args.steps)).compile().as_text()
            hlo_path = Path(args.out) / f"step-profile-{stamp.suffix}-T{t}.hlo.txt"
            hlo_path.parent.mkdir(parents=True, exist_ok=True)
            hlo_path.write_text(hlo)
            log(f"wrote {hlo_path}")
        row = profile_loop(run, args.steps)
        unique = [int(np.unique(ids).size) for ids in np.asarray(ids_LTK)]
        row.update(tokens=t, floor_ms_4p3=floor_ms(step_bytes(w, cfg, args.batch, t, args.context, unique)["total"],
                                                   HBM_TBS))
        result["rows"].append(row)
        log(f"T={t}: busy {row['busy_ms_per_step']:.3f} ms/step, span {row['span_ms_per_step']:.3f}, "
            f"{row['kernels_per_step']:.0f} kernels/step, floor {row['floor_ms_4p3']:.3f}")
        _log_top_ops(row, log)
    for k in args.cycle_k:
        result["rows"] += profile_cycles(w, cfg, args, k, log)
    if args.loop_fixed:
        result["loop_fixed"] = profile_loop_fixed_cost(w, cfg, args, log)
    stem = f"step-profile-{stamp.suffix}"
    path = write_json(result, Path(args.out), stem)
    path.with_suffix(".md").write_text(markdown(result, args.top))
    log(f"wrote {path} and .md")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
