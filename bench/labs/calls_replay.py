"""`python -m bench.labs.calls_replay`: adaptive speculation by call replayed offline against a flat acceptance a, or
against the embedded pair's own text.

`bench.adaptive_acceptance` on the H200 gives one row per a for a few minutes of a GPU, and each row moves by a few
percent between runs: too coarse to choose between versions of the host rule. This lab runs the host's own
`jaxspec.adaptive_calls_run.drive` (its first choice, stay bands, choices between calls and pooling) over a
simulated device: a call at K runs cycles whose accepted drafts are drawn as the controllable drafter draws them
(each position right with probability a, independently; a cycle accepts the drafts before the first wrong one), with
`spec_loop`'s leaving test (the mean over the call's last `window` cycles against the band after the call's
minimum), and plain calls with `probe_loop`'s blocks and test (each plain step's c_1 observed as a draft of one
would be accepted there). Time is priced, not measured: each cycle costs the cost table's t(K) (the plain calls'
catch-ups nothing), and every call after the first the price of one more call. Fixed K is priced the same way (one
call). What it cannot hold: the by-call engine's cost at the same K beyond its cycles (a few tenths of a ms a call
on the H200, docs/performance.md), and any drift of the cost table. Per a: mean tok/s over --seeds generations of
fixed K = 0..4 and of each policy variant, and adaptive over the best fixed K.

With `--oracle` the drafts come from text instead: `bench.labs.adaptive_replay oracle`'s N[g] for each prompt of
`bench.adaptive_prompts` (greedy decoding makes acceptance a property of the position: a cycle that starts after g
generated tokens accepts min(K, N[g]) drafts), so acceptance runs in stretches as it does on the H200's prompt
bench, with none of its timing noise. The generations run as that bench's engine runs them: one pool kept across
them, --rounds passes over the prompts in rotated order after one pass of warm-up (`--order sequential`: each
prompt's warm-up and rounds in a row, the order of `bench.adaptive_prompts`), each prompt's figure the mean of its
passes. What this adds to the bench: the rule's choices alone, priced by the H200's cost table of the embedded pair,
against each fixed K priced the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from pathlib import Path

import numpy as np

from bench.adaptive_fresh import k_runs
from jaxspec.adaptive_calls import (BAND_GRID, PROBE_FIRST_BLOCK, PROBE_LIMIT, PROBE_MIN_STEPS, PROBE_TABLES,
                                    RULE_HIGH, RULE_LIMIT, RULE_LOW, RULE_MIN_CYCLES, RULE_PLAIN_HIGH, PerCallPolicy,
                                    Pool, rule_array)
from jaxspec.adaptive_calls_run import NO_LIMIT, Calls, drive, first_call

# the 4-layer K2.5-shaped model on the H200 (bench/results/wave3/adaptive-vary-seed-1723): ms per cycle, one more call
H200_4_LAYERS = ((1.309, 2.020, 2.639, 3.287, 3.917), 2.698)
# the embedded pair on the H200, as its prompt bench's engine measured it (bench/results/wave3/loop-test-ab-0228:
# the cost table; one more call as run 0002's table priced it)
H200_EMBEDDED = ((0.139, 0.212, 0.233, 0.243, 0.275), 1.95)


@dataclasses.dataclass
class SimState:
    """What `drive` and `read_summary` read of a speculative state (batch 1)."""
    pending: np.ndarray
    accepted_log: np.ndarray  # [1, C]
    done: np.ndarray
    generated: np.ndarray
    out_tokens: np.ndarray
    cycles: int = 0
    steps: int = 0
    target_cache: None = None
    key: None = None


def draw_accepted(rng, a: float, k: int) -> int:
    """Drafts a cycle of K accepts: those before the first wrong one, each right with probability a."""
    right = rng.random(k) < a
    return int(k if right.all() else np.argmin(right))


def flat(rng, a: float):
    """`draw(k, generated)`: a cycle's accepted drafts at a flat acceptance a (`draw_accepted`)."""
    return lambda k, generated: draw_accepted(rng, a, k)


def on_text(accept_G):
    """`draw(k, generated)` on a prompt's text: `accept_G[i]` is N for the cycle that starts with i + 1 tokens
    generated (the oracle's row of context prompt + y[:i], whose prefill emits y[i]; `bench.labs.adaptive_replay`)."""
    return lambda k, generated: min(k, int(accept_G[generated - 1]))


def simulated_call(draw, max_new: int, window: int, tails: tuple[int, ...]):
    """`call_k(k, state, rule) -> (state, summary)` for `drive`: `spec_loop`'s cycles and leaving test, and the
    plain tail of the K in `tails`; `draw(k, generated)` gives each cycle's accepted drafts."""

    def call(k, s: SimState, rule):
        rule = np.asarray(rule)
        log, generated, start = s.accepted_log.copy(), int(s.generated[0]), s.cycles
        cycles, total, seen = start, 0.0, 0.0
        plain_from, plain_steps = generated, 0
        while generated < max_new:
            n = draw(k, generated)
            log[0, cycles] = n
            generated = min(generated + n + 1, max_new)
            total += n
            seen += 1
            if cycles - window >= start:
                total -= log[0, cycles - window]
                seen -= 1
            cycles += 1
            ran = cycles - start
            mean = total / max(seen, 1.0)
            inside = rule[RULE_LOW] <= mean <= rule[RULE_HIGH]
            if ran >= rule[RULE_LIMIT]:
                break
            if ran >= rule[RULE_MIN_CYCLES] and not inside:
                if k in tails and mean <= rule[RULE_PLAIN_HIGH]:
                    plain_from, plain_steps, generated = generated, max_new - generated, max_new
                break
        done = np.array([generated >= max_new])
        out = SimState(s.pending, log, done, np.array([generated]), s.out_tokens, cycles)
        summary = np.concatenate([[int(done.all()), cycles, plain_steps, plain_from], log.reshape(-1), [generated],
                                  done.astype(np.int64), s.out_tokens.reshape(-1)])
        return out, summary

    return call


def simulated_probe(draw, max_new: int, width: int):
    """`call_probe(state, probe_F) -> (state, summary)` for `drive`: `probe_loop`'s blocks of plain steps and its
    leaving test; each plain step's c_1 observation is whether a draft of one there would be accepted
    (`draw(1, generated)`). The catch-ups' draft forwards are not priced."""

    def call(s, probe_F):
        probe_F = np.asarray(probe_F)
        log, generated, cycles = s.accepted_log.copy(), int(s.generated[0]), s.cycles
        start, size, index = cycles, float(probe_F[PROBE_FIRST_BLOCK]), 0
        cap = max(size, width)
        hits = trials = 0.0
        while generated < max_new and cycles - start < probe_F[PROBE_LIMIT]:
            hits = trials = 0.0
            first = cycles
            while generated < max_new and cycles - first < size and cycles - start < probe_F[PROBE_LIMIT]:
                hits, trials = hits + draw(1, generated), trials + 1.0
                log[0, cycles] = 0
                generated, cycles = generated + 1, cycles + 1
            size = min(2 * size, cap)
            slowest = max_new - generated if generated < max_new else 0
            mean = hits / max(trials, 1.0)
            if (cycles - start >= probe_F[PROBE_MIN_STEPS] and trials > 0
                    and slowest >= probe_F[index * BAND_GRID + int(round(mean * (BAND_GRID - 1)))]):
                break
            index = min(index + 1, PROBE_TABLES - 1)
        done = np.array([generated >= max_new])
        out = SimState(s.pending, log, done, np.array([generated]), s.out_tokens, cycles)
        bits = np.array([hits, trials], np.float32).view(np.int32)
        summary = np.concatenate([[int(done.all()), cycles, cycles - start], bits, [generated],
                                  done.astype(np.int64), s.out_tokens.reshape(-1)]).astype(np.int32)
        return out, summary

    return call


def replay(draw, policy: PerCallPolicy, costs_ms, switch_ms: float, max_new: int, probe_first: bool = False,
           pool: Pool | None = None) -> dict:
    """One generation of `max_new` tokens by call: tok/s (tokens after the first), its calls and its K a cycle.
    `draw(k, generated)` gives each cycle's accepted drafts (`flat`, `on_text`); `pool`: the engine's, kept across
    generations (None: a fresh one); `probe_first`: the first call leaves after its minimum whatever it observed
    (the host then decides on them)."""
    steps = policy.resolve_steps(len(costs_ms) - 1)
    pool = Pool(max(steps), float(policy.window)) if pool is None else pool
    pool.new_generation()
    run = Calls(steps, pool, np.asarray(costs_ms, np.float32) * 1e-3, switch_ms * 1e-3)
    first = first_call(run, policy, 1, max_new)
    if probe_first and first[0] > 0:
        first = (first[0], first[1], rule_array(np.inf, -np.inf, policy.min_cycles, NO_LIMIT))
    state = SimState(np.zeros(1, np.int32), np.full((1, max_new), -1, np.int64), np.zeros(1, bool), np.ones(1),
                     np.zeros((1, 1), np.int64))
    plain_steps = []

    def call_plain(s):  # (state, `plain_summary`)
        plain_steps.append(max_new - int(s.generated[0]))
        summary = np.concatenate([[plain_steps[-1], max_new, 1], np.asarray(s.out_tokens).reshape(-1)])
        return SimState(s.pending, None, np.ones(1, bool), np.array([max_new]), s.out_tokens,
                        steps=plain_steps[-1]), summary

    tails = policy.built_tails(len(costs_ms) - 1, costs_ms, switch_ms)  # as the engine builds them for this table
    # plain calls probe as the engine's do with its EAGLE-3 draft (`adaptive_calls_run.probes`)
    probe = simulated_probe(draw, max_new, policy.probe_every) if policy.probe_every > 0 and 0 in steps else None
    drive(state, simulated_call(draw, max_new, policy.window, tails), call_plain, run, policy, max_new, first, probe)
    run.settle(policy, None)  # the last call's counts reach the pool, as after the engine's timing
    ks = run.k_per_cycle
    seconds = sum(costs_ms[k] for k in ks) * 1e-3 + (run.calls - 1) * switch_ms * 1e-3
    return dict(tokens_per_s=(max_new - 1) / seconds, calls=run.calls, ks=ks)


@contextlib.contextmanager
def every_depth_observed():
    """The host rule as it was before `observed_GN` (the smallest K within the margin whatever was observed), for a
    comparison in this lab only: both modules' `observed_GN` answer "observed" for the duration."""
    import jaxspec.adaptive_calls as calls
    import jaxspec.adaptive_calls_run as calls_run

    kept = calls.observed_GN
    everything = lambda trials_GJ, steps: np.ones((np.asarray(trials_GJ).shape[0], len(steps)), bool)  # noqa: E731
    calls.observed_GN = calls_run.observed_GN = everything
    try:
        yield
    finally:
        calls.observed_GN = calls_run.observed_GN = kept


def fixed(draw, k: int, costs_ms, max_new: int) -> float:
    """tok/s of one generation at fixed K (K = 0: plain decoding), each cycle priced at t(K)."""
    generated, cycles = 1, 0
    while generated < max_new:
        generated += (draw(k, generated) if k else 0) + 1
        cycles += 1
    return (max_new - 1) / (cycles * costs_ms[k] * 1e-3)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.calls_replay", description=__doc__.split("\n")[0])
    p.add_argument("--acceptance", type=float, nargs="+", default=[0.0, 0.3, 0.6, 0.8, 0.95])
    p.add_argument("--costs-ms", type=float, nargs="+", default=None,
                   help="t(K) for K = 0..len-1 (default: the 4-layer model on the H200; with --oracle, the embedded "
                        "pair on the H200)")
    p.add_argument("--switch-ms", type=float, default=None, help="the price of one more call (default: as the costs)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--variants", type=str, default='{"default": {}}',
                   help='JSON: name -> PerCallPolicy fields, and the lab\'s "probe_first" and '
                        '"every_depth_observed" (true: see `replay`, `every_depth_observed`), e.g. '
                        '\'{"prior 0.8": {"prior": 0.8}, "no plain tail": {"plain_tails": []}}\'')
    p.add_argument("--oracle", type=Path, default=None,
                   help="replay on text: `bench.labs.adaptive_replay oracle`'s JSON (N[g] per prompt); the costs "
                        "then default to the embedded pair's on the H200")
    p.add_argument("--rounds", type=int, default=5, help="with --oracle: passes over the prompts after the warm-up")
    p.add_argument("--order", choices=("rotated", "sequential"), default="rotated",
                   help="with --oracle: passes over all prompts in rotated order, or each prompt's warm-up and rounds "
                        "in a row (as bench.adaptive_prompts runs them)")
    p.add_argument("--turns-at", type=int, nargs="+", default=None,
                   help="instead of --acceptance: a new engine's first generation on a text whose drafts all fail "
                        "before this token and are all accepted after it (one row per token)")
    p.add_argument("--out", default=None, help="write calls-replay.json here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    costs, switch = H200_EMBEDDED if args.oracle is not None else H200_4_LAYERS
    args.costs_ms = list(costs) if args.costs_ms is None else args.costs_ms
    args.switch_ms = switch if args.switch_ms is None else args.switch_ms
    try:
        lab = ("probe_first", "every_depth_observed")
        variants = {name: (PerCallPolicy(**{f: tuple(v) if isinstance(v, list) else v
                                            for f, v in fields.items() if f not in lab})
                           .validate(len(args.costs_ms) - 1), bool(fields.get("probe_first", False)),
                           bool(fields.get("every_depth_observed", False)))
                    for name, fields in json.loads(args.variants).items()}
    except (ValueError, TypeError) as e:
        p.error(f"--variants: {e}")
    if args.oracle is not None:
        return text_rows(args, variants)
    if args.turns_at is not None:
        return turning_rows(args, variants)
    rows = []
    for a in args.acceptance:
        row = dict(a=a, fixed={}, adaptive={})
        for k in range(len(args.costs_ms)):
            rng = np.random.default_rng(1000 + k)
            row["fixed"][k] = float(np.mean([fixed(flat(rng, a), k, args.costs_ms, args.max_new_tokens)
                                             for _ in range(args.seeds)]))
        best = max(row["fixed"].values())
        for name, (policy, probe_first, old_rule) in variants.items():
            rng = np.random.default_rng(7)
            with every_depth_observed() if old_rule else contextlib.nullcontext():
                runs = [replay(flat(rng, a), policy, args.costs_ms, args.switch_ms, args.max_new_tokens, probe_first)
                        for _ in range(args.seeds)]
            tps = [r["tokens_per_s"] for r in runs]
            row["adaptive"][name] = dict(tokens_per_s=float(np.mean(tps)), over_best=float(np.mean(tps)) / best,
                                         worst_decile_over_best=float(np.percentile(tps, 10)) / best,
                                         calls=float(np.mean([r["calls"] for r in runs])))
        rows.append(row)
        print(f"a={a}: fixed " + ", ".join(f"K={k} {v:.1f}" for k, v in row["fixed"].items()) + "; "
              + "; ".join(f"{n} {v['tokens_per_s']:.1f} ({v['over_best']:.3f} of best, 10th pct "
                          f"{v['worst_decile_over_best']:.3f}, {v['calls']:.2f} calls)"
                          for n, v in row["adaptive"].items()), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "calls-replay.json").write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))


def turns_at(token: int):
    """`draw` for a text the draft cannot follow before `token` and follows exactly after it."""
    return lambda k, generated: 0 if generated < token else k


def turning_rows(args, variants) -> list[dict]:
    """Per --turns-at token: fixed K = 0..4 and each variant's first generation with a fresh pool (a new process's
    engine), with the K it ran in stretches."""
    rows = []
    for token in args.turns_at:
        draw = turns_at(token)
        row = dict(turns_at=token, fixed={k: fixed(draw, k, args.costs_ms, args.max_new_tokens)
                                          for k in range(len(args.costs_ms))}, adaptive={})
        best = max(row["fixed"].values())
        for name, (policy, probe_first, old_rule) in variants.items():
            with every_depth_observed() if old_rule else contextlib.nullcontext():
                run = replay(draw, policy, args.costs_ms, args.switch_ms, args.max_new_tokens, probe_first)
            row["adaptive"][name] = dict(tokens_per_s=run["tokens_per_s"], over_best=run["tokens_per_s"] / best,
                                         calls=run["calls"], stretches=k_runs(run["ks"]))
        rows.append(row)
        print(f"turns at {token}: best fixed {best:.0f} tok/s; "
              + "; ".join(f"{n} {v['over_best']:.3f} of it, {v['calls']} calls, K stretches {v['stretches']}"
                          for n, v in row["adaptive"].items()), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "calls-replay-turning.json").write_text(json.dumps(dict(args=vars(args), rows=rows),
                                                                             indent=1))
    return rows


def text_rows(args, variants) -> list[dict]:
    """Per prompt of the oracle: fixed K = 0..4 and each variant on its text, the variant's generations run as the
    prompt bench's engine runs them (one pool, a warm-up pass, then --rounds passes in rotated order)."""
    try:
        prompts = json.loads(args.oracle.read_text())["prompts"]
        accepts = [[int(n) for n in p["accept"]] for p in prompts]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"calls_replay: --oracle {args.oracle}: not an oracle JSON ({e})") from None
    max_new = min(args.max_new_tokens, *(len(a) + 1 for a in accepts))
    rows = [dict(prompt=p["prompt"], fixed={k: fixed(on_text(acc), k, args.costs_ms, max_new)
                                            for k in range(len(args.costs_ms))}, adaptive={})
            for p, acc in zip(prompts, accepts)]
    for name, (policy, probe_first, old_rule) in variants.items():
        pool = Pool(max(policy.resolve_steps(len(args.costs_ms) - 1)), float(policy.window))
        runs = [[] for _ in prompts]
        # `bench.adaptive_prompts` runs a prompt's warm-up and rounds before the next prompt's ("sequential"); the
        # rotated passes over all prompts are the order of a server's mixed traffic
        order = ([(r, i) for i in range(len(prompts)) for r in range(args.rounds + 1)] if args.order == "sequential"
                 else [(r, i) for r in range(args.rounds + 1) for i in np.roll(np.arange(len(prompts)), -r)])
        with every_depth_observed() if old_rule else contextlib.nullcontext():
            for r, i in order:  # round 0 warms the pool up, as the bench's warm-up generations do
                run = replay(on_text(accepts[i]), policy, args.costs_ms, args.switch_ms, max_new, probe_first, pool)
                if r:
                    runs[i].append(run)
        for row, rs in zip(rows, runs):
            tps = float(np.mean([x["tokens_per_s"] for x in rs]))
            row["adaptive"][name] = dict(tokens_per_s=tps, over_best=tps / max(row["fixed"].values()),
                                         calls=float(np.mean([x["calls"] for x in rs])),
                                         k_histogram={k: sum(x["ks"].count(k) for x in rs) / len(rs)
                                                      for k in range(len(args.costs_ms))})
    for row in rows:
        best = max(row["fixed"], key=row["fixed"].get)
        print(f"{row['prompt'][:24]!r:28s} best fixed K = {best} ({row['fixed'][best]:.0f} tok/s); "
              + "; ".join(f"{n} {v['over_best']:.3f} (K a cycle {_ks(v['k_histogram'])}, {v['calls']:.2f} calls)"
                          for n, v in row["adaptive"].items()), flush=True)
    for name in variants:
        ratios = [row["adaptive"][name]["over_best"] for row in rows]
        print(f"{name}: adaptive over the best fixed K {min(ratios):.3f} (worst) .. {max(ratios):.3f}, median "
              f"{float(np.median(ratios)):.3f}", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "calls-replay-text.json").write_text(
            json.dumps(dict(args={**vars(args), "oracle": str(args.oracle)}, max_new_tokens=max_new, rows=rows),
                       indent=1))
    return rows


def _ks(histogram: dict) -> str:
    return " ".join(f"{k}:{v:g}" for k, v in histogram.items() if v)


if __name__ == "__main__":
    main()
