"""`python -m bench.labs.calls_replay`: adaptive speculation by call replayed offline against a flat acceptance a.

`bench.adaptive_acceptance` on the H200 gives one row per a for a few minutes of a GPU, and each row moves by a
few percent between runs: too coarse to choose between versions of the host rule. This lab runs the host's own
`jaxspec.adaptive_calls_run.drive` (its first choice, stay bands, choices between calls and pooling) over a
simulated device: a call at K runs cycles whose accepted drafts are drawn as the controllable drafter draws them
(each position right with probability a, independently; a cycle accepts the drafts before the first wrong one),
with `spec_loop`'s leaving test (the mean over the call's last `window` cycles against the band after the call's
minimum). Time is priced, not measured: each cycle costs the cost table's t(K), and every call after the first
the price of one more call. Fixed K is priced the same way (one call). What it cannot hold: the by-call engine's
cost at the same K beyond its cycles (a few tenths of a ms a call on the H200, docs/performance.md), and any drift
of the cost table. Per a: mean tok/s over --seeds generations of fixed K = 0..4 and of each policy variant, and
adaptive over the best fixed K.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxspec.adaptive_calls import (RULE_HIGH, RULE_LIMIT, RULE_LOW, RULE_MIN_CYCLES, RULE_PLAIN_HIGH, PerCallPolicy,
                                    Pool, rule_array)
from jaxspec.adaptive_calls_run import NO_LIMIT, Calls, drive, first_call

# the 4-layer K2.5-shaped model on the H200 (bench/results/wave3/adaptive-vary-seed-1723): ms per cycle, one more call
H200_4_LAYERS = ((1.309, 2.020, 2.639, 3.287, 3.917), 2.698)


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


def simulated_call(rng, a: float, max_new: int, window: int, tails: tuple[int, ...]):
    """`call_k(k, state, rule) -> (state, summary)` for `drive`: `spec_loop`'s cycles and leaving test, and the
    plain tail of the K in `tails`."""

    def call(k, s: SimState, rule):
        rule = np.asarray(rule)
        log, generated, start = s.accepted_log.copy(), int(s.generated[0]), s.cycles
        cycles, total, seen = start, 0.0, 0.0
        plain_from, plain_steps = generated, 0
        while generated < max_new:
            n = draw_accepted(rng, a, k)
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
        summary = np.concatenate([[cycles, plain_steps, plain_from], log.reshape(-1), [generated],
                                  done.astype(np.int64), s.out_tokens.reshape(-1)])
        return out, summary

    return call


def replay(a: float, policy: PerCallPolicy, costs_ms, switch_ms: float, max_new: int, rng,
           probe_first: bool = False) -> dict:
    """One generation of `max_new` tokens by call from a fresh pool: tok/s (tokens after the first) and its K.
    `probe_first`: the first call leaves after its minimum whatever it observed (the host then decides on them)."""
    steps = policy.resolve_steps(len(costs_ms) - 1)
    run = Calls(steps, Pool(max(steps), float(policy.window)), np.asarray(costs_ms, np.float32) * 1e-3,
                switch_ms * 1e-3)
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

    tails = policy.resolve_tails(len(costs_ms) - 1)
    drive(state, simulated_call(rng, a, max_new, policy.window, tails), call_plain, run, policy, max_new, first)
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


def fixed(a: float, k: int, costs_ms, max_new: int, rng) -> float:
    generated, cycles = 1, 0
    while generated < max_new:
        generated += (draw_accepted(rng, a, k) if k else 0) + 1
        cycles += 1
    return (max_new - 1) / (cycles * costs_ms[k] * 1e-3)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.calls_replay", description=__doc__.split("\n")[0])
    p.add_argument("--acceptance", type=float, nargs="+", default=[0.0, 0.3, 0.6, 0.8, 0.95])
    p.add_argument("--costs-ms", type=float, nargs="+", default=list(H200_4_LAYERS[0]),
                   help="t(K) for K = 0..len-1 (default: the 4-layer model on the H200)")
    p.add_argument("--switch-ms", type=float, default=H200_4_LAYERS[1])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--variants", type=str, default='{"default": {}}',
                   help='JSON: name -> PerCallPolicy fields, and the lab\'s "probe_first" and '
                        '"every_depth_observed" (true: see `replay`, `every_depth_observed`), e.g. '
                        '\'{"prior 0.8": {"prior": 0.8}, "no plain tail": {"plain_tails": []}}\'')
    p.add_argument("--out", default=None, help="write calls-replay.json here")
    args = p.parse_args(argv)
    try:
        lab = ("probe_first", "every_depth_observed")
        variants = {name: (PerCallPolicy(**{f: tuple(v) if isinstance(v, list) else v
                                            for f, v in fields.items() if f not in lab})
                           .validate(len(args.costs_ms) - 1), bool(fields.get("probe_first", False)),
                           bool(fields.get("every_depth_observed", False)))
                    for name, fields in json.loads(args.variants).items()}
    except (ValueError, TypeError) as e:
        p.error(f"--variants: {e}")
    rows = []
    for a in args.acceptance:
        row = dict(a=a, fixed={}, adaptive={})
        for k in range(len(args.costs_ms)):
            rng = np.random.default_rng(1000 + k)
            row["fixed"][k] = float(np.mean([fixed(a, k, args.costs_ms, args.max_new_tokens, rng)
                                             for _ in range(args.seeds)]))
        best = max(row["fixed"].values())
        for name, (policy, probe_first, old_rule) in variants.items():
            rng = np.random.default_rng(7)
            with every_depth_observed() if old_rule else contextlib.nullcontext():
                runs = [replay(a, policy, args.costs_ms, args.switch_ms, args.max_new_tokens, rng, probe_first)
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


if __name__ == "__main__":
    main()
