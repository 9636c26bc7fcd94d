"""`python -m bench.labs.engine_call_timeline`: where a by-call generation's decode spends the time beyond the
fixed-K engine's, at the same K in one call, phase by phase, on the embedded pair, interleaved rounds in one
process.

The fixed engine's and the by-call engine's compiled loops cost the same called alone (`bench.labs.adaptive_calls_ab`:
`program_fixed`, `program_calls`), yet in their engines the by-call decode runs ~2% longer on a 10 ms generation
(docs/performance.md, "Adaptive speculation by call"). Here each engine's decode is replayed with the engine's own
prefill and programs (`Engine._prefill`, `adaptive_calls_run._start`; the programs come from the engines' cache, so
they are the ones `generate` runs; the by-call decode is `adaptive_calls_run.drive` itself) and timed in phases:
- `dispatch`: the call of the loop's program until it returns (on a GPU that is after the loop has run: XLA runs
  a while loop's iterations from the host);
- `after`: from there until the decode returns: the read of what the host reads (the fixed engine's progress, the
  by-call `call_summary`) and, by call, the host's bookkeeping and its test of whether the batch is done.
The `_wait` variants wait for the loop's state before that, which splits off the device's remaining time (`device`),
so their `after` is the read and the host's work alone. The `_parts` variants (`parts_decode`) split one call of
each program finer, after waiting for the very array the host reads. `generate` rows time each engine's own
`Engine.generate` in the same rounds (`default_generate`: by call with the default K set 0..K, which `generate` runs
on a GPU, where `calls` has the set {K}), and `generate_gc_off` the same with Python's garbage collector off (its
passes run at allocation counts the host's bookkeeping moves). Per variant and phase: the median over --rounds after
a warm-up, and the spread of the total.
Writes engine-call-timeline-<device>-<date>.json and .md to --out.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.adaptive_prompts import PROMPTS, encode, load_pair
from bench.report import publish, run_stamp
from jaxspec import adaptive_calls_run as calls_run
from jaxspec.adaptive_calls import CallSummary, PerCallPolicy
from jaxspec.engine import Engine
from jaxspec.sampling import SamplingParams
from jaxspec.state import loop_with_progress

PHASES = ("dispatch", "device", "read", "tests", "drop", "after", "total")


def fixed_prefilled(engine: Engine, prompt, max_new: int):
    """(the prefilled state, the sampling arrays, the fixed engine's compiled loop) as `Engine.generate` has them."""
    greedy = SamplingParams()
    sp = greedy.validate().as_arrays()
    loop = loop_with_progress(engine._step_fn(True, True, max_new))  # the program key finds the one generate built
    spec = lambda state: ("loop_spec", loop, {}, (engine.weights, state, sp), (1,), (True, max_new))  # noqa: E731
    state, _, _, _, compiled = engine._prefill([prompt], max_new, greedy, 0, True, then=spec)
    return state, sp, compiled


def tokens_of(state) -> list[int]:
    """The first row's tokens of a decode's final state (read after its timing)."""
    generated, out_tokens = jax.device_get((state.generated, state.out_tokens))
    return out_tokens[0, :generated[0]].tolist()


def fixed_decode(engine: Engine, prompt, max_new: int, wait: bool) -> dict:
    """The fixed engine's decode as `Engine.generate` runs it (its cached programs), in phases (seconds), and the
    tokens it made."""
    state, sp, compiled = fixed_prefilled(engine, prompt, max_new)
    t0 = time.perf_counter()
    state, progress_read = compiled(engine.weights, state, sp)
    t1 = time.perf_counter()
    if wait:
        jax.block_until_ready(state.generated)
    t2 = time.perf_counter()
    progress_read = np.asarray(progress_read)  # where `Engine.generate`'s decode ends, the array read dropped
    t3 = time.perf_counter()
    return dict(dispatch=t1 - t0, device=t2 - t1, after=t3 - t2, total=t3 - t0, tokens=tokens_of(state))


def calls_decode(engine: Engine, prompt, max_new: int, wait: bool) -> dict:
    """The by-call engine's decode as `adaptive_calls_run.generate` runs it (its `_start` and `drive`), where the
    first call finishes the batch, in phases (seconds), and the tokens it made."""
    greedy = SamplingParams()
    state, sp, _, _, _, loops, run, _, first = calls_run._start(engine, [prompt], max_new, greedy, 0, False)
    if first is None:
        raise RuntimeError("the cost table is not known before the prefill: warm the engine up first")
    marks = {}

    def call_k(k, s, rule):
        out = loops[k](engine.weights, s, sp, rule)
        marks["dispatched"] = time.perf_counter()
        if wait:
            jax.block_until_ready(out[0].generated)
        marks["ready"] = time.perf_counter()
        return out

    def call_plain(s):
        raise RuntimeError("the first call went to plain decoding: this lab times one call at K")

    t0 = time.perf_counter()
    # the result kept, as `generate` keeps it: dropped here, the returned state's arrays would be freed in the timing
    state, *_ = calls_run.drive(state, call_k, call_plain, run, engine.adaptive, max_new, first)
    t1 = time.perf_counter()
    run.settle(engine.adaptive, None)  # after the timing, as `adaptive_calls_run.generate` does
    if run.calls != 1:
        raise RuntimeError(f"the generation ran {run.calls} calls: this lab times one-call generations")
    return dict(dispatch=marks["dispatched"] - t0, device=marks["ready"] - marks["dispatched"],
                after=t1 - marks["ready"], total=t1 - t0, tokens=tokens_of(state))


def parts_decode(engine: Engine, prompt, max_new: int, by_call: bool) -> dict:
    """One call of the engine's loop program (the fixed engine's, or the by-call K loop as its first call runs it)
    split finer: `dispatch` as above, `device` until the array the host reads is ready (its copy to host memory
    done), `read` the host's conversion of it to numpy, `tests` (by call) reading whether every row is done and
    whether a plain tail ran, as `drive` does after a generation's last call, `drop` releasing the array read;
    `after` = read + tests + drop."""
    greedy = SamplingParams()
    if by_call:
        state, sp, _, _, _, loops, run, _, first = calls_run._start(engine, [prompt], max_new, greedy, 0, False)
        program, rule = loops[first[0]], (first[2],)
        shape = state.accepted_log.shape
    else:
        (state, sp, program), rule = fixed_prefilled(engine, prompt, max_new), ()
    t0 = time.perf_counter()
    state, out = program(engine.weights, state, sp, *rule)
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    t2 = time.perf_counter()
    read = CallSummary(out, *shape) if by_call else np.asarray(out)
    t3 = time.perf_counter()
    if by_call and read.all_done and read.plain_steps:
        raise RuntimeError("a plain tail ran: this lab times calls at K to the end")
    t4 = time.perf_counter()
    del out  # the array read, dropped as the engines drop it before their decode ends
    t5 = time.perf_counter()
    return dict(dispatch=t1 - t0, device=t2 - t1, read=t3 - t2, tests=t4 - t3, drop=t5 - t4, after=t5 - t2,
                total=t5 - t0, tokens=tokens_of(state))


def generate_decode(engine: Engine, prompt, max_new: int, gc_off: bool) -> dict:
    was = gc.isenabled()
    if gc_off:
        gc.disable()
    try:
        res = engine.generate([prompt], max_new)
    finally:
        if was:
            gc.enable()
    return dict(total=res.decode_s)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.engine_call_timeline", description=__doc__.split("\n")[0])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--prompt", type=int, default=0, help=f"index into bench.adaptive_prompts' {len(PROMPTS)} prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if not 0 <= args.prompt < len(PROMPTS):
        p.error(f"--prompt must be in 0..{len(PROMPTS) - 1}")
    if args.k < 1 or args.rounds < 1 or args.max_new_tokens < 2:
        p.error("--k and --rounds must be >= 1 and --max-new-tokens >= 2")
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    cfg, w, tok = load_pair(jnp.dtype(args.dtype))
    prompt = encode(tok, PROMPTS[args.prompt][1])
    fixed = Engine(cfg, w, num_steps=args.k)
    calls = Engine(cfg, w, num_steps=args.k, adaptive=PerCallPolicy(steps=(args.k,)))
    default = Engine(cfg, w, num_steps=args.k, adaptive=PerCallPolicy())  # the default set, as generate runs it
    for eng in (fixed, calls, default):
        eng.generate([prompt], args.max_new_tokens)  # compile, measure the cost table, warm up
    n = args.max_new_tokens
    variants = {
        "fixed": lambda: fixed_decode(fixed, prompt, n, False),
        "calls": lambda: calls_decode(calls, prompt, n, False),
        "fixed_wait": lambda: fixed_decode(fixed, prompt, n, True),
        "calls_wait": lambda: calls_decode(calls, prompt, n, True),
        "fixed_parts": lambda: parts_decode(fixed, prompt, n, False),
        "calls_parts": lambda: parts_decode(calls, prompt, n, True),
        "fixed_generate": lambda: generate_decode(fixed, prompt, n, False),
        "calls_generate": lambda: generate_decode(calls, prompt, n, False),
        "default_generate": lambda: generate_decode(default, prompt, n, False),
        "fixed_generate_gc_off": lambda: generate_decode(fixed, prompt, n, True),
        "calls_generate_gc_off": lambda: generate_decode(calls, prompt, n, True),
    }
    times = {name: {ph: [] for ph in PHASES} for name in variants}
    for r in range(args.rounds + 1):
        for name, run in (variants.items() if r % 2 == 0 else reversed(variants.items())):
            got = run()
            if r:  # the first round warms every path up
                for ph in PHASES:
                    if ph in got:
                        times[name][ph].append(1e3 * got[ph])
    rows = {}
    for name, by_phase in times.items():
        rows[name] = {ph: statistics.median(v) for ph, v in by_phase.items() if v}
        rows[name]["total_range"] = [min(by_phase["total"]), max(by_phase["total"])]
        rows[name]["total_rounds"] = by_phase["total"]
    paired = {}
    for a, b in (("calls", "fixed"), ("calls_wait", "fixed_wait"), ("calls_parts", "fixed_parts"),
                 ("calls_generate", "fixed_generate"), ("default_generate", "fixed_generate"),
                 ("calls_generate_gc_off", "fixed_generate_gc_off")):
        paired[f"{a} - {b}"] = statistics.median(x - y for x, y in zip(times[a]["total"], times[b]["total"]))
    stamp = run_stamp()
    result = dict(**stamp.fields, k=args.k, prompt=PROMPTS[args.prompt][1], max_new_tokens=n, rounds=args.rounds,
                  dtype=args.dtype, rows=rows, paired_total_difference_ms=paired)

    def markdown(res):
        lines = [f"# By-call against fixed K, phase by phase: {res['device']}, {res['date']}", "",
                 f"Embedded pair ({res['dtype']}), prompt {res['prompt'][:24]!r}, {res['max_new_tokens']} tokens, "
                 f"K = {res['k']}, one call; ms, median of {res['rounds']} interleaved rounds.", "",
                 "| variant | " + " | ".join(PHASES) + " | total min-max |", "|---" * (len(PHASES) + 2) + "|"]
        for name, r in res["rows"].items():
            cells = " | ".join("-" if ph not in r else f"{r[ph]:.3f}" for ph in PHASES)
            lines.append(f"| {name} | {cells} | {r['total_range'][0]:.3f}-{r['total_range'][1]:.3f} |")
        lines += ["", "Paired by round (median of same-round differences of the total, ms):", ""]
        lines += [f"- {k}: {v:+.3f}" for k, v in res["paired_total_difference_ms"].items()]
        return "\n".join(lines) + "\n"

    publish(result, Path(args.out), f"engine-call-timeline-{stamp.suffix}", markdown, log)


if __name__ == "__main__":
    main(sys.argv[1:])
