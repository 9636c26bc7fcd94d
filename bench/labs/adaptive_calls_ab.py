"""`python -m bench.labs.adaptive_calls_ab`: where adaptive speculation by call spends time beyond the fixed-K loop,
on the embedded pair, one prompt, interleaved rounds in one process.

Variants (each `Engine.generate` of --max-new-tokens, greedy):
- `fixed`: the fixed-K engine (K = --k), one call of its device loop;
- `calls_one_k`: adaptive by call with the set {K} alone, so its loop never leaves (one call, the leaving test still
  evaluated every cycle): the per-call program and host against the fixed loop;
- `calls`: adaptive by call with the default set 0..K (what `generate` runs on a GPU);
- `loop_fixed` and `loop_leaving`: the two device loops alone on copies of one prefilled state (no host work around
  them): the fixed-K loop with no output beyond its state, and `jaxspec.adaptive_calls.spec_loop` never leaving (its
  test still evaluated every cycle), so their difference is the leaving test's own cost; `loop_progress` (the fixed
  loop with its progress written to the host's memory, as the fixed engine runs it), `loop_summary` (the fixed loop,
  then the call's summary with the rule array read once) and `loop_limit` (a predicate that tests only the rule's
  limit of cycles) split that difference between what a call adds once and what its predicate adds a cycle;
  `loop_fresh` (the window's leaving column read as the cycle starts, its own column from what it accepted) and
  `loop_stale` (the test judged on the cycles before, as the cycle starts) are candidates beside it;
  `--trace-loops` traces one call of each of `TRACED_LOOPS` (kernels a cycle, a count per HLO op), `--hlo` writes
  their optimised HLO and the engines' programs' (below) under --out/hlo/;
- `program_fixed` and `program_calls`: the engines' own ahead-of-time compiled loops (the fixed engine's and the
  per-call engine's K loop, never leaving) called alone the same way, so the engines' host work around their loops
  is what separates these from `fixed` and `calls_one_k`;
- `loop_call_mean` and `loop_decayed`: `spec_loop_call_mean` and `spec_loop_decayed`, leaving tests not taken (their
  docstrings say why), beside `loop_leaving`.
Per variant: the median and spread of decode ms over --rounds after a warm-up, cycles and calls. `--trace`: one
`generate` of `fixed`, `calls_one_k` and `calls` each under jax.profiler (after the rounds): the device's kernels,
busy and span, and its idle stretches of >= 20 us with the kernels on either side (where a by-call generation's
time beyond the fixed one's goes: device work or host gaps). Writes adaptive-calls-ab-<device>-<date>.json and .md
to --out.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import statistics
import sys
from pathlib import Path

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.adaptive_prompts import PROMPTS, encode, load_pair
from bench.report import publish, run_stamp
from jaxspec.adaptive_calls import (RULE_HIGH, RULE_LIMIT, RULE_LOW, RULE_MIN_CYCLES, PerCallPolicy, call_summary,
                                    spec_loop, window_column, window_test)
from jaxspec.adaptive_calls_run import NO_LIMIT, _programs, never_leaving
from jaxspec.engine import Engine
from jaxspec.sampling import SamplingParams
from jaxspec.spec_step import speculative_cycle, speculative_cycle_accepting
from jaxspec.state import loop_with_progress


TRACED_LOOPS = ("loop_progress", "loop_leaving", "loop_fresh", "loop_stale")


def engine_programs(engine: Engine, calls_engine: Engine, state, max_new: int, k: int) -> dict:
    """The fixed engine's compiled loop and the per-call engine's K loop, as `Engine.generate` compiled them."""
    greedy = SamplingParams()
    sp = greedy.validate().as_arrays()
    loop = loop_with_progress(engine._step_fn(True, True, max_new))  # as `Engine.generate` builds it
    fixed = engine._compile("loop_spec", loop, {}, (engine.weights, state, sp), (1,), (True, max_new))[0]
    calls = _programs(calls_engine, state, sp, True, max_new, False)[0][k]
    runs = {"program_fixed": lambda s: fixed(engine.weights, s, sp)[0],
            "program_calls": lambda s: calls(calls_engine.weights, s, sp, never_leaving(NO_LIMIT))[0]}
    runs["program_fixed"].program, runs["program_calls"].program = fixed, calls  # for `loops_alone`'s HLO
    return runs


def traced_generate(engine: Engine, prompt, max_new: int) -> dict:
    """One `generate` (already warm) under jax.profiler: its kernels, busy and span, and idle gaps."""
    from bench.labs.step_profile import _traced, busy_ns, idle_gaps, kernel_events

    got = {}

    def run():
        got["res"] = engine.generate([prompt], max_new)
        return got["res"].tokens and jnp.zeros(())

    events, wall_ms = _traced(run, kernel_events)
    if not events:
        raise RuntimeError("the trace holds no kernel events")
    first = min(e["start_ns"] for e in events)
    last = max(e["start_ns"] + e["duration_ns"] for e in events)
    gaps = idle_gaps(events)
    return dict(wall_ms=wall_ms, decode_ms=1e3 * got["res"].decode_s, kernels=len(events),
                busy_ms=busy_ns(events) / 1e6, span_ms=(last - first) / 1e6, gaps_over_20us=len(gaps),
                gaps_ms=sum(g["us"] for g in gaps) / 1e3, longest_gaps=sorted(gaps, key=lambda g: -g["us"])[:8])


def spec_loop_decayed(w, state, sp, rule_F, *, cfg, k, window, greedy, max_new_tokens, drafter=None):
    """A candidate not taken: `spec_loop` whose test reads a decayed mean (each cycle keeps 1 - 1 / window of its
    weight at the next) of the drafts the cycle itself returns, instead of the window's sum kept by reading two
    columns of the log. Cheaper by a little on the embedded pair, but its geometric tail reacts to a fall in
    acceptance much later than a window does."""
    start, kept = state.cycles, 1.0 - 1.0 / window

    def go(s, total, seen):
        ran_f = (s.cycles - start).astype(jnp.float32)
        mean = total / jnp.maximum(seen, 1e-6)
        inside = (mean >= rule_F[RULE_LOW]) & (mean <= rule_F[RULE_HIGH])
        return jnp.any(~s.done) & (ran_f < rule_F[RULE_LIMIT]) & ((ran_f < rule_F[RULE_MIN_CYCLES]) | inside)

    def cycle(carry):
        s, total, seen, _ = carry
        live_B = ~s.done
        out = speculative_cycle_accepting(w, s, sp, cfg=cfg, k=k, greedy=greedy, max_new_tokens=max_new_tokens,
                                          drafter=drafter)
        total = kept * total + jnp.sum(jnp.where(live_B, out.accepted, 0)).astype(jnp.float32)
        seen = kept * seen + jnp.sum(live_B).astype(jnp.float32)
        return out.state, total, seen, go(out.state, total, seen)

    zero = jnp.zeros((), jnp.float32)
    return jax.lax.while_loop(lambda carry: carry[3], cycle, (state, zero, zero, go(state, zero, zero)))[0]


def spec_loop_fresh(w, state, sp, rule_F, *, cfg, k, window, greedy, max_new_tokens, drafter=None):
    """A candidate: `spec_loop`'s test with the column leaving the window read from the log as the cycle starts
    (which no kernel of the cycle waits for) and the cycle's own column taken from what it accepted, not from the log
    it has just written, so what follows the cycle's last kernel is a few scalar operations on its outputs. It leaves
    where `spec_loop` does."""
    start = state.cycles
    n_log = state.accepted_log.shape[1]

    def go(s, total, seen):
        return window_test(s, total, seen, start, rule_F)

    def cycle(carry):
        s, total, seen, _ = carry
        c = s.cycles
        old_total, old_seen = window_column(s.accepted_log, c - window, start)  # from the log as the cycle starts
        logged_B = ~s.done & (c < n_log)  # the cycle logs column c for its live rows (`commit`)
        out = speculative_cycle_accepting(w, s, sp, cfg=cfg, k=k, greedy=greedy, max_new_tokens=max_new_tokens,
                                          drafter=drafter)
        total = total + jnp.sum(jnp.where(logged_B, out.accepted, 0)).astype(jnp.float32) - old_total
        seen = seen + jnp.sum(logged_B).astype(jnp.float32) - old_seen
        return out.state, total, seen, go(out.state, total, seen)

    zero = jnp.zeros((), jnp.float32)
    state = jax.lax.while_loop(lambda carry: carry[3], cycle, (state, zero, zero, go(state, zero, zero)))[0]
    return state, call_summary(state)


def spec_loop_stale(w, state, sp, rule_F, *, cfg, k, window, greedy, max_new_tokens, drafter=None):
    """A candidate: the window's test judged on the cycles before this one, computed as the cycle starts (so beside
    it), and only `any live` taken after it. It leaves one cycle later than `spec_loop` would."""
    start = state.cycles

    def column(log_BC, c):
        return window_column(log_BC, c, start)

    def cycle(carry):
        s, total, seen, _ = carry
        c = s.cycles
        new_total, new_seen = column(s.accepted_log, c - 1)  # the cycles before this one, from the log as it is
        old_total, old_seen = column(s.accepted_log, c - 1 - window)
        total, seen = total + new_total - old_total, seen + new_seen - old_seen
        ran_f = (c - start).astype(jnp.float32)
        mean = total / jnp.maximum(seen, 1.0)
        inside = (mean >= rule_F[RULE_LOW]) & (mean <= rule_F[RULE_HIGH])
        keep = (ran_f + 1 < rule_F[RULE_LIMIT]) & ((ran_f < rule_F[RULE_MIN_CYCLES]) | inside)
        s = speculative_cycle(w, s, sp, cfg=cfg, k=k, greedy=greedy, max_new_tokens=max_new_tokens, drafter=drafter)
        return s, total, seen, jnp.any(~s.done) & keep

    zero = jnp.zeros((), jnp.float32)
    go0 = jnp.any(~state.done) & (rule_F[RULE_LIMIT] > 0)
    state = jax.lax.while_loop(lambda carry: carry[3], cycle, (state, zero, zero, go0))[0]
    return state, call_summary(state)


def spec_loop_call_mean(w, state, sp, rule_F, *, cfg, k, greedy, max_new_tokens, drafter=None):
    """A candidate not taken: `spec_loop` whose test is the loop's predicate itself, computed from the state (a row
    live now ran every cycle of the call and emitted its accepted drafts plus one a cycle, so the live rows' tokens
    since the call's start give the mean accepted over the whole call), with nothing in the carry. Traced, it adds
    next to no kernel a cycle, but it ran no faster than the carried window on the embedded pair, and a mean over
    the whole call answers a change of acceptance later (calls would need a bound on their cycles)."""
    start, generated0_B = state.cycles, state.generated

    def go(s):
        ran_f = (s.cycles - start).astype(jnp.float32)
        live_B = ~s.done
        emitted = jnp.sum(jnp.where(live_B, s.generated - generated0_B, 0)).astype(jnp.float32)
        mean = emitted / jnp.maximum(ran_f * jnp.sum(live_B).astype(jnp.float32), 1.0) - 1.0
        inside = (mean >= rule_F[RULE_LOW]) & (mean <= rule_F[RULE_HIGH])
        return jnp.any(live_B) & (ran_f < rule_F[RULE_LIMIT]) & ((ran_f < rule_F[RULE_MIN_CYCLES]) | inside)

    cycle = lambda s: speculative_cycle(w, s, sp, cfg=cfg, k=k, greedy=greedy,  # noqa: E731
                                        max_new_tokens=max_new_tokens, drafter=drafter)
    state = jax.lax.while_loop(go, cycle, state)
    return state, call_summary(state)


def loops_alone(engine: Engine, calls_engine: Engine, prompt, max_new: int, k: int, rounds: int,
                trace=(), hlo_dir: Path | None = None) -> dict:
    """ms of the fixed-K loop and of spec_loop never leaving, each on a fresh copy of one prefilled state; the loops
    named in `trace` are then traced once each (their kernels a cycle, and a count per HLO op). `hlo_dir`: the
    optimised HLO of the traced loops and of the two engines' programs, gzipped, written there."""
    greedy = SamplingParams()
    state = engine._prefill([prompt], max_new, greedy, 0, True)[0]
    kw = dict(cfg=engine.cfg, k=k, greedy=True, max_new_tokens=max_new)
    cycle = functools.partial(speculative_cycle, **kw)
    fixed = jax.jit(lambda w, s: jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: cycle(w, s, {}), s),
                    donate_argnums=1)
    leaving = jax.jit(lambda w, s, r: spec_loop(w, s, {}, r, window=32, **kw), donate_argnums=1)
    call_mean = jax.jit(lambda w, s, r: spec_loop_call_mean(w, s, {}, r, **kw), donate_argnums=1)
    decayed = jax.jit(lambda w, s, r: spec_loop_decayed(w, s, {}, r, window=32, **kw), donate_argnums=1)
    fresh = jax.jit(lambda w, s, r: spec_loop_fresh(w, s, {}, r, window=32, **kw), donate_argnums=1)
    stale = jax.jit(lambda w, s, r: spec_loop_stale(w, s, {}, r, window=32, **kw), donate_argnums=1)
    # the fixed engine's loop: its progress written to the host's memory
    progress_out = jax.jit(lambda w, s: loop_with_progress(cycle)(w, s, {}), donate_argnums=1)
    start_cycles = state.cycles

    def fixed_then_summary(w, s, r):  # the fixed loop, the rule read once after it: what a call's output adds
        s = jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: cycle(w, s, {}), s)
        return s, call_summary(s), r + 0  # the rule read once, beside the summary

    def limit_only(w, s, r):  # a predicate that reads the cycles and the rule's limit, not the band
        go = lambda s: jnp.any(~s.done) & ((s.cycles - start_cycles).astype(jnp.float32) < r[RULE_LIMIT])  # noqa: E731
        s = jax.lax.while_loop(go, lambda s: cycle(w, s, {}), s)
        return s, call_summary(s)

    summary = jax.jit(fixed_then_summary, donate_argnums=1)
    limited = jax.jit(limit_only, donate_argnums=1)
    runs = {"loop_fixed": lambda s: fixed(engine.weights, s),
            "loop_summary": lambda s: summary(engine.weights, s, never_leaving(NO_LIMIT))[0],
            "loop_limit": lambda s: limited(engine.weights, s, never_leaving(NO_LIMIT))[0],
            "loop_leaving": lambda s: leaving(engine.weights, s, never_leaving(NO_LIMIT))[0],
            "loop_call_mean": lambda s: call_mean(engine.weights, s, never_leaving(NO_LIMIT))[0],
            "loop_decayed": lambda s: decayed(engine.weights, s, never_leaving(NO_LIMIT)),
            "loop_progress": lambda s: progress_out(engine.weights, s)[0],
            "loop_fresh": lambda s: fresh(engine.weights, s, never_leaving(NO_LIMIT))[0],
            "loop_stale": lambda s: stale(engine.weights, s, never_leaving(NO_LIMIT))[0]}
    programs = engine_programs(engine, calls_engine, state, max_new, k)
    runs.update(programs)
    if hlo_dir is not None:
        rule = never_leaving(NO_LIMIT)
        jitted = {"loop_progress": (progress_out, (engine.weights, state)),
                  "loop_leaving": (leaving, (engine.weights, state, rule)),
                  "loop_fresh": (fresh, (engine.weights, state, rule)),
                  "loop_stale": (stale, (engine.weights, state, rule))}
        texts = {name: fn.lower(*args).compile().as_text() for name, (fn, args) in jitted.items()}
        texts.update((name, run.program.as_text()) for name, run in programs.items())
        hlo_dir.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            with gzip.open(hlo_dir / f"{name}.hlo.txt.gz", "wt") as f:
                f.write(text)
    times = {name: [] for name in runs}
    for r in range(rounds + 1):
        for name, run in (runs.items() if r % 2 == 0 else reversed(runs.items())):
            copy = jax.tree.map(jnp.copy, state)
            jax.block_until_ready(copy)
            t0 = time.perf_counter()
            out = run(copy)
            jax.block_until_ready(out.generated)
            if r:  # the first round compiles and warms up
                times[name].append(1e3 * (time.perf_counter() - t0))
    cycles = int(np.asarray(out.cycles))
    rows = {name: dict(decode_ms=statistics.median(ts), min_ms=min(ts), max_ms=max(ts), cycles=cycles, calls=1,
                       k_histogram={str(k): cycles}) for name, ts in times.items()}
    if trace:
        from bench.labs.step_profile import _traced, kernel_events

        for name in trace:
            events, _ = _traced(lambda: runs[name](jax.tree.map(jnp.copy, state)).generated, kernel_events)
            names = collections.Counter(e["hlo_op"] for e in events)
            rows[name]["trace"] = dict(kernels=len(events), kernels_per_cycle=len(events) / cycles,
                                       busy_us_per_cycle=sum(e["duration_ns"] for e in events) / 1e3 / cycles,
                                       by_op=dict(names.most_common()))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.adaptive_calls_ab", description=__doc__.split("\n")[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prompt", type=int, default=0, help=f"index into bench.adaptive_prompts' {len(PROMPTS)} prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--trace", action="store_true", help="trace one generate of each engine (see above)")
    p.add_argument("--trace-loops", action="store_true",
                   help=f"trace one call of {', '.join(TRACED_LOOPS)} (kernels a cycle, per HLO op)")
    p.add_argument("--hlo", action="store_true",
                   help="write the optimised HLO of the traced loops and the engines' programs under --out/hlo/")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    cfg, w, tok = load_pair(jnp.dtype(args.dtype))
    prompt = encode(tok, PROMPTS[args.prompt][1])
    engines = {"fixed": Engine(cfg, w, num_steps=args.k),
               "calls_one_k": Engine(cfg, w, num_steps=args.k, adaptive=PerCallPolicy(steps=(args.k,))),
               "calls": Engine(cfg, w, num_steps=args.k, adaptive=PerCallPolicy())}
    for eng in engines.values():
        eng.generate([prompt], args.max_new_tokens)  # compile, measure the cost table, warm up
    times = {name: [] for name in engines}
    last = {}
    for r in range(args.rounds):
        names = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in names:
            last[name] = engines[name].generate([prompt], args.max_new_tokens)
            times[name].append(1e3 * last[name].decode_s)
    rows = {}
    for name, ts in times.items():
        res = last[name]
        rows[name] = dict(decode_ms=statistics.median(ts), min_ms=min(ts), max_ms=max(ts), cycles=res.cycles,
                          calls=None if res.adaptive is None else res.adaptive.calls,
                          k_histogram=None if res.adaptive is None else
                          {str(k): n for k, n in res.adaptive.k_histogram.items()})
        log(f"{name}: {rows[name]['decode_ms']:.3f} ms ({min(ts):.3f}-{max(ts):.3f}), {res.cycles} cycles, "
            f"calls {rows[name]['calls']}, K {rows[name]['k_histogram']}")
    rows.update(loops_alone(engines["fixed"], engines["calls_one_k"], prompt, args.max_new_tokens, args.k,
                            args.rounds, TRACED_LOOPS if args.trace_loops else (),
                            Path(args.out) / "hlo" if args.hlo else None))
    for name, r in rows.items():
        if name.startswith(("loop_", "program_")):
            log(f"{name}: {r['decode_ms']:.3f} ms ({r['min_ms']:.3f}-{r['max_ms']:.3f}), {r['cycles']} cycles"
                + (f"; traced: {r['trace']['kernels_per_cycle']:.2f} kernels a cycle, "
                   f"{r['trace']['busy_us_per_cycle']:.2f} us busy" if "trace" in r else ""))
    traces = {}
    if args.trace:
        for name in ("fixed", "calls_one_k", "calls"):
            traces[name] = traced_generate(engines[name], prompt, args.max_new_tokens)
            t = traces[name]
            log(f"trace {name}: wall {t['wall_ms']:.3f} ms (decode {t['decode_ms']:.3f}), {t['kernels']} kernels, "
                f"busy {t['busy_ms']:.3f} ms, span {t['span_ms']:.3f} ms, {t['gaps_over_20us']} gaps >= 20 us "
                f"({t['gaps_ms']:.3f} ms): " + "; ".join(f"{g['us']:.0f} us before {g['after'][:40]}"
                                                        for g in t["longest_gaps"][:5]))
    stamp = run_stamp()
    result = dict(**stamp.fields, k=args.k,
                  prompt=PROMPTS[args.prompt][1], max_new_tokens=args.max_new_tokens, rounds=args.rounds,
                  dtype=args.dtype, rows=rows, traces=traces)

    def markdown(res):
        lines = [f"# Adaptive by call against fixed K: {res['device']}, {res['date']}", "",
                 f"Embedded pair ({res['dtype']}), prompt {res['prompt'][:24]!r}, {res['max_new_tokens']} tokens, "
                 f"K = {res['k']}, median of {res['rounds']} interleaved rounds.", "",
                 "| variant | decode ms | min-max | cycles | calls | K histogram |", "|---|---|---|---|---|---|"]
        for name, r in res["rows"].items():
            lines.append(f"| {name} | {r['decode_ms']:.3f} | {r['min_ms']:.3f}-{r['max_ms']:.3f} | {r['cycles']} | "
                         f"{r['calls']} | {r['k_histogram']} |")
        if res["traces"]:
            lines += ["", "One traced generate each (prefill included): ms.", "",
                      "| engine | wall | decode | kernels | device busy | device span | gaps >= 20 us | longest gaps |",
                      "|---|---|---|---|---|---|---|---|"]
            for name, t in res["traces"].items():
                gaps = "; ".join(f"{g['us']:.0f} us before `{g['after'][:32]}`" for g in t["longest_gaps"][:4])
                lines.append(f"| {name} | {t['wall_ms']:.3f} | {t['decode_ms']:.3f} | {t['kernels']} | "
                             f"{t['busy_ms']:.3f} | {t['span_ms']:.3f} | {t['gaps_over_20us']} ({t['gaps_ms']:.3f}) | "
                             f"{gaps} |")
        return "\n".join(lines) + "\n"

    publish(result, Path(args.out), f"adaptive-calls-ab-{stamp.suffix}", markdown, log)


if __name__ == "__main__":
    main(sys.argv[1:])
