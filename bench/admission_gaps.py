"""`python -m bench.admission_gaps`: how long the streams a server is running wait while it admits a long prompt.

For each `--prefill-chunk` value a server is started in this process (the embedded pair by default) and `--streams`
streamed greedy completions are started; once every stream has emitted, a prompt of `--prompt-tokens` token ids
is sent. A prompt longer than the chunk is admitted a chunk at a time between device steps (the scheduler), so the
running streams keep emitting. Per stream, the gaps between the text chunks it received: the median gap before the
long prompt was sent, and the largest gap that overlaps its admission (from its sending to its first token); the
ratio of the two is the figure. Also the long prompt's time to its first token. Writes admission-gaps-<device>-<date>
.json and .md to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import statistics
import time
from pathlib import Path

import jax

from bench.report import fmt, publish
from jaxspec.serve import _check, build_parser, build_service
from jaxspec.serving.background import BackgroundServer

STREAM_PROMPTS = ["def fibonacci(n):\n", "import numpy as np\n\n", "class Stack:\n", "for i in range(10):\n",
                  "def main():\n", "while True:\n", "with open(path) as f:\n", "x = [1, 2, 3]\n"]


async def _stream(client, model, prompt, max_tokens, arrivals: list):
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True)
    async for chunk in stream:
        if any(c.text for c in chunk.choices):
            arrivals.append(time.perf_counter())


async def measure(base_url, model, streams: int, stream_tokens: int, long_ids: list[int]) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=900)
    arrivals = [[] for _ in range(streams)]
    tasks = [asyncio.create_task(_stream(client, model, STREAM_PROMPTS[i % len(STREAM_PROMPTS)], stream_tokens,
                                         arrivals[i])) for i in range(streams)]
    while not all(len(a) >= 4 for a in arrivals):  # every stream running, a few gaps each
        if any(t.done() for t in tasks):
            raise RuntimeError("a stream ended before the long prompt was sent: raise --stream-tokens")
        await asyncio.sleep(0.01)
    sent = time.perf_counter()
    long = await client.completions.create(model=model, prompt=long_ids, max_tokens=1, temperature=0)
    first = time.perf_counter()
    assert long.choices[0].text is not None
    await asyncio.gather(*tasks)
    await client.close()
    before, during = [], []
    for times in arrivals:
        for a, b in zip(times, times[1:]):
            if b <= sent:
                before.append(b - a)
            elif a < first:  # the gap overlaps the admission
                during.append(b - a)
    if not during:
        raise RuntimeError("no stream gap overlapped the admission: raise --stream-tokens")
    median = statistics.median(before)
    return dict(median_gap_s=median, largest_gap_during_s=max(during), ratio=max(during) / median,
                long_ttft_s=first - sent, gaps_before=len(before), gaps_during=len(during))


async def warm_up(base_url, model, long_ids: list[int]) -> None:
    """Every program a measured run takes (the admission's, a stream's) compiled before it."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=900)
    await client.completions.create(model=model, prompt=long_ids, max_tokens=1, temperature=0)
    await _stream(client, model, STREAM_PROMPTS[0], 16, [])
    await client.close()


def markdown(result: dict) -> str:
    lines = [f"# Running streams while a long prompt is admitted: {result['device']}, {result['date']}", "",
             f"{result['streams']} streamed greedy completions on {result['model']} ({result['dtype']}); a prompt of "
             f"{result['prompt_tokens']} tokens sent once all are running. Seconds.", "",
             "| prefill chunk | median gap before | largest gap during admission | ratio | long prompt TTFT |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['prefill_chunk']} | {fmt(r['median_gap_s'], 3)} | {fmt(r['largest_gap_during_s'], 3)} | "
                     f"{fmt(r['ratio'], 2)} | {fmt(r['long_ttft_s'], 2)} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.admission_gaps", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default=None, help="converted target (default: the embedded pair)")
    p.add_argument("--draft", default=None)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    p.add_argument("--prefill-chunks", type=int, nargs="+", default=[512, 128])
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--streams", type=int, default=6)
    p.add_argument("--stream-tokens", type=int, default=240)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--speculative-num-steps", type=int, default=4)
    a = p.parse_args(argv)
    result = dict(device=jax.devices()[0].device_kind, date=datetime.date.today().isoformat(), dtype=a.dtype,
                  model=a.model or "the embedded pair", streams=a.streams, prompt_tokens=a.prompt_tokens, rows=[])
    for chunk in a.prefill_chunks:
        argv = ["--dtype", a.dtype, "--max-batch", str(a.streams + 1), "--max-context", str(a.max_context),
                "--speculative-num-steps", str(a.speculative_num_steps), "--prefill-chunk", str(chunk),
                "--warmup-buckets", "16,32", "--no-speculative-adaptive"]
        argv += ["--model", a.model] if a.model else []
        argv += ["--draft", a.draft] if a.draft else []
        sa = build_parser().parse_args(argv)
        service = build_service(sa, *_check(sa), log=lambda msg: None)
        vocab = service.engine.cfg.target.vocab_size
        long_ids = [(7 + 13 * i) % (vocab - 2) + 1 for i in range(a.prompt_tokens)]
        with BackgroundServer(service) as server:
            # the warm-up's prompt differs from its first token on: the measured one is no prefix-cache hit
            asyncio.run(warm_up(server.base_url, service.model_name, [long_ids[0] % (vocab - 2) + 1] + long_ids[1:]))
            row = dict(prefill_chunk=chunk, **asyncio.run(measure(server.base_url, service.model_name, a.streams,
                                                                  a.stream_tokens, long_ids)))
        result["rows"].append(row)
        print(f"chunk {chunk}: median gap {row['median_gap_s']:.3f} s, largest during admission "
              f"{row['largest_gap_during_s']:.3f} s (x{row['ratio']:.2f}), long prompt TTFT {row['long_ttft_s']:.2f} s",
              flush=True)
    publish(result, a.out, f"admission-gaps-{jax.devices()[0].platform}-{result['date']}", markdown, print)
    return result


if __name__ == "__main__":
    main()
