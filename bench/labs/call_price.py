"""`python -m bench.labs.call_price`: what one more device call of a fixed-K loop costs, and where (issue 53).

Adaptive speculation by call changes K between calls of fixed-K loops, and its cost table prices one more call at
its intercept (1.9 ms on the embedded pair, 4.4 ms at 4 layers, 7.1 ms at 61 on an H200), yet generations that made
one call more lost more than that. This lab splits a generation into calls on a K2.5-shaped model (chained target,
bench.adaptive_acceptance's controllable drafter at --acceptance) and times, per variant, the decode of
--max-new-tokens after a prefill that is not timed (median of --rounds interleaved rounds after a warm-up):

- `fixed`: the fixed-K loop (`~all(done)` its predicate) in one call, as the fixed engine runs it;
- `calls_1`: adaptive by call's K loop (`jaxspec.adaptive_calls.spec_loop`) never leaving, one call;
- `calls_same`: the same executable, --cycles-per-call cycles a call, the host reading the call's summary after each
  as `drive` does (its round trip), until the batch is done (`call_summary` writes the summary to host memory; run
  1829, at commit bfa3797, timed it read back from the device against a variant that wrote it to host memory, before
  that became the engine's way);
- `calls_wait`: as `calls_same`, the host waiting for the summary before reading it;
- `calls_exact`: the calls `calls_same` makes, queued, nothing read between them (a call's price without the read);
- `calls_queued`: the same calls queued without reading anything between them (enough of them for the whole
  generation; the surplus ones run no cycle), so the host's round trip is not in it;
- `calls_twin`: as `calls_same`, alternating between two executables of the same loop compiled apart, so each call
  is an executable's first run in the generation (what a change of K pays beyond a call);
- `empty`: one call that runs no cycle (the loop's entry and its first predicate alone).

Per variant: the median and spread of decode ms and the calls made; the price of one more call is
(variant - calls_1) / (calls - 1). The host's own time per call is reported: for the queued calls their dispatch
(until the call returns, not synchronised), for the calls read one by one the read.

`--trace-empty N`: N more `empty` calls under jax.profiler.trace: the host's events of at least 2 us and the
device's kernels grouped by name (where a call's fixed time goes: the arguments, XLA's execution steps, the driver,
work outside the loop), and the ops the K loop's program runs outside its loop (from its optimised HLO).
`--trace-calls`: one `calls_same` generation traced, and the host's self time by event name within the device's idle
gaps (where a call boundary's time goes; the profiler inflates graph launches). Writes
call-price-<device>-<date>.json and .md to --out.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.adaptive_acceptance import chained_target, per_call_programs, programs  # noqa: E402
from bench.cycle import spec_pair  # noqa: E402
from bench.report import publish, run_stamp  # noqa: E402
from bench.step import bench_config, draw_weights  # noqa: E402
from jaxspec.adaptive import AdaptivePolicy  # noqa: E402
from jaxspec.adaptive_calls import RULE_FIELDS, PerCallPolicy, read_summary  # noqa: E402
from jaxspec.adaptive_calls_run import NO_LIMIT, never_leaving  # noqa: E402
from jaxspec.prefill import prompt_bucket  # noqa: E402
from jaxspec.sharded import compile_programs  # noqa: E402
from model.kv_cache import round_capacity  # noqa: E402

VARIANTS = ("fixed", "calls_1", "calls_same", "calls_wait", "calls_exact", "calls_queued", "calls_twin", "empty")


def build(args, log):
    """(prefill, {variant: run(state) -> (state, calls, host seconds spent dispatching)}), compiled ahead of time."""
    cfg = bench_config(args.layers, args.tiny)
    w = draw_weights(cfg, args.tiny, moe_layers=args.moe_layers)
    w = jax.block_until_ready(chained_target(w))
    spec_cfg, _, sw = spec_pair(w, cfg, args.tiny)
    bucket = prompt_bucket(args.prompt_tokens)
    capacity = round_capacity(max(bucket, args.prompt_tokens + args.max_new_tokens + args.k + 1))
    per_cycle = AdaptivePolicy(steps=(0, args.k), probe=False)  # `programs` builds it too; not run here
    base_prefill, sprefill, base_loop, fixed, _ = programs(spec_cfg, [args.k], (0, args.k), per_cycle,
                                                           args.max_new_tokens, capacity)
    loops, _ = per_call_programs(spec_cfg, (0, args.k), PerCallPolicy(steps=(0, args.k)), args.max_new_tokens)
    rng = np.random.default_rng(0)
    tokens = np.zeros((1, bucket), np.int32)
    tokens[:, : args.prompt_tokens] = rng.integers(3, cfg.vocab_size, (1, args.prompt_tokens))
    prompt = (sw, jnp.asarray(tokens), jnp.full((1,), args.prompt_tokens, jnp.int32), jax.random.key(0), {})
    base_state, state = jax.eval_shape(base_prefill, *prompt), jax.eval_shape(sprefill, *prompt)
    rate, cont = jax.ShapeDtypeStruct((), jnp.float32), base_state.out_tokens
    rule = jax.ShapeDtypeStruct((RULE_FIELDS,), jnp.float32)
    t0 = time.perf_counter()
    plain_prefill, plain_loop, prefill, fixed_k, call_k, twin_k = compile_programs([
        (base_prefill, prompt, ()), (base_loop, (sw, base_state), (1,)), (sprefill, prompt, ()),
        (fixed[args.k], (sw, state, rate, cont), (1,)), (loops[args.k], (sw, state, rule, rate, cont), (1,)),
        (loops[args.k], (sw, state, rule, rate, cont), (1,))])
    log(f"programs compiled side by side in {time.perf_counter() - t0:.1f} s")
    a = np.float32(args.acceptance)
    cont_BS = plain_loop(sw, plain_prefill(*prompt)).out_tokens  # the continuation the drafter copies
    per_call = args.cycles_per_call

    def one(program):
        return lambda s: (program(sw, s, never_leaving(NO_LIMIT), a, cont_BS)[0], 1, 0.0)

    def calls(programs_, wait=False):
        def run(s):
            n, host = 0, 0.0
            while True:
                s, summary = programs_[n % len(programs_)](sw, s, never_leaving(per_call), a, cont_BS)
                n += 1
                t0 = time.perf_counter()
                if wait:
                    jax.block_until_ready(summary)
                done = read_summary(jax.device_get(summary), s).done_B  # `drive`'s one read of the call's summary
                host += time.perf_counter() - t0
                if done.all():
                    return s, n, host / n
        return run

    fixed_cycles = int(fixed_k(sw, prefill(*prompt), a, cont_BS).cycles)

    def exact(s):  # as many calls as the generation needs, none read until the end
        n = -(-fixed_cycles // per_call)
        for _ in range(n):
            s = call_k(sw, s, never_leaving(per_call), a, cont_BS)[0]
        return s, n, 0.0

    def queued(s):
        host = 0.0
        n = -(-args.max_new_tokens // per_call)  # a cycle emits at least one token a row: this many always finish
        for _ in range(n):
            t0 = time.perf_counter()
            s = call_k(sw, s, never_leaving(per_call), a, cont_BS)[0]
            host += time.perf_counter() - t0
        return s, n, host / n

    runs = {"fixed": lambda s: (fixed_k(sw, s, a, cont_BS), 1, 0.0), "calls_1": one(call_k),
            "calls_same": calls([call_k]), "calls_wait": calls([call_k], wait=True),
            "calls_exact": exact, "calls_queued": queued, "calls_twin": calls([call_k, twin_k]),
            "empty": lambda s: (call_k(sw, s, never_leaving(0), a, cont_BS)[0], 1, 0.0)}
    return (lambda: prefill(*prompt)), runs, call_k


def entry_work(compiled) -> list[dict]:
    """The ops a compiled program's ENTRY computation runs outside its loops (what every call pays before and after
    the first predicate): name, opcode and the bytes of the result, from the optimised HLO, largest first."""
    text = compiled.as_text()
    entry = text[text.index("\nENTRY"):].split("\n}\n")[0].split("\n")[1:]
    skip = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "after-all", "opt-barrier")
    sizes = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
             "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
    rows = []
    for line in entry:
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\(", line)
        if not m or m.group(4) in skip:
            continue
        elements = int(np.prod([int(d) for d in m.group(3).split(",") if d] or [1]))
        operands = re.findall(r"%([\w.\-]+)", line.split("(", 1)[1].split(")", 1)[0])
        rows.append(dict(name=m.group(1), opcode=m.group(4), bytes=elements * sizes.get(m.group(2), 4),
                         operands=operands[:3]))
    return sorted(rows, key=lambda r: -r["bytes"])


def trace_empty(start, empty, program, calls: int, log) -> dict:
    """`calls` synchronised `empty` calls under the profiler: the host events of >= 2 us and the device's kernels,
    grouped by name, per call; and the program's work outside its loops (`entry_work`)."""
    from bench.labs.step_profile import _traced, by_kernel, host_events, kernel_events

    state = jax.block_until_ready(start())

    def run():
        s = state
        for _ in range(calls):
            s = jax.block_until_ready(empty(s)[0])
        return s.generated

    (host, kernels), wall_ms = _traced(run, lambda path: (host_events(path, min_us=2.0), kernel_events(path)))

    def grouped(events, tag):
        return [dict(name=g["kernel"], where=g[tag], us_a_call=g["ns"] / 1e3 / calls,
                     count_a_call=g["count"] / calls, longest_us=g["max_ns"] / 1e3)
                for g in by_kernel(events, tag=tag)[:30]]

    out = dict(calls=calls, wall_ms=wall_ms, host=grouped(host, "line"), kernels=grouped(kernels, "hlo_op"),
               kernels_a_call=len(kernels) / calls, entry_work=entry_work(program))
    log(f"traced: {calls} empty calls in {wall_ms:.2f} ms; {out['kernels_a_call']:.1f} kernels a call")
    for title, rows in (("host events of >= 2 us", out["host"]), ("device kernels", out["kernels"])):
        log(f"{title}, a call:")
        for r in rows:
            log(f"  {r['us_a_call']:9.1f} us  {r['count_a_call']:6.1f}x  max {r['longest_us']:8.1f} us  "
                f"{r['where'][:28]:28s}  {r['name'][:70]}")
    total = sum(r["bytes"] for r in out["entry_work"])
    log(f"the program's work outside its loops: {len(out['entry_work'])} ops writing {total / 1e6:.1f} MB; largest:")
    for r in out["entry_work"][:20]:
        log(f"  {r['bytes'] / 1e6:10.2f} MB  {r['opcode']:12s} {r['name'][:40]:40s} <- {', '.join(r['operands'])[:80]}")
    return out


def self_time_events(events: list[dict]) -> list[dict]:
    """Each host event with its self time (its duration less that of the events nested in it on its line)."""
    out = []
    for line in {e["line"] for e in events}:
        stack: list[dict] = []
        for e in sorted((e for e in events if e["line"] == line), key=lambda e: (e["start_ns"], -e["duration_ns"])):
            row = dict(e, end_ns=e["start_ns"] + e["duration_ns"], self_ns=float(e["duration_ns"]))
            while stack and stack[-1]["end_ns"] <= row["start_ns"]:
                stack.pop()
            if stack:
                stack[-1]["self_ns"] -= min(row["duration_ns"], stack[-1]["end_ns"] - row["start_ns"])
            stack.append(row)
            out.append(row)
    return out


def trace_calls(start, run, calls_expected: int, log, min_gap_us: float = 200.0) -> dict:
    """One generation of `run` (`calls_same`) under the profiler: the device's idle gaps of >= `min_gap_us` (the
    calls' boundaries) and, within them, the host's self time by event name, a gap."""
    from bench.labs.step_profile import _traced, host_events, idle_gaps, kernel_events

    state = jax.block_until_ready(start())
    (host, kernels), wall_ms = _traced(lambda: run(state)[0].generated,
                                       lambda path: (host_events(path, min_us=0.0), kernel_events(path)))
    ordered = sorted(kernels, key=lambda e: e["start_ns"])
    gaps = []
    for g in idle_gaps(kernels, min_us=min_gap_us):
        after = ordered[g["kernel_index"]]["start_ns"]
        gaps.append((after - g["us"] * 1e3, after))
    by_name: dict = {}
    for e in self_time_events(host):
        for lo, hi in gaps:
            overlap = min(e["end_ns"], hi) - max(e["start_ns"], lo)
            if overlap > 0 and e["duration_ns"] > 0:
                key = (e["name"], e["line"])
                by_name[key] = by_name.get(key, 0.0) + e["self_ns"] * overlap / e["duration_ns"]
    n = max(len(gaps), 1)
    rows = [dict(name=k[0], line=k[1], us_a_gap=v / 1e3 / n) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])]
    gap_us = [(hi - lo) / 1e3 for lo, hi in gaps]
    out = dict(wall_ms=wall_ms, calls=calls_expected, gaps=len(gaps), gap_us=gap_us,
               gap_us_median=statistics.median(gap_us) if gap_us else None, host_in_gaps=rows[:40])
    log(f"traced one calls_same generation: {wall_ms:.2f} ms, {len(gaps)} device gaps of >= {min_gap_us:.0f} us "
        f"(median {out['gap_us_median']} us; {calls_expected} calls); the host's self time in them, a gap:")
    for r in rows[:30]:
        log(f"  {r['us_a_gap']:9.1f} us  {r['line'][:28]:28s}  {r['name'][:80]}")
    return out


def measure(start, runs: dict, rounds: int, log) -> dict:
    """Per variant: decode ms of each round (interleaved; one warm-up round first), calls, host ms per call, cycles."""
    got = {name: dict(ms=[], calls=None, host_ms=[], cycles=None, tokens=None) for name in runs}
    for r in range(rounds + 1):
        for name, run in runs.items():
            state = start()
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            out, calls, host_s = run(state)
            jax.block_until_ready(out.generated)
            seconds = time.perf_counter() - t0
            if r:
                got[name]["ms"].append(1e3 * seconds)
                got[name]["host_ms"].append(1e3 * host_s)
            got[name].update(calls=calls, cycles=int(out.cycles), tokens=int(np.asarray(out.generated).sum()))
        if r:
            log(f"round {r}: " + ", ".join(f"{n} {got[n]['ms'][-1]:.2f}" for n in runs))
    return got


def summary(got: dict) -> dict:
    one = statistics.median(got["calls_1"]["ms"])
    rows = {}
    for name, g in got.items():
        med = statistics.median(g["ms"])
        extra = (med - one) / (g["calls"] - 1) if g["calls"] > 1 else None
        rows[name] = dict(median_ms=med, min_ms=min(g["ms"]), max_ms=max(g["ms"]), calls=g["calls"],
                          cycles=g["cycles"], tokens=g["tokens"], per_extra_call_ms=extra,
                          host_ms_per_call=statistics.median(g["host_ms"]) if any(g["host_ms"]) else None)
    return rows


def markdown(result: dict) -> str:
    lines = [f"# One more call of a fixed-K loop: {result['device']}, jax {result['jax']}, {result['date']}", "",
             f"Kimi-K2.5 dims, {result['layers']} layers ({result['moe_layers']} MoE layers)"
             f"{' (tiny)' if result['tiny'] else ''}, chained target, controllable drafter at a = "
             f"{result['acceptance']}, K = {result['k']}, {result['max_new_tokens']} new tokens, "
             f"{result['cycles_per_call']} cycles a call where split; median of {result['rounds']} interleaved "
             "rounds after a warm-up (bench/labs/call_price.py).", "",
             "| variant | decode ms | min-max | calls | cycles | one more call ms | host ms a call (queued: dispatch; "
             "read one by one: the read) |",
             "|---|---|---|---|---|---|---|"]
    for name, r in result["rows"].items():
        extra = "-" if r["per_extra_call_ms"] is None else f"{r['per_extra_call_ms']:.3f}"
        host = "-" if r["host_ms_per_call"] is None else f"{r['host_ms_per_call']:.3f}"
        lines.append(f"| {name} | {r['median_ms']:.3f} | {r['min_ms']:.3f}-{r['max_ms']:.3f} | {r['calls']} | "
                     f"{r['cycles']} | {extra} | {host} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.labs.call_price", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--moe-layers", choices=("distinct", "repeated"), default="distinct")
    p.add_argument("--tiny", action="store_true", help="small dims (CPU smoke run)")
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--acceptance", type=float, default=0.8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--cycles-per-call", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--trace-empty", type=int, default=0, help="this many empty calls traced (host events); 0: none")
    p.add_argument("--trace-calls", action="store_true",
                   help="trace one calls_same generation: the host's self time in the device's gaps between calls")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.layers < 3:
        p.error("--layers must be >= 3 (the draft taps three distinct target layers)")
    if a.k < 1 or a.cycles_per_call < 1 or a.rounds < 1 or a.max_new_tokens < 2:
        p.error("--k, --cycles-per-call, --rounds must be >= 1 and --max-new-tokens >= 2")
    if not 0.0 <= a.acceptance <= 1.0:
        p.error("--acceptance must lie in [0, 1]")
    return a


def main(argv=None):
    args = parse_args(argv)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    stamp = run_stamp()
    start, runs, call_k = build(args, log)
    got = measure(start, runs, args.rounds, log)
    traced = trace_empty(start, runs["empty"], call_k, args.trace_empty, log) if args.trace_empty else None
    traced_calls = (trace_calls(start, runs["calls_same"], got["calls_same"]["calls"], log) if args.trace_calls
                    else None)
    result = dict(**stamp.fields, layers=args.layers, moe_layers=args.moe_layers, tiny=args.tiny, k=args.k,
                  acceptance=args.acceptance, max_new_tokens=args.max_new_tokens,
                  cycles_per_call=args.cycles_per_call, rounds=args.rounds, raw=got, rows=summary(got),
                  empty_call_host_events=traced, calls_traced=traced_calls)
    stem = f"call-price-{stamp.suffix}"
    publish(result, Path(args.out), stem, markdown, log)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
