"""`python -m bench.labs.call_price`: what one more device call of a fixed-K loop costs, and where (issue 53).

Adaptive speculation by call changes K between calls of fixed-K loops, and its cost table prices one more call at
its intercept (1.9 ms on the embedded pair, 4.4 ms at 4 layers, 7.1 ms at 61 on an H200), yet generations that made
one call more lost more than that. This lab splits a generation into calls on a K2.5-shaped model (chained target,
bench.adaptive_acceptance's controllable drafter at --acceptance) and times, per variant, the decode of
--max-new-tokens after a prefill that is not timed (median of --rounds interleaved rounds after a warm-up):

- `fixed`: the fixed-K loop (`~all(done)` its predicate) in one call, as the fixed engine runs it;
- `calls_1`: adaptive by call's K loop (`jaxspec.adaptive_calls.spec_loop`) never leaving, one call;
- `calls_same`: the same executable, --cycles-per-call cycles a call, the host reading `done` after each (`drive`'s
  round trip), until the batch is done;
- `calls_queued`: the same calls queued without reading anything between them (enough of them for the whole
  generation; the surplus ones run no cycle), so the host's round trip is not in it;
- `calls_twin`: as `calls_same`, alternating between two executables of the same loop compiled apart, so each call
  is an executable's first run in the generation (what a change of K pays beyond a call);
- `empty`: one call that runs no cycle (the loop's entry and its first predicate alone).

Per variant: the median and spread of decode ms and the calls made; the price of one more call is
(variant - calls_1) / (calls - 1). The host's own time per call (dispatch until the call returns, not synchronised)
is reported for the queued calls. Writes call-price-<device>-<date>.json and .md to --out.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
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
from jaxspec.adaptive_calls import PerCallPolicy  # noqa: E402
from jaxspec.adaptive_calls_run import NO_LIMIT, never_leaving  # noqa: E402
from jaxspec.prefill import prompt_bucket  # noqa: E402
from jaxspec.sharded import compile_programs  # noqa: E402
from model.kv_cache import round_capacity  # noqa: E402

VARIANTS = ("fixed", "calls_1", "calls_same", "calls_queued", "calls_twin", "empty")


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
    rule = jax.ShapeDtypeStruct((4,), jnp.float32)
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

    def calls(programs_):
        def run(s):
            n = 0
            while True:
                s = programs_[n % len(programs_)](sw, s, never_leaving(per_call), a, cont_BS)[0]
                n += 1
                if bool(jax.device_get(jnp.all(s.done))):
                    return s, n, 0.0
        return run

    def queued(s):
        host = 0.0
        n = -(-args.max_new_tokens // per_call)  # a cycle emits at least one token a row: this many always finish
        for _ in range(n):
            t0 = time.perf_counter()
            s = call_k(sw, s, never_leaving(per_call), a, cont_BS)[0]
            host += time.perf_counter() - t0
        return s, n, host / n

    runs = {"fixed": lambda s: (fixed_k(sw, s, a, cont_BS), 1, 0.0), "calls_1": one(call_k),
            "calls_same": calls([call_k]), "calls_queued": queued, "calls_twin": calls([call_k, twin_k]),
            "empty": lambda s: (call_k(sw, s, never_leaving(0), a, cont_BS)[0], 1, 0.0)}
    return (lambda: prefill(*prompt)), runs


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
                          host_ms_per_call=statistics.median(g["host_ms"]) if name == "calls_queued" else None)
    return rows


def markdown(result: dict) -> str:
    lines = [f"# One more call of a fixed-K loop: {result['device']}, jax {result['jax']}, {result['date']}", "",
             f"Kimi-K2.5 dims, {result['layers']} layers ({result['moe_layers']} MoE layers)"
             f"{' (tiny)' if result['tiny'] else ''}, chained target, controllable drafter at a = "
             f"{result['acceptance']}, K = {result['k']}, {result['max_new_tokens']} new tokens, "
             f"{result['cycles_per_call']} cycles a call where split; median of {result['rounds']} interleaved "
             "rounds after a warm-up (bench/labs/call_price.py).", "",
             "| variant | decode ms | min-max | calls | cycles | one more call ms | host ms a call (dispatch) |",
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
    start, runs = build(args, log)
    got = measure(start, runs, args.rounds, log)
    result = dict(**stamp.fields, layers=args.layers, moe_layers=args.moe_layers, tiny=args.tiny, k=args.k,
                  acceptance=args.acceptance, max_new_tokens=args.max_new_tokens,
                  cycles_per_call=args.cycles_per_call, rounds=args.rounds, raw=got, rows=summary(got))
    stem = f"call-price-{stamp.suffix}"
    publish(result, Path(args.out), stem, markdown, log)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
