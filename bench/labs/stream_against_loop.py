"""`python -m bench.labs.stream_against_loop`: what streaming costs over the device loop on the embedded pair.

`python -m jaxspec.generate` streams by default: one cycle a call, one cycle queued behind the one the host reads
(`Engine.stream`). On a small model a cycle is a fraction of a millisecond, so the host's read of each cycle's
progress can set the pace. Per engine (plain decoding, fixed K = 3 and 4, adaptive by call), one prompt, greedy:
the decode ms of `Engine.generate` (the device loop) and of `Engine.stream` (pipelined), median and spread over
--rounds interleaved rounds after a warm-up. Writes stream-against-loop-<device>-<date>.json and .md to --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax.numpy as jnp

from bench.adaptive_prompts import PROMPTS, encode, load_pair
from bench.report import publish, run_stamp
from jaxspec.adaptive_calls import PerCallPolicy
from jaxspec.engine import Engine


def decode_ms(engine: Engine, prompt, n: int, speculative: bool, streamed: bool) -> float:
    if streamed:
        return 1e3 * list(engine.stream([prompt], n, speculative=speculative))[-1].decode_s
    return 1e3 * engine.generate([prompt], n, speculative=speculative).decode_s


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.stream_against_loop", description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, default=3, help=f"index into bench.adaptive_prompts' {len(PROMPTS)} prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--tag", default="", help="a label for this run's code (e.g. before / after)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    cfg, w, tok = load_pair(jnp.dtype(args.dtype))
    prompt = encode(tok, PROMPTS[args.prompt][1])
    n = args.max_new_tokens
    engines = {"plain": (Engine(cfg, w, num_steps=4), False), "K=3": (Engine(cfg, w, num_steps=3), True),
               "K=4": (Engine(cfg, w, num_steps=4), True),
               "adaptive": (Engine(cfg, w, num_steps=4, adaptive=PerCallPolicy()), True)}
    variants = [(name, streamed) for name in engines for streamed in (False, True)]
    for name, streamed in variants:  # compile, measure the cost tables, warm up
        decode_ms(engines[name][0], prompt, n, engines[name][1], streamed)
    times = {v: [] for v in variants}
    for r in range(args.rounds):
        for name, streamed in (variants if r % 2 == 0 else variants[::-1]):
            times[(name, streamed)].append(decode_ms(engines[name][0], prompt, n, engines[name][1], streamed))
    rows = {}
    for name in engines:
        loop, stream = times[(name, False)], times[(name, True)]
        rows[name] = dict(loop_ms=statistics.median(loop), loop_range=[min(loop), max(loop)],
                          stream_ms=statistics.median(stream), stream_range=[min(stream), max(stream)],
                          stream_over_loop=statistics.median(stream) / statistics.median(loop))
        r = rows[name]
        log(f"{args.tag} {name}: loop {r['loop_ms']:.3f} ms, stream {r['stream_ms']:.3f} ms "
            f"({r['stream_over_loop']:.3f}x)")
    stamp = run_stamp()
    result = dict(**stamp.fields, tag=args.tag, prompt=PROMPTS[args.prompt][1], max_new_tokens=n,
                  rounds=args.rounds, dtype=args.dtype, rows=rows)

    def markdown(res):
        lines = [f"# Streaming against the device loop ({res['tag']}): {res['device']}, {res['date']}", "",
                 f"Embedded pair ({res['dtype']}), prompt {res['prompt'][:24]!r}, {res['max_new_tokens']} tokens, "
                 f"decode ms, median of {res['rounds']} interleaved rounds.", "",
                 "| engine | device loop | range | streamed | range | streamed / loop |", "|---|---|---|---|---|---|"]
        lines += [f"| {name} | {r['loop_ms']:.3f} | {r['loop_range'][0]:.3f}-{r['loop_range'][1]:.3f} | "
                  f"{r['stream_ms']:.3f} | {r['stream_range'][0]:.3f}-{r['stream_range'][1]:.3f} | "
                  f"{r['stream_over_loop']:.3f} |" for name, r in res["rows"].items()]
        return "\n".join(lines) + "\n"

    publish(result, Path(args.out), f"stream-against-loop-{stamp.suffix}", markdown, log)


if __name__ == "__main__":
    main(sys.argv[1:])
