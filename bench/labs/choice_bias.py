"""`python -m bench.labs.choice_bias`: how well the by-call rule's acceptance estimate, made from the cycles of one K,
predicts what another K would emit a cycle, on the embedded pair's ten prompts (issue 53's choice between K = 3 and
K = 4).

Each fixed K from 1 to --k-max generates every prompt once (greedy, --max-new-tokens), which gives its acceptance
log. Per prompt and per pair (K the log ran, K' predicted): the rule's estimate of E[tokens a cycle | K'] from that
log alone (`window_counts` over the whole generation, `acceptance_BJ` with no pool), against the tokens a cycle the
K' run itself emitted (1 + its mean accepted drafts). E[K'] for K' < K rests on positions the log observed; K' > K
extrapolates the unobserved depths from the shallower ones. Also per K: the first draft's acceptance in cycles that
follow a cycle which accepted every draft, and in cycles that follow a rejection; a gap between the two is
acceptance that runs in stretches, which the rule's model of independent positions does not hold. And the ratio the
choice between the two deepest K turns on, E[K] / E[K - 1], as the rule's model and a two-state model
(`estimate_E_two_state`) read it from each of the two runs, against the measured ratio.

The token streams are the same at every K wherever greedy decoding's output is (bf16 on a CPU and on a GPU can part
after a near tie), so a CPU run answers for the GPU's bench up to such partings. Writes choice-bias-<device>-<date>
.json and .md to --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from bench.adaptive_prompts import PROMPTS, encode, load_pair
from bench.report import publish, run_stamp
from jaxspec.adaptive_calls import acceptance_BJ, expected_tokens_BN, window_counts
from jaxspec.adaptive_calls_run import NO_LIMIT
from jaxspec.engine import Engine


def estimate_E(log: list[int], k: int, k_max: int, prior: float = 0.7) -> list[float]:
    """E[tokens a cycle | K'] for K' = 1..k_max, from one generation's acceptance log at K = k alone."""
    log_BC = np.asarray([log], np.int32)
    hits, trials = window_counts(log_BC, 0, log_BC.shape[1], k, k_max, NO_LIMIT)
    zeros = np.zeros(k_max, np.float32)
    c_BJ = acceptance_BJ(hits, trials, zeros, zeros, np.float32(prior))
    return [float(e) for e in expected_tokens_BN(c_BJ, tuple(range(1, k_max + 1)))[0]]


def estimate_E_two_state(log: list[int], k: int, kp: int, prior: float = 0.7) -> float:
    """E[tokens a cycle | K'] from one generation's log at K = k under a two-state model: per-position acceptances
    counted apart for cycles after one that accepted at least K' drafts (a full cycle at K') and after one that
    did not (the generation's first cycle counts as after a full one), the states' shares those of the chain whose
    next state is full with each state's probability of K' acceptances."""
    log_BC = np.asarray([log], np.int32)
    after_full = np.concatenate([[True], log_BC[0, :-1] >= kp])
    zeros = np.zeros(kp, np.float32)
    e_S, p_S = [], []
    for rows in (after_full, ~after_full):
        sub = np.where(rows[None], log_BC, -1)  # -1: a cycle the state did not run
        hits, trials = window_counts(sub, 0, sub.shape[1], k, kp, NO_LIMIT)
        c_J = acceptance_BJ(hits, trials, zeros, zeros, np.float32(prior))[0]
        e_S.append(float(expected_tokens_BN(c_J[None], (kp,))[0, 0]))
        p_S.append(float(np.prod(c_J)))
    share_full = p_S[1] / (1.0 - p_S[0] + p_S[1])
    return share_full * e_S[0] + (1.0 - share_full) * e_S[1]


def first_draft_after(log: list[int], k: int) -> dict:
    """The first draft's acceptance in cycles after a cycle that accepted all k drafts, and after one that did not:
    {"after_full": [accepted, cycles], "after_reject": [...]}."""
    out = {"after_full": [0, 0], "after_reject": [0, 0]}
    for prev, cur in zip(log[:-1], log[1:]):
        slot = out["after_full" if prev == k else "after_reject"]
        slot[0] += int(cur >= 1)
        slot[1] += 1
    return out


def analyse(logs_by_k: dict[int, list[int]]) -> dict:
    """One prompt's table: measured tokens a cycle per K, each K's log's estimates, and their errors."""
    k_max = max(logs_by_k)
    measured = {k: 1.0 + float(np.mean(log)) for k, log in logs_by_k.items()}
    estimates = {k: estimate_E(log, k, k_max) for k, log in logs_by_k.items()}
    errors = {f"{k}->{kp}": estimates[k][kp - 1] / measured[kp] - 1.0
              for k in logs_by_k for kp in logs_by_k if kp != k}
    # E[K] / E[K - 1] for the deepest K, as each model reads it from each of the two runs, over the measured ratio
    top = k_max
    ratio = measured[top] / measured[top - 1]
    two_state = {k: estimate_E_two_state(log, k, top) / estimate_E_two_state(log, k, top - 1)
                 for k, log in logs_by_k.items() if k >= top - 1}
    ratio_errors = {f"independent from {k}": estimates[k][top - 1] / estimates[k][top - 2] / ratio - 1.0
                    for k in logs_by_k if k >= top - 1}
    ratio_errors.update((f"two-state from {k}", r / ratio - 1.0) for k, r in two_state.items())
    return dict(measured=measured, estimates=estimates, errors=errors, ratio_errors=ratio_errors,
                first_draft={k: first_draft_after(log, k) for k, log in logs_by_k.items()})


def summarise(rows: list[dict]) -> dict:
    """Mean and range of each (K -> K') error over the prompts, and the pooled first-draft acceptances."""
    def spread(key):
        return {p: dict(mean=statistics.mean(r[key][p] for r in rows), low=min(r[key][p] for r in rows),
                        high=max(r[key][p] for r in rows)) for p in rows[0][key]}

    errors, ratio_errors = spread("errors"), spread("ratio_errors")
    pooled = {}
    for r in rows:
        for k, after in r["first_draft"].items():
            for which, (hit, n) in after.items():
                slot = pooled.setdefault(str(k), {}).setdefault(which, [0, 0])
                slot[0] += hit
                slot[1] += n
    return dict(errors=errors, ratio_errors=ratio_errors,
                first_draft={k: {w: (h / n if n else None) for w, (h, n) in v.items()} for k, v in pooled.items()})


def markdown(res: dict) -> str:
    lines = [f"# The rule's estimate from one K's cycles against another K: {res['device']}, {res['date']}", "",
             f"Embedded pair ({res['dtype']}), {res['max_new_tokens']} tokens, greedy, each K once per prompt. "
             "E: tokens a cycle; est(K -> K'): the rule's estimate of E[K'] from the K run's log alone.", "",
             "| prompt | " + " | ".join(f"E[{k}]" for k in res["ks"]) + " | est(3 -> 4) | est(4 -> 3) |",
             "|---|" + "---|" * (len(res["ks"]) + 2)]
    for r in res["prompts"]:
        a = r["analysis"]
        cells = [f"{a['measured'][k]:.3f}" for k in res["ks"]]
        est = [f"{a['estimates'][src][dst - 1]:.3f}" if src in a["estimates"] and dst in a["measured"] else "-"
               for src, dst in ((3, 4), (4, 3))]
        lines.append(f"| {r['prompt'][:24]!r} | " + " | ".join(cells + est) + " |")
    lines += ["", "| K -> K' | mean error | range |", "|---|---|---|"]
    for pair, e in res["summary"]["errors"].items():
        lines.append(f"| {pair} | {e['mean']:+.3f} | {e['low']:+.3f} .. {e['high']:+.3f} |")
    top = res["ks"][-1]
    lines += ["", f"E[{top}] / E[{top - 1}] as each model reads it from one run, over the measured ratio:", "",
              "| model, run | mean error | range |", "|---|---|---|"]
    for name, e in res["summary"]["ratio_errors"].items():
        lines.append(f"| {name} | {e['mean']:+.3f} | {e['low']:+.3f} .. {e['high']:+.3f} |")
    lines += ["", "| K | first draft accepted after a full cycle | after a rejection |", "|---|---|---|"]
    for k, v in res["summary"]["first_draft"].items():
        fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        lines.append(f"| {k} | {fmt(v['after_full'])} | {fmt(v['after_reject'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.choice_bias", description=__doc__.split("\n")[0])
    p.add_argument("--k-max", type=int, default=4)
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.k_max < 2:
        p.error("--k-max must be at least 2 (one K predicting another)")
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    stamp = run_stamp()
    cfg, w, tok = load_pair(jnp.dtype(args.dtype))
    ks = list(range(1, args.k_max + 1))
    engines = {k: Engine(cfg, w, num_steps=k) for k in ks}
    rows = []
    for _, text in PROMPTS[: args.prompts]:
        prompt = encode(tok, text)
        logs = {k: engines[k].generate([prompt], args.max_new_tokens).accepted[0] for k in ks}
        rows.append(dict(prompt=text, logs=logs, analysis=analyse(logs)))
        log(f"{text[:24]!r}: " + ", ".join(f"K={k} {len(v)} cycles" for k, v in logs.items()))
    result = dict(**stamp.fields, dtype=args.dtype, max_new_tokens=args.max_new_tokens, ks=ks, prompts=rows,
                  summary=summarise([r["analysis"] for r in rows]))
    publish(result, Path(args.out), f"choice-bias-{stamp.suffix}", markdown, log)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
