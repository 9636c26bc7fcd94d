"""`python -m bench.prefix_reuse`: a long prompt's time to its first token when the server's prefix cache holds
all but its end, against the same server prefilling it from scratch.

A server is started in this process (the embedded pair by default). Each round sends a new prompt of
`--prompt-tokens` token ids (a miss: nothing cached starts like it), then a prompt that repeats its first
`--prompt-tokens - --new-tokens` ids and ends with `--new-tokens` new ones (a chat's next turn, an agent's next
call: the cache holds the whole pages of the shared part). Both ask for one greedy token; the time is from sending
to the answer. The server is warmed first with prompts of the same lengths, so every program is compiled. Rounds
report the median and the spread; `--no-reuse` runs the same rounds with the cache off, so the "hit" is prefilled
too. Writes prefix-reuse-<device>-<date>.json and .md to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from bench.report import fmt, publish
from jaxspec.serve import _check, build_parser, build_service
from jaxspec.serving.background import BackgroundServer


async def _first_token_s(client, model, ids: list[int]) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = await client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0)
    return time.perf_counter() - t0, out.choices[0].text


def prompts(rng, vocab: int, length: int, new: int) -> tuple[list[int], list[int]]:
    """(a prompt nothing cached starts like, the prompt that shares all but its last `new` ids with it)."""
    first = [int(t) for t in rng.integers(1, vocab - 1, size=length)]
    return first, first[: length - new] + [int(t) for t in rng.integers(1, vocab - 1, size=new)]


async def measure(base_url, model, vocab, rounds: int, length: int, new: int, seed: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=900)
    rng = np.random.default_rng(seed)
    for ids in prompts(rng, vocab, length, new):  # warm-up: every program a round takes
        await _first_token_s(client, model, ids)
    misses, hits = [], []
    for _ in range(rounds):
        miss_ids, hit_ids = prompts(rng, vocab, length, new)
        misses.append((await _first_token_s(client, model, miss_ids))[0])
        hits.append((await _first_token_s(client, model, hit_ids))[0])
    await client.close()
    miss, hit = statistics.median(misses), statistics.median(hits)
    return dict(miss_s=miss, hit_s=hit, ratio=hit / miss, miss_range_s=[min(misses), max(misses)],
                hit_range_s=[min(hits), max(hits)], misses_s=misses, hits_s=hits)


def markdown(result: dict) -> str:
    lines = [f"# Time to the first token with a cached prefix: {result['device']}, {result['date']}", "",
             f"{result['model']} ({result['dtype']}), prefill chunk {result['prefill_chunk']}; per round a new "
             f"{result['prompt_tokens']}-token prompt (miss), then one sharing all but its last "
             f"{result['new_tokens']} tokens (hit). Seconds from sending to the answer of one greedy token, median "
             f"of {result['rounds']} rounds [min, max].", "",
             "| prefix cache | miss | hit | hit / miss |", "|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['prefix_cache']} | {fmt(r['miss_s'], 3)} [{fmt(r['miss_range_s'][0], 3)}, "
                     f"{fmt(r['miss_range_s'][1], 3)}] | {fmt(r['hit_s'], 3)} [{fmt(r['hit_range_s'][0], 3)}, "
                     f"{fmt(r['hit_range_s'][1], 3)}] | {fmt(r['ratio'], 2)} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.prefix_reuse", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default=None, help="converted target (default: the embedded pair)")
    p.add_argument("--draft", default=None)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=24, help="ids at the end of the hit prompt that are new")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--prefill-chunk", type=int, default=None, help="serve's --prefill-chunk (default: its own)")
    p.add_argument("--speculative-num-steps", type=int, default=4)
    p.add_argument("--no-reuse", action="store_true", help="also run the rounds with the prefix cache off")
    a = p.parse_args(argv)
    result = dict(device=jax.devices()[0].device_kind, date=datetime.date.today().isoformat(), dtype=a.dtype,
                  model=a.model or "the embedded pair", prompt_tokens=a.prompt_tokens, new_tokens=a.new_tokens,
                  rounds=a.rounds, rows=[])
    for cache_tokens in ([None, 0] if a.no_reuse else [None]):
        argv = ["--dtype", a.dtype, "--max-batch", "2", "--max-context", str(a.max_context),
                "--speculative-num-steps", str(a.speculative_num_steps), "--warmup-buckets", "16",
                "--no-speculative-adaptive"]
        argv += ["--prefill-chunk", str(a.prefill_chunk)] if a.prefill_chunk else []
        argv += ["--prefix-cache-tokens", str(cache_tokens)] if cache_tokens is not None else []
        argv += ["--model", a.model] if a.model else []
        argv += ["--draft", a.draft] if a.draft else []
        sa = build_parser().parse_args(argv)
        service = build_service(sa, *_check(sa), log=lambda msg: None)
        result["prefill_chunk"] = service.engine.prefill_chunk
        label = f"{service.engine.prefix.num_pages} pages" if service.engine.prefix.num_pages else "off"
        with BackgroundServer(service) as server:
            row = asyncio.run(measure(server.base_url, service.model_name, service.engine.cfg.target.vocab_size,
                                      a.rounds, a.prompt_tokens, a.new_tokens, seed=0))
        result["rows"].append(dict(prefix_cache=label, **row))
        print(f"prefix cache {label}: miss {row['miss_s']:.3f} s, hit {row['hit_s']:.3f} s "
              f"(x{row['ratio']:.2f})", flush=True)
    publish(result, a.out, f"prefix-reuse-{jax.devices()[0].platform}-{result['date']}", markdown, print)
    return result


if __name__ == "__main__":
    main()
