"""`python -m bench.adaptive_prompts`: the embedded pair (jaxspec/default_model) on prompts of mixed predictability
(code, prose, random characters) for plain decoding, each fixed K and adaptive speculation, greedy, one prompt at a
time, every cycle in the engine's on-device loop (`Engine.generate`).

Per prompt and configuration: the median over --repeats of decode tokens per second after one warm-up run (the
warm-up also measures adaptive's cost table, outside the timed runs), the configurations run in rounds of one
generation each in rotated order, the mean acceptance length, adaptive's K
histogram and its expected against achieved tokens per second; then each configuration's speed-up over plain
decoding, the best fixed K and adaptive / best. Beside it, what the bench's own noise gives an engine that IS the
best fixed K (`best_copy_over_best`): the best fixed engine's median over half the rounds against the best median of
the other half, as adaptive's one engine is scored against the best of several. Writes
adaptive-prompts-<device>-<date>.json and .md to --out.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.projection import load_json  # noqa: E402
from bench.report import publish, run_stamp  # noqa: E402
from bench.timing import paired_ratio  # noqa: E402
from convert.checkpoint import load_draft, load_target  # noqa: E402
from jaxspec.adaptive import AdaptivePolicy  # noqa: E402
from jaxspec.adaptive_calls import PerCallPolicy  # noqa: E402
from jaxspec.defaults import ADAPTIVE_KINDS, default_adaptive_kind  # noqa: E402
from jaxspec.engine import Engine  # noqa: E402
from jaxspec.cli_common import DEFAULT_MODEL_DIR  # noqa: E402
from jaxspec.models import SpecConfig, SpecWeights, check_draft_fits  # noqa: E402
from jaxspec.tokenizer import load_tokenizer  # noqa: E402

# (kind, text): the embedded pair was trained on code and English prose; the random strings are its worst case
PROMPTS = (  # kinds interleaved, so --prompts 3 takes one of each
    ("code", "def fibonacci(n):\n"),
    ("prose", "The history of the city begins"),
    ("random", "x7#qP!vz@3Lk9%Tm&2Rw^8Ys*4Nd(6Hj"),
    ("code", "import numpy as np\n\n\ndef softmax(x):\n    "),
    ("prose", "Once upon a time, in a small village by the sea, there lived"),
    ("random", "QZ ww 0x9f kk_p ;; ~~ 771 vRt !? jjj ^^ 42b"),
    ("code", "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"),
    ("prose", "In this paper we propose a new method for"),
    ("random", "8c1e 4f0a 9b2d e7c3 a5f6 0d8b 3e9a c4f1"),
    ("code", "for i in range(10):\n    print("),
)


def load_pair(dtype):
    model_dir = DEFAULT_MODEL_DIR / "target"
    cfg, tw = load_target(model_dir, dtype=dtype)
    dcfg, dw = load_draft(DEFAULT_MODEL_DIR / "draft", dtype=dtype)
    cfg = check_draft_fits(cfg, dcfg, dw)
    tok = load_tokenizer(model_dir)
    eos = tuple(sorted({*cfg.eos_token_id} | ({tok.token_id("eos_token")} - {None})))
    return SpecConfig(cfg, dcfg, eos), SpecWeights(tw, dw), tok


def encode(tok, text: str) -> list[int]:
    ids = tok.encode(text)
    bos = tok.token_id("bos_token")
    return [bos] + ids if tok.config.get("add_bos_token") and bos is not None else ids


def time_engines(engines: dict, prompt: list[int], max_new: int, repeats: int) -> dict:
    """{name: row}: a warm-up run of each engine, then `repeats` rounds of one run each, the engines' order rotated
    every round (so a slow moment of the device or host falls on every engine alike); per engine the median decode
    tokens/s and its range, acceptance and adaptive figures of its last run. "baseline" decodes plainly."""
    names = list(engines)
    for name in names:
        engines[name].generate([prompt], max_new, speculative=name != "baseline")
    runs = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            runs[name].append(engines[name].generate([prompt], max_new, speculative=name != "baseline"))
    return {name: _row(runs[name], name != "baseline") for name in names}


def _row(runs: list, speculative: bool) -> dict:
    last = runs[-1]
    rates = [r.decode_tokens_per_s for r in runs]
    row = {"tokens_per_s": statistics.median(rates), "tokens_per_s_range": [min(rates), max(rates)],
           "tokens_per_s_rounds": rates, "tokens": last.tokens[0], "cycles": last.cycles}
    if speculative:
        row["mean_acceptance_length"] = last.stats.mean_acceptance_length if last.stats.cycles else None
    if last.adaptive is not None:
        row.update(k_histogram={str(k): n for k, n in last.adaptive.k_histogram.items()},
                   costs_ms={str(k): 1e3 * c for k, c in zip(last.adaptive.steps, last.adaptive.costs_s)},
                   first_run_ms=1e3 * last.adaptive.first_run_s, calls=last.adaptive.calls,
                   expected_tokens_per_s=last.adaptive.expected_tokens_per_s)
    return row


def best_copy_over_best(rounds_by_engine: dict) -> float | None:
    """What adaptive / best would read for an engine that runs the best fixed K at its cost, from the bench's own
    rounds: the rounds split in halves (even, odd), the engine with the best median over one half scored by its
    median over the other against that best, both ways, averaged. The best of several noisy medians is biased up,
    and one engine's median is not, so this is below 1 by the bench's noise alone. Halves are noisier than the
    whole, so it overstates that noise. None under 4 rounds."""
    if min(len(r) for r in rounds_by_engine.values()) < 4:
        return None
    scores = []
    for pick, score in ((0, 1), (1, 0)):
        medians = {name: statistics.median(r[pick::2]) for name, r in rounds_by_engine.items()}
        best = max(medians, key=medians.get)
        scores.append(statistics.median(rounds_by_engine[best][score::2]) / medians[best])
    return statistics.mean(scores)


def summarise(row: dict) -> dict:
    base = row["runs"]["baseline"]["tokens_per_s"]
    fixed = {name: r["tokens_per_s"] for name, r in row["runs"].items() if name.startswith("K=")}
    best = max(fixed, key=fixed.get)
    ad = row["runs"]["adaptive"]["tokens_per_s"]
    # the K adaptive ran most cycles at, and its engine: what adaptive reaches at the same K (its own cost apart from
    # its choice); None where no fixed engine of that K ran
    hist = row["runs"]["adaptive"].get("k_histogram") or {}
    ran = max(hist, key=lambda k: hist[k]) if hist else None
    same = None if ran is None else "baseline" if ran == "0" else f"K={ran}"
    same_tps = row["runs"][same]["tokens_per_s"] if same in row["runs"] else None
    rounds = {name: r.get("tokens_per_s_rounds") or [] for name, r in row["runs"].items()}
    return dict(speedup={name: r["tokens_per_s"] / base for name, r in row["runs"].items()}, best_fixed=best,
                adaptive_over_best=ad / fixed[best], adaptive_over_baseline=ad / base,
                adaptive_k=None if ran is None else int(ran),
                adaptive_over_same_k=None if same_tps is None else ad / same_tps,
                adaptive_over_best_paired=paired_ratio(rounds["adaptive"], rounds[best]),
                adaptive_over_same_k_paired=None if same_tps is None else paired_ratio(rounds["adaptive"],
                                                                                        rounds[same]),
                best_copy_over_best=best_copy_over_best({name: rounds[name] for name in fixed}),
                every_fixed_k_loses=all(v < base for v in fixed.values()))


def markdown(result: dict) -> str:
    names = [n for n in result["prompts"][0]["runs"] if n != "baseline"] if result["prompts"] else []
    lines = [
        f"# Adaptive speculation on the embedded pair: {result['device']}, jax {result['jax']}, {result['date']}", "",
        f"jaxspec/default_model ({result['dtype']}), adaptive {result.get('adaptive_kind', 'per_cycle')}, greedy, "
        f"{result['max_new_tokens']} new tokens, one prompt at a "
        f"time in the on-device loop; median of {result['repeats']} interleaved runs. Cells: speed-up over plain "
        "decoding (its tok/s in the first column).", "",
        "| prompt | kind | plain tok/s | " + " | ".join(names) + " | best fixed | adaptive / best | adaptive / "
        "fixed at its K | the two, paired by round | adaptive K histogram |",
        "|---" * (len(names) + 8) + "|",
    ]
    for row in result["prompts"]:
        s = row["summary"]
        same = s.get("adaptive_over_same_k")
        paired = [s.get("adaptive_over_best_paired"), s.get("adaptive_over_same_k_paired")]
        lines.append(f"| {row['prompt'][:24]!r} | {row['kind']} | {row['runs']['baseline']['tokens_per_s']:.1f} | "
                     + " | ".join(f"{s['speedup'][n]:.2f}x" for n in names)
                     + f" | {s['best_fixed']} | {s['adaptive_over_best']:.3f} | "
                       f"{'-' if same is None else f'{same:.3f}'} | "
                     + " / ".join("-" if x is None else f"{x:.3f}" for x in paired)
                     + f" | {row['runs']['adaptive']['k_histogram']} |")
    copies = [row["summary"].get("best_copy_over_best") for row in result["prompts"]]
    if copies and None not in copies:
        lines += ["", "The bench's own noise: the best fixed engine's median over half the rounds against the best "
                  f"median of the other half (`best_copy_over_best`): {min(copies):.3f}-{max(copies):.3f} "
                  f"(median {statistics.median(copies):.3f})."]
    lines += ["", "Paired by round: the median over rounds of adaptive's rate over the other engine's in the same "
              "round (`paired_ratio`)."]
    return "\n".join(lines) + "\n"


def add_totals(result: dict) -> None:
    """The figures over all prompts, from each prompt's summary."""
    rows = [r["summary"] for r in result["prompts"]]

    def present(key):
        return [s[key] for s in rows if s.get(key) is not None]

    result["worst_adaptive_over_best"] = min(s["adaptive_over_best"] for s in rows)
    result["median_adaptive_over_same_k"] = statistics.median(present("adaptive_over_same_k") or [None])
    result["worst_adaptive_over_best_paired"] = min(present("adaptive_over_best_paired"), default=None)
    result["median_adaptive_over_same_k_paired"] = statistics.median(present("adaptive_over_same_k_paired") or [None])
    result["worst_best_copy_over_best"] = min(present("best_copy_over_best"), default=None)
    losing = [r for r in result["prompts"] if r["summary"]["every_fixed_k_loses"]]
    result["adaptive_over_baseline_where_every_k_loses"] = [r["summary"]["adaptive_over_baseline"] for r in losing]


def summarise_file(path: Path) -> dict:
    """A bench JSON's result with its summaries and totals computed again from its rounds (figures added since the
    run included): what `--summarise` prints. A file that cannot be read, or holds no bench.adaptive_prompts result,
    is one line naming it (SystemExit)."""
    result = load_json("--summarise", Path(path))
    try:
        if not result["prompts"]:
            raise ValueError("no prompts")
        for row in result["prompts"]:
            row["summary"] = summarise(row)
        add_totals(result)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SystemExit(f"--summarise {path}: not a bench.adaptive_prompts result ({type(e).__name__}: {e})") \
            from None
    return result


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.adaptive_prompts", description=__doc__.split("\n")[0])
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4], help="fixed K to time")
    p.add_argument("--adaptive-max", type=int, default=4,
                   help="largest K adaptive may choose (the policy's default set up to it)")
    p.add_argument("--adaptive-kind", choices=ADAPTIVE_KINDS, default=None,
                   help="per_call (fixed-K programs, K chosen between calls) or per_cycle (one program choosing K "
                        "every cycle); default: the backend's, as generate runs it")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--out", help="results folder (JSON, markdown)")
    p.add_argument("--summarise", type=Path, metavar="JSON",
                   help="print an earlier run's table again, its figures recomputed from its rounds; nothing runs")
    a = p.parse_args(argv)
    if (a.out is None) == (a.summarise is None):
        p.error("pass --out (a run) or --summarise JSON (an earlier run's table)")
    if any(k < 1 for k in a.k) or a.adaptive_max < 1:
        p.error("--k and --adaptive-max must be >= 1")
    if not 1 <= a.prompts <= len(PROMPTS):
        p.error(f"--prompts must be in 1..{len(PROMPTS)}")
    if a.max_new_tokens < 2 or a.repeats < 1:
        p.error("--max-new-tokens must be >= 2 and --repeats >= 1")
    return a


def main(argv=None):
    args = parse_args(argv)
    if args.summarise is not None:
        result = summarise_file(args.summarise)
        print(markdown(result), end="")
        return result
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    stamp = run_stamp()
    cfg, w, tok = load_pair(jnp.dtype(args.dtype))
    engines = {"baseline": Engine(cfg, w, num_steps=max(args.k))}
    engines.update({f"K={k}": Engine(cfg, w, num_steps=k) for k in sorted(set(args.k))})
    kind = args.adaptive_kind or default_adaptive_kind(jax.default_backend())
    policy = PerCallPolicy() if kind == "per_call" else AdaptivePolicy()
    engines["adaptive"] = Engine(cfg, w, num_steps=args.adaptive_max, adaptive=policy)
    result = dict(**stamp.fields,
                  adaptive_kind=kind, dtype=args.dtype, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                  prompts=[])
    for prompt_kind, text in PROMPTS[: args.prompts]:
        prompt = encode(tok, text)
        runs = time_engines(engines, prompt, args.max_new_tokens, args.repeats)
        lossless = all(r["tokens"] == runs["baseline"]["tokens"] for r in runs.values()) if args.dtype == "float32" \
            else None
        row = dict(prompt=text, kind=prompt_kind, prompt_tokens=len(prompt), runs=runs, same_tokens_as_plain=lossless)
        row["summary"] = summarise(row)
        result["prompts"].append(row)
        log(f"{prompt_kind} {text[:24]!r}: plain {runs['baseline']['tokens_per_s']:.1f} tok/s; "
            + ", ".join(f"{n} {s:.2f}x" for n, s in row["summary"]["speedup"].items() if n != "baseline")
            + f"; adaptive K {runs['adaptive'].get('k_histogram')}")
    add_totals(result)
    out = Path(args.out)
    stem = f"adaptive-prompts-{stamp.suffix}"
    publish(result, out, stem, markdown, log)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
