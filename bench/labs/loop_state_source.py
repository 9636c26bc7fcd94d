"""`python -m bench.labs.loop_state_source`: does a device loop's time depend on where its state came from?

`bench.labs.adaptive_calls_ab` found the fixed-K engine's loop faster inside `Engine.generate` than the same compiled
program called alone on a copy of a prefilled state, and the by-call engine's loop as slow as the copy. This lab
times the two engines' K loops (the fixed engine's and the by-call engine's, never leaving), each on a state from:

- `prefill`: the prefill program's own output, just computed (what `Engine.generate` passes);
- `prefill_idle`: the same, then the host sleeps --idle-ms before the call (the device idle in between);
- `prefill_copy`: the same, then every leaf copied (`jnp.copy`, one launch a leaf) and the original dropped;
- `copy`: a copy of one state prefilled before the rounds (what `adaptive_calls_ab`'s `program_*` rows did);
- `copy_jit`: that state copied by one jitted program (one executable, as the prefill's outputs are);

and beside them the two engines' `generate` (their decode seconds); `calls/prefill_read`: the by-call loop on the
prefill's output followed by reading back its cycles, done, generated and log arrays (what `drive` read after a
call before `call_summary`); `calls/prefill_summary`: the same followed by the read of its summary; and `drive/prefill`:
`drive` itself on the prefill's output with the engine's loops, its first choice made before the prefill (as the
engine makes it while the device prefills), so what `generate` adds around `drive` is what separates it from
`engine_calls`. Embedded pair, one prompt, greedy, K = --k,
rounds interleaved with the order reversed every other round; per variant the median, min and max ms. Writes
loop-state-source-<device>-<date>.json and .md to --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.adaptive_prompts import PROMPTS, encode, load_pair
from bench.labs.adaptive_calls_ab import engine_programs
from bench.report import publish, run_stamp
from jaxspec.adaptive_calls import PerCallPolicy
from jaxspec.adaptive_calls_run import NO_LIMIT, _calls, _known_costs, _programs, drive, first_call, never_leaving
from jaxspec.engine import Engine
from jaxspec.sampling import SamplingParams

def _fresh(x):
    """x computed anew inside a program (returning x itself would forward the input buffer)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(jax.random.key_data(x) + 0, impl=jax.random.key_impl(x))
    return x + jnp.zeros((), x.dtype)


SOURCES = ("prefill", "prefill_idle", "prefill_copy", "copy", "copy_jit")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.loop_state_source", description=__doc__.split("\n")[0])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--prompt", type=int, default=3, help=f"index into bench.adaptive_prompts' {len(PROMPTS)} prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--idle-ms", type=float, default=5.0)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    cfg, w, tok = load_pair(jnp.dtype(args.dtype))
    prompt = encode(tok, PROMPTS[args.prompt][1])
    n = args.max_new_tokens
    fixed = Engine(cfg, w, num_steps=args.k)
    calls = Engine(cfg, w, num_steps=args.k, adaptive=PerCallPolicy(steps=(args.k,)))
    for eng in (fixed, calls):
        eng.generate([prompt], n)  # compile, measure the cost table, warm up

    def prefilled():
        return fixed._prefill([prompt], n, SamplingParams(), 0, True)[0]  # blocked until ready

    kept = prefilled()
    copy_all = jax.jit(lambda s: jax.tree.map(_fresh, s))

    def source(name):
        if name == "prefill":
            return prefilled()
        if name == "prefill_idle":
            s = prefilled()
            time.sleep(args.idle_ms / 1e3)
            return s
        if name == "prefill_copy":
            return jax.block_until_ready(jax.tree.map(jnp.copy, prefilled()))
        if name == "copy":
            return jax.block_until_ready(jax.tree.map(jnp.copy, kept))
        return jax.block_until_ready(copy_all(kept))

    programs = engine_programs(fixed, calls, kept, n, args.k)
    runs = {}
    for prog in ("program_fixed", "program_calls"):
        for src in SOURCES:
            runs[f"{prog.split('_')[1]}/{src}"] = (prog, src)
    sp = SamplingParams().validate().as_arrays()
    loops = _programs(calls, kept, sp, True, n, False)[0]
    policy = calls.adaptive
    steps, window, _ = policy.compiled(calls.k)

    def drive_once():
        run = _calls(calls, steps, window, True, *_known_costs(calls, kept, True, False)[:2])
        k, c_BJ, rule = first_call(run, policy, 1, n)
        first = (k, c_BJ, None if rule is None else jax.device_put(rule))
        s = prefilled()
        t0 = time.perf_counter()
        out = drive(s, lambda kk, st, r: loops[kk](calls.weights, st, sp, r),
                    lambda st: loops[0](calls.weights, st, sp, np.int32(NO_LIMIT)), run, policy, n, first)[0]
        jax.block_until_ready(out.generated)
        return time.perf_counter() - t0, out

    def read_once():
        s = prefilled()
        t0 = time.perf_counter()
        out = programs["program_calls"](s)
        jax.device_get((out.cycles, out.done, out.generated, out.accepted_log))
        jax.block_until_ready(out.generated)
        return time.perf_counter() - t0, out

    def summary_once():
        s = prefilled()
        t0 = time.perf_counter()
        out, summary = loops[args.k](calls.weights, s, sp, never_leaving(NO_LIMIT))
        jax.device_get(summary)
        jax.block_until_ready(out.generated)
        return time.perf_counter() - t0, out

    special = {"calls/prefill_read": read_once, "calls/prefill_summary": summary_once, "drive/prefill": drive_once}
    times = {name: [] for name in ["engine_fixed", "engine_calls", *runs, *special]}
    cycles = {}
    for r in range(args.rounds + 1):
        names = list(times) if r % 2 == 0 else list(reversed(times))
        for name in names:
            if name in special:
                seconds, out = special[name]()
                ms, cycles[name] = 1e3 * seconds, int(out.cycles)
            elif name.startswith("engine_"):
                res = (fixed if name == "engine_fixed" else calls).generate([prompt], n)
                ms, cycles[name] = 1e3 * res.decode_s, res.cycles
            else:
                prog, src = runs[name]
                s = source(src)
                t0 = time.perf_counter()
                out = programs[prog](s)
                jax.block_until_ready(out.generated)
                ms, cycles[name] = 1e3 * (time.perf_counter() - t0), int(out.cycles)
            if r:  # the first round warms every path up
                times[name].append(ms)
    rows = {name: dict(median_ms=statistics.median(ts), min_ms=min(ts), max_ms=max(ts), cycles=cycles[name])
            for name, ts in times.items()}
    for name, row in rows.items():
        log(f"{name}: {row['median_ms']:.3f} ms ({row['min_ms']:.3f}-{row['max_ms']:.3f}), {row['cycles']} cycles")
    stamp = run_stamp()
    result = dict(**stamp.fields, k=args.k, prompt=PROMPTS[args.prompt][1], max_new_tokens=n, rounds=args.rounds,
                  idle_ms=args.idle_ms, dtype=args.dtype, rows=rows)

    def markdown(res):
        lines = [f"# A device loop's time by the source of its state: {res['device']}, {res['date']}", "",
                 f"Embedded pair ({res['dtype']}), prompt {res['prompt'][:24]!r}, {res['max_new_tokens']} tokens, "
                 f"K = {res['k']}, median of {res['rounds']} interleaved rounds (idle {res['idle_ms']} ms).", "",
                 "| variant | ms | min-max | cycles |", "|---|---|---|---|"]
        lines += [f"| {name} | {r['median_ms']:.3f} | {r['min_ms']:.3f}-{r['max_ms']:.3f} | {r['cycles']} |"
                  for name, r in res["rows"].items()]
        return "\n".join(lines) + "\n"

    publish(result, Path(args.out), f"loop-state-source-{stamp.suffix}", markdown, log)


if __name__ == "__main__":
    main(sys.argv[1:])
