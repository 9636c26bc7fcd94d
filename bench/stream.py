"""`python -m bench.stream`: what the engine's own decode loops cost per cycle on a Kimi-K2.5-shaped model of N
layers (real dims, INT4 experts, random weights, a K2.5-shaped one-layer EAGLE-3 draft), greedy.

Three ways the engine runs the same cycles, each timed by its own `decode_s` (wall time of the decode phase):
- `generate`: every cycle inside one jitted `lax.while_loop`, one host round trip in all;
- `stream`: the streaming path `python -m jaxspec.generate` takes, pipelined (one cycle queued on the device
  behind the one the host waits for);
- `stream_one_by_one`: streaming with one host round trip per cycle (`Engine.stream(pipelined=False)`, what
  streaming did before the pipeline).
Per mode: the median over `--repeats` runs after one warm-up run, of ms per cycle and tokens per second, for
speculation with each K and for the baseline (no speculation). With random weights the draft is seldom
accepted, so a cycle emits about one token: the figures are the cost of a cycle, not a speed-up.
Writes stream-<device>-<date>.json and .md to --out.
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
import numpy as np  # noqa: E402

from bench.cycle import spec_pair  # noqa: E402
from bench.report import publish, run_stamp  # noqa: E402
from bench.step import random_model  # noqa: E402
from jaxspec.engine import Engine  # noqa: E402

MODES = ("generate", "stream", "stream_one_by_one")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--k", type=int, nargs="+", default=[3], help="draft steps per cycle (0 = the baseline only)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="small dims (CPU smoke run)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    for flag, v, least in (("--layers", args.layers, 3), ("--repeats", args.repeats, 1),
                           ("--prompt-tokens", args.prompt_tokens, 1), ("--max-new-tokens", args.max_new_tokens, 2),
                           ("--batch", args.batch, 1)):
        if v < least:
            p.error(f"{flag} must be >= {least}, got {v}")
    if any(k < 0 for k in args.k):
        p.error(f"--k takes draft steps >= 0, got {args.k}")
    return args


def run_mode(engine: Engine, mode: str, prompts, max_new: int, speculative: bool):
    """One generation; returns its GenerationResult (the stream's final event)."""
    if mode == "generate":
        return engine.generate(prompts, max_new, speculative=speculative)
    events = list(engine.stream(prompts, max_new, speculative=speculative, pipelined=mode == "stream"))
    return events[-1]


def time_modes(engine: Engine, prompts, max_new: int, speculative: bool, repeats: int, log) -> dict:
    rows, tokens = {}, None
    for mode in MODES:
        run_mode(engine, mode, prompts, max_new, speculative)  # compiles, warms up
        runs = [run_mode(engine, mode, prompts, max_new, speculative) for _ in range(repeats)]
        if tokens is None:
            tokens = runs[0].tokens
        same = all(r.tokens == tokens for r in runs)
        ms = [1e3 * r.decode_s / r.cycles for r in runs]
        tps = [r.decode_tokens_per_s for r in runs]
        rows[mode] = dict(ms_per_cycle=statistics.median(ms), ms_per_cycle_runs=ms,
                          prefill_ms=statistics.median(1e3 * r.prefill_s for r in runs),
                          tokens_per_s=statistics.median(tps), cycles=runs[0].cycles,
                          tokens=sum(len(t) for t in runs[0].tokens), same_tokens_as_generate=same)
        log(f"  {mode:18s} {rows[mode]['ms_per_cycle']:.3f} ms/cycle ({', '.join(f'{m:.3f}' for m in ms)}), "
            f"{rows[mode]['tokens_per_s']:.1f} tok/s, {runs[0].cycles} cycles, tokens as generate's: {same}")
    return rows


def markdown(result: dict) -> str:
    lines = [f"# Engine loops: {result['device']}, jax {result['jax']}, {result['date']}", "",
             f"{result['layers']} layers (Kimi-K2.5 dims{', tiny' if result['tiny'] else ''}, INT4 experts, random "
             f"weights), batch {result['batch']}, prompt {result['prompt_tokens']} tokens, "
             f"{result['max_new_tokens']} new tokens, greedy; median of {result['repeats']} runs after a warm-up.",
             "", "| decoding | generate (device loop) ms/cycle | stream, pipelined | stream, one round trip a cycle "
             "| pipelined / device loop | one-by-one / device loop |", "|---|---|---|---|---|---|"]
    for name, rows in result["runs"].items():
        g, s, o = (rows[m]["ms_per_cycle"] for m in MODES)
        lines.append(f"| {name} | {g:.3f} | {s:.3f} | {o:.3f} | {s / g:.2f} | {o / g:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    stamp = run_stamp()
    dev = stamp.device
    t0 = time.perf_counter()
    cfg, w = random_model(args.layers, args.tiny)
    spec_cfg, _, sw = spec_pair(w, cfg, args.tiny)
    jax.block_until_ready(sw.draft)
    log(f"device {dev.device_kind}, jax {jax.__version__}; weights: {args.layers} layers in "
        f"{time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, args.prompt_tokens).tolist() for _ in range(args.batch)]
    result = dict(**stamp.fields,
                  layers=args.layers, tiny=args.tiny, batch=args.batch, prompt_tokens=args.prompt_tokens,
                  max_new_tokens=args.max_new_tokens, repeats=args.repeats, runs={})
    for k in sorted(set(args.k)):
        engine = Engine(spec_cfg, sw, num_steps=k)
        name = f"speculative K={k}" if k else "baseline (no speculation)"
        log(name)
        result["runs"][name] = time_modes(engine, prompts, args.max_new_tokens, k > 0, args.repeats, log)
    if 0 not in args.k:  # the baseline beside every run
        log("baseline (no speculation)")
        engine = Engine(spec_cfg, sw, num_steps=0)
        result["runs"]["baseline (no speculation)"] = time_modes(engine, prompts, args.max_new_tokens, False,
                                                                 args.repeats, log)
    out = Path(args.out)
    stem = f"stream-{stamp.suffix}"
    publish(result, out, stem, markdown, log)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
