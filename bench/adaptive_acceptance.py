"""`python -m bench.adaptive_acceptance`: tokens per second against draft acceptance a for each fixed K and for
adaptive speculation, on a Kimi-K2.5-shaped model of N layers (real dims, INT4 experts, random weights, a K2.5-shaped
one-layer EAGLE-3 draft), greedy, every cycle in the engine's on-device loop.

The controllable drafter: a random-weight draft is almost never accepted, so acceptance is set by hand. Each cycle
runs the EAGLE-3 draft chain as the engine does (its cost and its cache writes are real), then replaces draft j by the
target's true next token with probability a, independently per position, and otherwise keeps the draft's own
proposal (moved off the true token when it happens to hit it). The true tokens come from a precomputed greedy
continuation: the plain decoding run (K = 0) of the same prompts, read at the row's emitted-token count, so each
position's conditional acceptance is a and E[tokens | K] = 1 + a + ... + a^K. Plain decoding and a verify of K + 1
tokens may round differently in bf16; where a row's output leaves the continuation its later drafts are all
rejected, so the report gives the acceptance each run measured beside the a it asked for.

a and the continuation are arguments of the compiled loops (one program per K for every a). Adaptive runs with
the cost table measured on this device at start-up (`jaxspec.adaptive_costs.measure`) and `probe=False`: its
free probe would measure the random EAGLE-3 draft, not this drafter. Per a, plain decoding, each fixed K and
adaptive by call take turns in --repeats rounds after a warm-up round (the order rotating each round; --vary-seed: a
draw of the acceptances per round, the same for every engine of the round), each engine's median decode wall time,
and adaptive's rate over the others' paired by round; the per-cycle kind times each (K, a) alone. Writes
adaptive-acceptance-<device>-<date>.json, .md and .png (tokens/s against a) to --out.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.cycle import spec_pair  # noqa: E402
from bench.report import fmt, own_stem, publish, run_stamp  # noqa: E402
from bench.timing import paired_ratio  # noqa: E402
from bench.step import bench_config, draw_weights  # noqa: E402
from jaxspec.adaptive import AdaptivePolicy, adaptive_loop, forced_schedule, init_adaptive_state  # noqa: E402
from jaxspec.adaptive_calls import RULE_FIELDS, Pool, PerCallPolicy, plain_loop, spec_loop, to_plain  # noqa: E402
from jaxspec.adaptive_calls_run import NO_LIMIT, Calls, drive, first_call, never_leaving  # noqa: E402
from jaxspec.adaptive_costs import measure  # noqa: E402
from jaxspec.defaults import ADAPTIVE_KINDS, default_adaptive_kind  # noqa: E402
from jaxspec.baseline_step import baseline_step  # noqa: E402
from jaxspec.prefill import baseline_prefill, prompt_bucket, spec_prefill  # noqa: E402
from jaxspec.sharded import compile_programs  # noqa: E402
from jaxspec.spec_step import draft_chain, speculative_cycle  # noqa: E402
from model.kv_cache import round_capacity  # noqa: E402

ACCEPTANCE = (0.0, 0.2, 0.4, 0.6, 0.8, 0.95)
CHAIN_SCALE = 1024.0  # the embedding rows' rms under --target chained
INT32_MAX = np.iinfo(np.int32).max


def controlled_drafter(key, w, cfg, state, k, greedy, sp, *, rate, continuation_BS):
    """The EAGLE-3 chain's work, then draft j = the true next token with probability `rate`, else a wrong one."""
    drafts_BM, q, cache = draft_chain(key, w, cfg, state, k, greedy, sp)
    b, n = continuation_BS.shape
    index_BM = jnp.clip(state.generated[:, None] + jnp.arange(k)[None], 0, n - 1)
    truth_BM = jnp.take_along_axis(continuation_BS, index_BM, axis=1)
    wrong_BM = jnp.where(drafts_BM == truth_BM, (drafts_BM + 1) % cfg.target.vocab_size, drafts_BM)
    hit_BM = jax.random.uniform(jax.random.fold_in(key, 1), (b, k)) < rate
    return jnp.where(hit_BM, truth_BM, wrong_BM), q, cache


def chained_target(w, scale: float = CHAIN_SCALE):
    """The target `w` whose greedy next token is f(this token) at any depth and any rounding: f(t) = (7919 t + 17)
    mod V (a permutation: 7919 is a prime that divides no vocabulary size here). Each embedding row becomes its own
    direction at rms `scale`, and the lm_head row of f(t) that direction: the residual stream stays on the current
    token's direction, which the layers' own outputs (rms ~1 after their norms) barely move, so the logit of f(t)
    leads by a wide margin. Every layer still reads and computes what it did (the same shapes and kernels).

    Why: at depth a random target's argmax margins are small, plain decoding and a verify of K + 1 tokens round
    differently in bf16 and the continuation the controllable drafter copies stops being the target's."""
    v = w.embed.shape[0]
    emb = w.embed.astype(jnp.float32)
    unit = emb / jnp.sqrt(jnp.mean(emb * emb, axis=1, keepdims=True) + 1e-12)
    after = (7919 * jnp.arange(v, dtype=jnp.int32) + 17) % v  # < 2^31 for V below 271,000
    inverse = jnp.argsort(after)  # lm_head row f(t) = the direction of t
    dtype = w.embed.dtype
    return w.replace(embed=(scale * unit).astype(dtype), lm_head=(unit[inverse] / np.sqrt(unit.shape[1])).astype(dtype),
                     final_norm=jnp.ones_like(w.final_norm))


def chain_next(tokens, v: int):
    """f of `chained_target`, on the host."""
    return (7919 * np.asarray(tokens, np.int64) + 17) % v


def _until_done(step, state):
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, state)


def programs(spec_cfg, ks, steps, policy: AdaptivePolicy, max_new: int, capacity: int):
    """Jitted prefills and loops: plain decoding, fixed K (a, continuation as arguments), adaptive."""
    greedy_kw = dict(cfg=spec_cfg, greedy=True, max_new_tokens=max_new)
    base_prefill = jax.jit(functools.partial(baseline_prefill, capacity=capacity, **greedy_kw))
    spec_prefill_ = jax.jit(functools.partial(spec_prefill, capacity=capacity, k=max([*ks, *steps]),
                                              max_cycles=max_new, **greedy_kw))
    base_loop = jax.jit(lambda w, s: _until_done(lambda s: baseline_step(w, s, {}, **greedy_kw), s), donate_argnums=1)

    def fixed(k):
        def loop(w, s, rate, cont):
            drafter = functools.partial(controlled_drafter, rate=rate, continuation_BS=cont)
            return _until_done(lambda s: speculative_cycle(w, s, {}, k=k, drafter=drafter, **greedy_kw), s)
        return jax.jit(loop, donate_argnums=1)

    _, ema, explore_every, _, probe, stretch, hysteresis = policy.compiled(max(steps))

    def adaptive(w, s, rate, cont, limit):
        drafter = functools.partial(controlled_drafter, rate=rate, continuation_BS=cont)
        return adaptive_loop(w, s, {}, limit, steps=steps, ema=ema, explore_every=explore_every, stretch=stretch,
                             hysteresis=hysteresis, probe=probe, drafter=drafter, **greedy_kw)

    return base_prefill, spec_prefill_, base_loop, {k: fixed(k) for k in ks if k > 0}, jax.jit(adaptive,
                                                                                                 donate_argnums=1)


def per_call_programs(spec_cfg, steps, policy: PerCallPolicy, max_new: int):
    """Adaptive by call: one `spec_loop` per K >= 1 (a, continuation and the rule's inputs as arguments), the plain
    loop, and the loops of the K that may carry a plain tail with it (built where the measured table asks for them,
    `PerCallPolicy.built_tails`), as `jaxspec.adaptive_calls_run` compiles them for the engine."""
    greedy_kw = dict(cfg=spec_cfg, greedy=True, max_new_tokens=max_new)
    _, window, tails = policy.compiled(max(steps))

    def loop(k, tail: bool):
        def run(w, s, rule, rate, cont):
            drafter = functools.partial(controlled_drafter, rate=rate, continuation_BS=cont)
            return spec_loop(w, s, {}, rule, k=k, window=window, drafter=drafter, plain_tail=tail, **greedy_kw)
        return jax.jit(run, donate_argnums=1)

    plain = jax.jit(lambda w, s, limit: plain_loop(w, s, {}, limit, **greedy_kw), donate_argnums=1)
    return {k: loop(k, False) for k in steps if k > 0}, plain, {k: loop(k, True) for k in tails}


def compiled_side_by_side(prompt, base_prefill, sprefill, base_loop, fixed: dict, per_call):
    """The sweep's programs compiled ahead of time, XLA compiling them side by side (`compile_programs`: one thread
    a program; at Kimi's depth each takes tens of seconds, one after another several minutes): the prefills, plain
    decoding's loop, the fixed-K loops and adaptive by call's (`per_call`: `per_call_programs` or None). The
    per-cycle adaptive program stays jitted on first use."""
    base_state, spec_state = jax.eval_shape(base_prefill, *prompt), jax.eval_shape(sprefill, *prompt)
    sw, rate, cont = prompt[0], jax.ShapeDtypeStruct((), jnp.float32), base_state.out_tokens
    entries = {"base_prefill": (base_prefill, prompt, ()), "sprefill": (sprefill, prompt, ()),
               "base_loop": (base_loop, (sw, base_state), (1,))}
    entries.update({("fixed", k): (loop, (sw, spec_state, rate, cont), (1,)) for k, loop in fixed.items()})
    if per_call is not None:
        loops, plain, _ = per_call
        rule = jax.ShapeDtypeStruct((RULE_FIELDS,), jnp.float32)
        entries.update({("calls", k): (loop, (sw, spec_state, rule, rate, cont), (1,)) for k, loop in loops.items()})
        entries["plain"] = (plain, (sw, jax.eval_shape(to_plain, spec_state), jax.ShapeDtypeStruct((), jnp.int32)),
                            (1,))
    built = dict(zip(entries, compile_programs(list(entries.values()))))
    fixed = {k: built[("fixed", k)] for k in fixed}
    if per_call is not None:  # the tailed loops compile on first use, where the table asks for them
        per_call = ({k: built[("calls", k)] for k in per_call[0]}, built["plain"], per_call[2])
    return built["base_prefill"], built["sprefill"], built["base_loop"], fixed, per_call


def sweep_per_call(args, log, sw, sprefill, base_prefill, base_loop, prompt, cont, decoded, fixed, loops, plain,
                   tailed) -> dict:
    """Per a, plain decoding, each fixed K and adaptive by call (`loops`, `plain`, `tailed`: `per_call_programs`;
    a fresh pool for every run, what one `generate` process starts from) take turns in each of --repeats rounds
    (`interleaved`), every engine of a round on the same draw of the drafter's acceptances: the comparison the table
    makes is then between runs of the same moment, and `summary` pairs them by round."""
    policy = PerCallPolicy(steps=tuple(args.adaptive_steps), **({"min_cycles": args.min_cycles[0]}
                                                                 if args.min_cycles else {}))
    steps = policy.resolve_steps(max(args.adaptive_steps))
    j_max = max(steps)

    def run_forced(s, branch, cycles):
        k = steps[branch]
        if k == 0:
            out, _ = plain(sw, to_plain(s), np.int32(cycles))
            return out, int(out.steps)
        begin = int(s.cycles)
        out, _ = loops[k](sw, s, never_leaving(cycles), np.float32(0.0), cont)
        return out, int(out.cycles) - begin

    table = measure(run_forced, sprefill(*prompt), len(steps), first_run=jax.default_backend() != "cpu")
    log("adaptive (per call) cost table (ms per cycle): " + ", ".join(f"K={k}: {1e3 * c:.3f}" for k, c in
                                                                       zip(steps, table.costs_s))
        + f"; one more call {1e3 * table.first_run_s:.3f} ms")
    tails = policy.built_tails(j_max, table.costs_s, table.first_run_s)
    loops = {**loops, **{k: tailed[k] for k in tails}}  # compiled in the first round's warm-up

    def by_call(a: float, min_cycles: int) -> tuple[Contender, list]:
        """Adaptive by call at `a` with its first test after `min_cycles` cycles, and the list its runs' `Calls`
        go to."""
        pol = dataclasses.replace(policy, min_cycles=min_cycles)
        made = []

        def start(rep):
            """The prefilled state; beside it, the generation's first choice and rule (`Engine.generate` computes
            them while the device prefills, so they are not the decode's time)."""
            calls = Calls(steps, Pool(j_max, pol.window), np.asarray(table.costs_s, np.float32), table.first_run_s)
            made.append((calls, first_call(calls, pol, args.batch, args.max_new_tokens)))
            return sprefill(*keyed(prompt, rep, args.vary_seed))

        def run(s):
            calls, first = made[-1]
            out, *_ = drive(s, lambda k, st, r: loops[k](sw, st, r, np.float32(a), cont),
                            lambda st: plain(sw, st, np.int32(NO_LIMIT)), calls, pol, args.max_new_tokens, first)
            return out
        return Contender(start, run), made

    def fixed_k(a: float, k: int, seen: list) -> Contender:
        return Contender(lambda rep: sprefill(*keyed(prompt, rep, args.vary_seed)),
                         lambda s: fixed[k](sw, s, np.float32(a), cont),
                         lambda o: seen.append(_acceptance(o.accepted_log, k)))

    firsts = args.min_cycles or [policy.min_cycles]
    rows = {"K=0": {"acceptance": None, "by_a": {}, "rounds": {}}, **{f"K={k}": {} for k in fixed}, "adaptive": {}}
    variants = {}
    same = lambda out: bool(jnp.all(out.out_tokens[:, : args.max_new_tokens] ==  # noqa: E731
                                    cont[:, : args.max_new_tokens]))
    for a in args.acceptance:
        seen = {k: [] for k in fixed}
        contenders = {"K=0": Contender(lambda rep: base_prefill(*prompt), lambda s: base_loop(sw, s))}
        contenders.update({f"K={k}": fixed_k(a, k, seen[k]) for k in fixed})
        adaptive = {m: by_call(a, m) for m in firsts}
        contenders.update({f"adaptive {m}": c for m, (c, _) in adaptive.items()})
        times, outs = interleaved(contenders, args.repeats)
        rates = {name: [decoded / t for t in ts] for name, ts in times.items()}
        rows["K=0"]["by_a"][a], rows["K=0"]["rounds"][a] = statistics.median(rates["K=0"]), rates["K=0"]
        for k in fixed:
            name = f"K={k}"
            rows[name][a] = {"tokens_per_s": statistics.median(rates[name]), "rounds": rates[name],
                             "acceptance": _mean(seen[k]), "same_tokens": same(outs[name])}
            log(f"{name} a={a}: {rows[name][a]['tokens_per_s']:.1f} tok/s, measured acceptance "
                f"{rows[name][a]['acceptance']}")
        for m, (_, made) in adaptive.items():
            made[-1][0].settle(dataclasses.replace(policy, min_cycles=m), None)  # its last run's last call, as
            ks = made[-1][0].k_per_cycle  # the engine tallies it: after the timing
            name = f"adaptive {m}"
            got = {"tokens_per_s": statistics.median(rates[name]), "rounds": rates[name],
                   "k_histogram": {str(k): ks.count(k) for k in steps}, "calls": made[-1][0].calls,
                   "same_tokens": same(outs[name])}
            (rows["adaptive"] if m == firsts[0] else variants.setdefault(str(m), {}))[a] = got
            log(f"adaptive (per call, first test after {m} cycles) a={a}: {got['tokens_per_s']:.1f} tok/s, "
                f"K chosen {got['k_histogram']} in {got['calls']} calls; plain decoding "
                f"{rows['K=0']['by_a'][a]:.1f} tok/s in the same rounds")
    rows["K=0"]["tokens_per_s"] = statistics.median([r for a in args.acceptance for r in rows["K=0"]["rounds"][a]])
    return dict(rows=rows, costs_ms={str(k): 1e3 * c for k, c in zip(steps, table.costs_s)},
                first_run_ms=1e3 * table.first_run_s, adaptive_steps=list(steps), plain_tails=list(tails),
                min_cycles=firsts[0], min_cycles_variants=variants or None, adaptive_kind="per_call",
                interleaved=True)


@dataclasses.dataclass(frozen=True)
class Contender:
    """One engine of a round: `start(rep)` its prefilled state for round `rep` (not timed), `run(state)` its decode,
    `seen(out)` what a timed run's output tells (None: nothing)."""
    start: Callable
    run: Callable
    seen: Callable | None = None


def interleaved(contenders: dict, repeats: int) -> tuple[dict, dict]:
    """Each contender's wall times of `run(start(rep))` (a decode loop on a fresh prefilled state, until its tokens
    are on the host as `Engine.generate` times it) over `repeats` rounds after a warm-up round (rep 0), every
    contender once a round in an order rotated by one each round, so a drift of the device's speed falls on all of
    them alike; and each one's last output."""
    names = list(contenders)
    times, outs = {name: [] for name in names}, {}
    for rep in range(repeats + 1):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            c = contenders[name]
            state = c.start(rep)
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            out = c.run(state)
            jax.device_get((out.generated, out.out_tokens))
            if rep:
                times[name].append(time.perf_counter() - t0)
                if c.seen is not None:
                    c.seen(out)
            outs[name] = out
    return times, outs


def _timed(start, run, repeats: int, observe=None):
    """Median wall time of one engine alone (`interleaved`; None with no timed repeat) and its last output."""
    times, outs = interleaved({"": Contender(start, run, observe)}, repeats)
    return statistics.median(times[""]) if times[""] else None, outs[""]


def keyed(prompt: tuple, rep: int, vary: bool) -> tuple:
    """The prefill's arguments for repeat `rep`: its own random key where `vary` (the controllable drafter then
    draws its acceptances anew), else the same."""
    return (*prompt[:3], jax.random.key(rep), *prompt[4:]) if vary else prompt


def _mean(values):
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _acceptance(log_BC, k: int) -> float | None:
    """Measured conditional acceptance: accepted drafts / drafts that had a chance (all earlier ones accepted)."""
    a = np.asarray(log_BC)
    a = a[a >= 0]
    if k == 0 or a.size == 0:
        return None
    tried = sum(int(np.sum(a >= j - 1)) for j in range(1, k + 1))
    return float(np.sum(a)) / tried if tried else None


def sweep(args, log) -> dict:
    cfg = bench_config(args.layers, args.tiny)
    w = draw_weights(cfg, args.tiny, moe_layers=args.moe_layers)
    if args.target == "chained":
        w = jax.block_until_ready(chained_target(w))
    spec_cfg, _, sw = spec_pair(w, cfg, args.tiny)
    jax.block_until_ready(sw.draft)
    policy = AdaptivePolicy(steps=tuple(args.adaptive_steps), probe=False)
    steps = policy.resolve_steps(max(args.adaptive_steps))
    ks = sorted(set(args.k))
    k_max = max(ks + list(steps))
    bucket = prompt_bucket(args.prompt_tokens)
    capacity = round_capacity(max(bucket, args.prompt_tokens + args.max_new_tokens + k_max + 1))
    base_prefill, sprefill, base_loop, fixed, adaptive = programs(spec_cfg, ks, steps, policy, args.max_new_tokens,
                                                                  capacity)
    rng = np.random.default_rng(0)
    tokens = np.zeros((args.batch, bucket), np.int32)
    tokens[:, : args.prompt_tokens] = rng.integers(3, cfg.vocab_size, (args.batch, args.prompt_tokens))
    prompt = (sw, jnp.asarray(tokens), jnp.full((args.batch,), args.prompt_tokens, jnp.int32), jax.random.key(0), {})
    decoded = args.batch * (args.max_new_tokens - 1)  # tokens after the prefill's first, every run
    per_call = None
    if args.adaptive_kind == "per_call":
        call_policy = PerCallPolicy(steps=tuple(args.adaptive_steps))
        per_call = per_call_programs(spec_cfg, call_policy.resolve_steps(max(args.adaptive_steps)), call_policy,
                                     args.max_new_tokens)
    t0 = time.perf_counter()
    base_prefill, sprefill, base_loop, fixed, per_call = compiled_side_by_side(
        prompt, base_prefill, sprefill, base_loop, fixed, per_call)
    log(f"programs compiled side by side in {time.perf_counter() - t0:.1f} s")

    # plain decoding's continuation, the controllable drafter's truth; the by-call sweep times plain decoding in
    # every round beside the others, so it runs it once here, untimed
    by_call = args.adaptive_kind == "per_call"
    seconds, plain = _timed(lambda rep: base_prefill(*prompt), lambda s: base_loop(sw, s), 0 if by_call else
                            args.repeats)
    cont = plain.out_tokens
    rows = {"K=0": {"tokens_per_s": None if by_call else decoded / seconds, "acceptance": None}}
    if args.target == "chained":  # the share of plain decoding's tokens that follow f (1.0: the chain holds)
        expect, last = [], tokens[:, args.prompt_tokens - 1]
        for _ in range(args.max_new_tokens):
            last = chain_next(last, cfg.vocab_size)
            expect.append(last)
        got = np.asarray(cont)[:, : args.max_new_tokens]
        rows["K=0"]["chain_holds"] = float(np.mean(got == np.stack(expect, axis=1)))
        log(f"chained target: {rows['K=0']['chain_holds']:.3f} of plain decoding's tokens follow the chain")
    if by_call:
        got = sweep_per_call(args, log, sw, sprefill, base_prefill, base_loop, prompt, cont, decoded, fixed, *per_call)
        got["rows"]["K=0"].update({k: v for k, v in rows["K=0"].items() if k == "chain_holds"})
        return got
    log(f"K=0 (plain decoding): {decoded / seconds:.1f} tok/s")
    for k, loop in fixed.items():
        rows[f"K={k}"] = {}
        for a in args.acceptance:
            seen = []
            seconds, out = _timed(lambda rep: sprefill(*keyed(prompt, rep, args.vary_seed)),
                                  lambda s: loop(sw, s, np.float32(a), cont), args.repeats,
                                  lambda o: seen.append(_acceptance(o.accepted_log, k)))
            rows[f"K={k}"][a] = {"tokens_per_s": decoded / seconds, "acceptance": _mean(seen),
                                 "same_tokens": bool(jnp.all(out.out_tokens[:, : args.max_new_tokens] ==
                                                             cont[:, : args.max_new_tokens]))}
            log(f"K={k} a={a}: {decoded / seconds:.1f} tok/s, measured acceptance {rows[f'K={k}'][a]['acceptance']}")

    aux_width = len(spec_cfg.target.aux_layer_ids) * spec_cfg.target.hidden_size
    start = lambda table, rep=0: init_adaptive_state(sprefill(*keyed(prompt, rep, args.vary_seed)),  # noqa: E731
                                                     aux_width, steps, policy, *table)

    def run_forced(s, branch, cycles):
        begin = int(s.cycles)
        out = adaptive(sw, s.replace(**forced_schedule(steps, (steps[branch],))), jnp.float32(0.0), cont,
                       jnp.int32(cycles))
        return out, int(out.cycles) - begin

    table = measure(run_forced, start(((1.0,) * len(steps), 0.0)), len(steps))
    costs = table.costs_s
    log("adaptive cost table (ms per cycle): " + ", ".join(f"K={k}: {1e3 * c:.3f}" for k, c in zip(steps, costs))
        + f"; a branch's first run {1e3 * table.first_run_s:.3f} ms")
    rows["adaptive"] = {}
    for a in args.acceptance:
        seconds, out = _timed(lambda rep: start(table, rep), lambda s: adaptive(sw, s, jnp.float32(a), cont,
                                                                         jnp.int32(INT32_MAX)), args.repeats)
        k_log = np.asarray(out.k_log)
        k_log = k_log[k_log >= 0]
        rows["adaptive"][a] = {
            "tokens_per_s": decoded / seconds,
            "k_histogram": {str(k): int(np.sum(k_log == k)) for k in steps},
            "expected_tokens_per_s": float(out.expected_tokens / out.expected_s),
            "same_tokens": bool(jnp.all(out.out_tokens[:, : args.max_new_tokens] == cont[:, : args.max_new_tokens])),
        }
        log(f"adaptive a={a}: {decoded / seconds:.1f} tok/s, K chosen {rows['adaptive'][a]['k_histogram']}")
    return dict(rows=rows, costs_ms={str(k): 1e3 * c for k, c in zip(steps, costs)}, adaptive_kind="per_cycle",
                first_run_ms=1e3 * table.first_run_s, adaptive_steps=list(steps))


def _at(by_a: dict, a: float):
    """The entry for acceptance `a` of a row, whether its keys are floats (a sweep's own result) or their strings
    (the result read back from its JSON)."""
    return by_a[a] if a in by_a else by_a[str(a)]


def summary(result: dict) -> list[dict]:
    """Per a: tok/s of each fixed K and adaptive, the best fixed K, adaptive / best and / plain. Plain decoding does
    not depend on a; an interleaved sweep timed it in each a's rounds, and its figure there is the one compared.
    Where the rounds were kept, `..._paired`: the median over rounds of adaptive's rate over the other's in the same
    round (`paired_ratio`)."""
    rows = result["rows"]
    out = []
    for a in result["acceptance"]:
        plain = rows["K=0"]
        fixed = {"K=0": _at(plain["by_a"], a) if plain.get("by_a") else plain["tokens_per_s"]}
        fixed.update({name: _at(r, a)["tokens_per_s"] for name, r in rows.items() if name not in ("K=0", "adaptive")})
        rounds = {"K=0": _at(plain["rounds"], a) if plain.get("rounds") else None}
        rounds.update({name: _at(r, a).get("rounds") for name, r in rows.items() if name not in ("K=0", "adaptive")})
        best = max(fixed, key=fixed.get)
        ad = _at(rows["adaptive"], a)
        paired = lambda other: (paired_ratio(ad["rounds"], rounds[other])  # noqa: E731
                                if ad.get("rounds") and rounds[other] else None)
        out.append(dict(a=a, fixed=fixed, adaptive=ad["tokens_per_s"], best=best,
                        adaptive_over_best=ad["tokens_per_s"] / fixed[best],
                        adaptive_over_plain=ad["tokens_per_s"] / fixed["K=0"],
                        adaptive_over_best_paired=paired(best), adaptive_over_plain_paired=paired("K=0")))
        variants = result.get("min_cycles_variants") or {}
        if variants:  # adaptive with another first test, over the same best
            out[-1]["by_min_cycles"] = {m: _at(v, a)["tokens_per_s"] / fixed[best] for m, v in variants.items()}
    return out


def markdown(result: dict) -> str:
    names = list(summary(result)[0]["fixed"]) if result["acceptance"] else []
    lines = [
        f"# Adaptive speculation against acceptance: {result['device']}, jax {result['jax']}, {result['date']}", "",
        f"Kimi-K2.5 dims, {result['layers']} layers ({result.get('moe_layers', 'distinct')} MoE layers)"
        f"{' (tiny)' if result['tiny'] else ''}, random weights, batch "
        f"{result['batch']}, prompt {result['prompt_tokens']} tokens, {result['max_new_tokens']} new tokens, greedy, "
        f"on-device loop; controllable drafter (bench/adaptive_acceptance.py). Adaptive "
        f"{result.get('adaptive_kind', 'per_cycle')}, K set "
        f"{result['adaptive_steps']}, cost table (ms/cycle, measured here): {result['costs_ms']}. "
        + (f"Plain decoding, each fixed K and adaptive take turns in {result['repeats']} rounds per a (after a "
           "warm-up round, the order rotating), each engine's median" if result.get("interleaved")
           else f"Median of {result['repeats']} runs")
        + ((", each round its own draw of the drafter's acceptances, the same for every engine of the round"
            if result.get("interleaved") else ", each with its own draw of the drafter's acceptances")
           + " (the measured acceptance: their mean)" if result.get("vary_seed") else "")
        + f". Target: {result.get('target', 'random')}"
        + (f" ({result['rows']['K=0']['chain_holds']:.3f} of plain decoding's tokens follow its chain)"
           if 'chain_holds' in result['rows']['K=0'] else "") + ".", "",
        "| a | " + " | ".join(f"{n} tok/s" for n in names) + " | adaptive tok/s | best fixed | adaptive / best | "
        "the two, paired by round | adaptive K histogram |",
        "|---" * (len(names) + 6) + "|",
    ]
    for row in summary(result):
        hist = _at(result["rows"]["adaptive"], row["a"])["k_histogram"]
        lines.append(f"| {row['a']} | " + " | ".join(f"{row['fixed'][n]:.1f}" for n in names)
                     + f" | {row['adaptive']:.1f} | {row['best']} | {row['adaptive_over_best']:.3f} | "
                     f"{fmt(row['adaptive_over_best_paired'])} | {hist} |")
    variants = result.get("min_cycles_variants") or {}
    if variants:
        lines += ["", f"Adaptive over the best fixed K with its first test after {result['min_cycles']} cycles (above) "
                  "and after other counts (the K histogram in brackets):", ""]
        for row in summary(result):
            others = "; ".join(f"{m} cycles {r:.3f} {_at(variants[m], row['a'])['k_histogram']}"
                               for m, r in row["by_min_cycles"].items())
            lines.append(f"- a = {row['a']}: {result['min_cycles']} cycles {row['adaptive_over_best']:.3f}; {others}")
    lines += ["", "Measured conditional acceptance per fixed K (asked a -> measured):", ""]
    for name, r in result["rows"].items():
        if name not in ("K=0", "adaptive"):
            seen = {a: _at(r, a)["acceptance"] for a in result["acceptance"]}
            lines.append(f"- {name}: " + ", ".join(f"{a} -> {seen[a]:.3f}" if seen[a] is not None else f"{a} -> -"
                                                   for a in result["acceptance"]))
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, acc = result["rows"], result["acceptance"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(acc, [rows["K=0"]["tokens_per_s"]] * len(acc), "k--", label="K=0 (plain decoding)")
    for name, r in rows.items():
        if name not in ("K=0", "adaptive"):
            ax.plot(acc, [r[a]["tokens_per_s"] for a in acc], marker="o", label=name)
    ax.plot(acc, [rows["adaptive"][a]["tokens_per_s"] for a in acc], "r-", marker="s", linewidth=2.5,
            label=f"adaptive {result['adaptive_steps']}")
    ax.set_xlabel("per-position draft acceptance a")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{result['layers']}-layer K2.5-shaped model, {result['device']}, batch {result['batch']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.adaptive_acceptance", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--moe-layers", choices=("distinct", "repeated"), default="distinct",
                   help="repeated: every MoE layer runs one layer's experts (bench.step.draw_weights; 61 layers fit)")
    p.add_argument("--tiny", action="store_true", help="small dims (CPU smoke run)")
    p.add_argument("--target", choices=("random", "chained"), default="random",
                   help="chained: a target whose greedy continuation cannot drift between plain decoding and a "
                        "verify at any depth (`chained_target`); random: the drawn weights as they are")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4], help="fixed K to time beside K = 0")
    p.add_argument("--adaptive-steps", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="the adaptive K set")
    p.add_argument("--adaptive-kind", choices=ADAPTIVE_KINDS, default=None,
                   help="per_call or per_cycle adaptive speculation (default: the backend's, as generate runs it)")
    p.add_argument("--acceptance", type=float, nargs="+", default=list(ACCEPTANCE))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vary-seed", action="store_true",
                   help="a random key per repeat: each fixed K's and adaptive's median is then over that many draws "
                        "of the drafter's acceptances, not one draw timed again (the measured acceptance: their mean)")
    p.add_argument("--min-cycles", type=int, nargs="+", default=None,
                   help="per_call: cycles a call runs before its first test, the first for the table's adaptive "
                        "column, the others reported beside it (default: the policy's)")
    p.add_argument("--out", required=True, help="results folder (JSON, markdown, PNG)")
    a = p.parse_args(argv)
    a.adaptive_kind = a.adaptive_kind or default_adaptive_kind(jax.default_backend())
    if a.layers < 3:
        p.error("--layers must be >= 3 (the draft taps three distinct target layers)")
    if a.batch < 1 or a.prompt_tokens < 1 or a.max_new_tokens < 2 or a.repeats < 1:
        p.error("--batch, --prompt-tokens, --repeats must be >= 1 and --max-new-tokens >= 2")
    if any(k < 1 for k in a.k):
        p.error("--k: fixed K must be >= 1 (K = 0, plain decoding, always runs)")
    if any(k < 0 for k in a.adaptive_steps) or max(a.adaptive_steps) < 1:
        p.error("--adaptive-steps: K >= 0 with at least one K >= 1")
    if a.min_cycles is not None and (min(a.min_cycles) < 1 or a.adaptive_kind != "per_call"):
        p.error("--min-cycles: counts >= 1, for --adaptive-kind per_call")
    if any(not 0.0 <= x <= 1.0 for x in a.acceptance):
        p.error("--acceptance: rates must lie in [0, 1]")
    return a


def main(argv=None):
    args = parse_args(argv)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    stamp = run_stamp()
    result = dict(**stamp.fields,
                  layers=args.layers, moe_layers=args.moe_layers, target=args.target, tiny=args.tiny, batch=args.batch,
                  prompt_tokens=args.prompt_tokens,
                  max_new_tokens=args.max_new_tokens, repeats=args.repeats, acceptance=list(args.acceptance),
                  vary_seed=args.vary_seed)
    result.update(sweep(args, log))
    result["summary"] = summary(result)
    out = Path(args.out)
    stem = f"adaptive-acceptance-{stamp.suffix}"
    out.mkdir(parents=True, exist_ok=True)
    plot(result, out / f"{own_stem(out, stem)}.png")  # beside the JSON, under the stem it goes to
    publish(result, out, stem, markdown, log, also=" and .png")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
