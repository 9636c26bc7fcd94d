"""`python -m bench.labs.adaptive_replay`: the adaptive rule replayed offline on the embedded pair's prompts (issue 37).

A device run of `bench.adaptive_prompts` gives one number per prompt and policy; tuning the rule that way costs
minutes of a GPU per try. Greedy decoding makes acceptance a property of the position: a cycle that starts after
g generated tokens accepts min(K, N[g]) drafts, where N[g] is how many of the draft chain's tokens from there match
the target's continuation. This lab measures N[g] for every g of every prompt with the real engine (one batched
call of K = `--depth`, each row a prompt plus the first g - 1 tokens of the greedy output, on any device:
`oracle`), then replays fixed K and the rule's policies over it with a cost table (ms per cycle per K, from a
device run of `bench.adaptive_prompts`) and a price per change of K (`replay`). The replay follows
`jaxspec.adaptive.adaptive_cycle` step by step (runs held `stretch` cycles then kept within `hysteresis`, the
plain runs' backlog and its probe, single-cycle explorations with their back-off), using its own functions for the
estimates and the rule. It prices time, it does not measure it: its fixed-K figures are checked against the
device's before its adaptive ones are read.

What N[g] cannot hold: the draft's state after a speculative cycle is taken to be the state after a prefill of
the same tokens (both are the draft run over the target's features), and sampling is not replayed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxspec import adaptive
from jaxspec.adaptive import EXPLORE_BACKOFF, AdaptivePolicy, acceptance_rates, optimistic, throughput


def oracle(args) -> None:
    from bench.adaptive_prompts import PROMPTS, encode, load_pair
    from jaxspec.engine import Engine

    cfg, w, tok = load_pair(jnp.dtype(args.dtype))
    plain = Engine(cfg, w, num_steps=0)
    deep = Engine(cfg, w, num_steps=args.depth)
    rows = []
    for kind, text in PROMPTS:
        prompt = encode(tok, text)
        y = plain.generate([prompt], args.max_new_tokens).tokens[0]
        contexts = [prompt + y[: g - 1] for g in range(1, len(y))]  # the prefill emits y_g, the cycle drafts y_g+1..
        res = deep.generate(contexts, args.depth + 2)
        n = [row[0] if row else 0 for row in res.accepted]
        rows.append(dict(kind=kind, prompt=text, tokens=y, accept=n))
        print(f"{kind:6s} {text[:24]!r:28s} mean N {np.mean(n):.2f}  N>=1 {np.mean(np.asarray(n) >= 1):.2f}",
              flush=True)
    Path(args.out).write_text(json.dumps(dict(depth=args.depth, dtype=args.dtype, prompts=rows)))


@dataclasses.dataclass
class Replay:
    tokens_per_s: float
    k_log: list


def replay_fixed(n_G, total: int, k: int, cost_ms: dict) -> Replay:
    g, t, ks = 1, 0.0, []
    while g < total:
        acc = min(k, n_G[g]) if k else 0
        g += acc + 1
        t += cost_ms[k]
        ks.append(k)
    return Replay((total - 1) / t * 1e3, ks)


def replay_rule(n_G, total: int, cost_ms: dict, policy: AdaptivePolicy, steps, switch_ms: float,
                update_ms: float = 0.0, price_ms: float | None = None) -> Replay:
    """One sequence through the rule of `jaxspec.adaptive.adaptive_cycle` (B = 1, greedy): `switch_ms` per run
    (the host's reads), `update_ms` at each branch's first run after the first (its command buffer's update), which
    the rule prices at `price_ms` (None: update_ms; the engine measures it as a call's fixed cost)."""
    price_ms = update_ms if price_ms is None else price_ms
    jmax = max(steps)
    cost_N = jnp.asarray([cost_ms[k] for k in steps], jnp.float32)
    hits, trials = np.zeros(jmax, np.float32), np.zeros(jmax, np.float32)
    hits[0], trials[0] = adaptive.PRIOR_START * policy.prior, adaptive.PRIOR_START
    keep = 1.0 - policy.ema
    width = policy.backlog_on("gpu")  # the replay prices an accelerator's cycles, whatever machine runs it
    backlog = []  # probe outcomes of the plain steps not yet caught up
    g, t, cycles, ks = 1, 0.0, 0, []
    explore_next, gap, last_rule = policy.explore_every - 1, policy.explore_every, -1
    n_zero = sum(1 for k in steps if k == 0)
    used = set()

    def rates(h, tr):
        return acceptance_rates(jnp.asarray(h)[None], jnp.asarray(tr)[None], policy.prior)

    def choose(acc_BJ):  # as the engine's decisions: E[tokens | K] not cut, a branch's first run priced
        rate_N, _ = throughput(acc_BJ, cost_N, jnp.asarray([True]), None, steps)
        time_N = (total - g) / np.maximum(np.asarray(rate_N), 1e-30) + np.asarray(
            [price_ms if used and i not in used else 0.0 for i in range(len(steps))])
        return int(np.argmin(time_N)), time_N

    while g < total:
        acc = rates(hits, trials)
        rule, _ = choose(acc)
        hopeful, _ = choose(optimistic(acc))
        if not policy.probe:
            hopeful = max(hopeful, n_zero)
        exploring = cycles >= explore_next
        choice = hopeful if exploring else rule
        single = exploring and hopeful != rule
        k = steps[choice]
        t += switch_ms
        if choice not in used:  # a branch's first run in the call: the host updates its command buffer
            t += update_ms if used else 0.0
            used.add(choice)
        if (k == 0 and len(backlog) >= width) or (k > 0 and backlog):  # the catch-up and its observations of c_1
            for obs in backlog if policy.probe else ():
                hits[0], trials[0] = keep * hits[0] + obs, keep * trials[0] + 1.0
            backlog = []
        ran = 0
        while g < total:
            if k == 0:
                backlog.append(float(n_G[g] >= 1))
                g += 1
            else:
                a = min(k, n_G[g])
                for j in range(min(a + 1, k)):
                    hits[j], trials[j] = keep * hits[j] + float(j < a), keep * trials[j] + 1.0
                g += a + 1
            t += cost_ms[k]
            ks.append(k)
            ran += 1
            cycles += 1
            if single or g >= total:
                break
            _, time_N = choose(rates(hits, trials))
            kept = ran < policy.stretch or time_N[choice] <= (1.0 + policy.hysteresis) * time_N.min()
            no_trial = cycles < explore_next or choose(optimistic(rates(hits, trials)))[0] == choice
            if not (kept and no_trial and (k > 0 or len(backlog) < width)):
                break
        rule_after, _ = choose(rates(hits, trials))
        changed = rule != last_rule
        if changed:
            gap = policy.explore_every
        if exploring and (hopeful == rule or rule_after == rule):
            gap = min(2 * gap, policy.explore_every * EXPLORE_BACKOFF)
        if exploring or changed:
            explore_next = cycles - ran + gap
        last_rule = rule
    return Replay((total - 1) / t * 1e3, ks)


POLICIES = {
    "default": AdaptivePolicy(),
    "ema1/16": AdaptivePolicy(ema=1 / 16),
    "hyst0": AdaptivePolicy(hysteresis=0.0),
    "hyst0.1": AdaptivePolicy(hysteresis=0.1),
    "stretch8": AdaptivePolicy(stretch=8),
    "stretch8+hyst0.1": AdaptivePolicy(stretch=8, hysteresis=0.1),
    "stretch8+ema1/16": AdaptivePolicy(stretch=8, ema=1 / 16),
    "stretch12": AdaptivePolicy(stretch=12),
    "stretch16": AdaptivePolicy(stretch=16),
    "stretch8+explore32": AdaptivePolicy(stretch=8, explore_every=32),
    "stretch8+backlog16": AdaptivePolicy(stretch=8, backlog=16),
    "prior0.9": AdaptivePolicy(prior=0.9),
}


def replay(args) -> None:
    data = json.loads(Path(args.oracle).read_text())
    measured = json.loads(Path(args.device_run).read_text())
    by_prompt = {p["prompt"]: p for p in measured["prompts"]}
    cost_ms = {int(k): v for k, v in next(iter(measured["prompts"]))["runs"]["adaptive"]["costs_ms"].items()}
    steps = tuple(sorted(cost_ms))
    names = list(POLICIES) if not args.policies else args.policies
    worst = {n: [] for n in names}
    for p in data["prompts"]:
        # n_G[g]: N of the cycle that starts after g tokens, the oracle's row g - 1 (its prefill emits token g)
        n_G, total = [0] + p["accept"], len(p["tokens"])
        dev = by_prompt.get(p["prompt"])
        plain_ms = 1e3 / dev["runs"]["baseline"]["tokens_per_s"] if dev else cost_ms[0]
        fixed = {k: replay_fixed(n_G, total, k, {**cost_ms, 0: plain_ms}).tokens_per_s for k in steps}
        best = max(v for k, v in fixed.items())
        line = f"{p['kind']:6s} {p['prompt'][:20]!r:24s} fixed " + " ".join(
            f"K{k} {v / fixed[0]:.2f}x" for k, v in fixed.items() if k)
        if dev:
            line += " | device " + " ".join(f"{n} {s:.2f}x" for n, s in dev["summary"]["speedup"].items()
                                            if n.startswith("K="))
        print(line)
        for name in names:
            r = replay_rule(n_G, total, cost_ms, POLICIES[name], steps, args.switch_ms, args.update_ms)
            worst[name].append(r.tokens_per_s / best)
            hist = {k: r.k_log.count(k) for k in steps}
            print(f"      {name:18s} {r.tokens_per_s / fixed[0]:.2f}x  / best {r.tokens_per_s / best:.3f}  {hist}")
    print("worst / median adaptive over best fixed K:")
    for name in names:
        print(f"  {name:18s} {min(worst[name]):.3f} / {float(np.median(worst[name])):.3f}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.adaptive_replay", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("oracle", help="measure N[g] for every prompt with the engine")
    o.add_argument("--depth", type=int, default=8)
    o.add_argument("--max-new-tokens", type=int, default=128)
    o.add_argument("--dtype", default="float32")
    o.add_argument("--out", required=True)
    r = sub.add_parser("replay", help="replay fixed K and the rule's policies over N[g]")
    r.add_argument("--oracle", required=True)
    r.add_argument("--device-run", required=True, help="an adaptive-prompts-*.json (its cost table and speed-ups)")
    r.add_argument("--switch-ms", type=float, default=0.2, help="price of a change of K (host reads)")
    r.add_argument("--update-ms", type=float, default=1.5,
                   help="price of a branch's first run in a call after the first branch's (a graph update)")
    r.add_argument("--policies", nargs="*", choices=list(POLICIES))
    r.add_argument("--prior-start", type=float, default=adaptive.PRIOR_START)
    a = p.parse_args(argv)
    if a.cmd == "replay":
        adaptive.PRIOR_START = a.prior_start  # a lab's tuning knob: the engine's constant
    oracle(a) if a.cmd == "oracle" else replay(a)


if __name__ == "__main__":
    main()
