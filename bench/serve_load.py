"""`python -m bench.serve_load`: `python -m jaxspec.serve` under load, speculation on and off.

For each mode (speculation with K draft tokens, K = N for `specN`, K = 0, adaptive K) a server is started in this
process on a loopback port, all of them side by side, and driven with the `openai` async client: at each concurrency
level, that many workers each send streamed greedy completions back to back (prompts from a fixed list,
`--max-tokens` each). `--rounds N` runs every level N times on every mode, the modes' order rotated each round, and
compares each mode's median (adaptive's over the best fixed K's); `--switch-interval-ms` runs each level at each of
the given GIL switch intervals in turn (the engine thread wins the GIL back from the HTTP threads after a device
loop within that interval). By default the load generator runs in this process too, so at many streams its Python
work shares the server's GIL; `--client-process` drives the levels from another process (the warm-up stays here).
Per level: requests sent / completed / failed, output tokens per second over the level's wall time, time to first
token (TTFT: request sent -> first text chunk) and inter-token latency (per request: (last chunk - first chunk) /
(tokens - 1)) percentiles. Every
output is compared with `Engine.generate` on its prompt alone (greedy, same K, same dtype): equal in float32;
in bfloat16 batched kernels may round differently, and the table says how many matched.

Each level starts after one warm-up pass (every prompt once) so no compile lands in a timed level.

Chat and agent traffic: `--system-prompt-tokens N` puts one shared text of about N tokens before every prompt (as a
system prompt and tool list are), which the server's prefix cache (`--prefix-cache-tokens`, its default when not
given; 0 = off) holds after the first request. `--long-prompts N` runs N more workers beside each level's, each
sending prompts of `--long-prompt-tokens` new token ids (one token asked) back to back until the level's own workers
are done, so the level's inter-token latency shows what long admissions cost the running streams.
`--system-prompt-share F` puts the shared text before that fraction of the requests only (most, not all, as in
mixed traffic); `--turns N` makes each worker's requests a conversation of N turns, each resending the history
(the earlier prompts and answers) before a new prompt. Only first turns are compared with `Engine.generate` (a
later turn's prompt holds the server's own answer).

Memory: `--cache-pages N` runs the server on a paged cache of N pages (`serve --cache-pages`); /metrics is sampled
during each level for the pages in use and the tokens the running requests hold, so the table shows whether memory
follows the tokens held; the cache's bytes (`cache_bytes`, the whole allocation) and bytes per position are
reported per mode. Prefix hits and misses, and preemptions, are counted per level.
Writes serve-load-<device>-<date>.json and .md to --out.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.report import fmt, write_report  # noqa: E402
from jaxspec.engine import Engine  # noqa: E402
from jaxspec.serve import _check, build_parser, build_service  # noqa: E402
from jaxspec.serving.background import BackgroundServer  # noqa: E402
from jaxspec.serving.prefix_pages import PAGE_TOKENS  # noqa: E402

PROMPTS = [
    "def fibonacci(n):\n", "import numpy as np\n\n", "class Stack:\n    def __init__(self):\n", "# Sort a list of numbers\n",
    "for i in range(10):\n", "def main():\n    args = parse_args()\n", "x = [1, 2, 3]\n", "return self.",
    "import os\nimport sys\n\n", "def add(a, b):\n    \"\"\"Add two numbers.", "while True:\n", "with open(path) as f:\n",
]
PERCENTILES = (50, 90, 99)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder for the JSON and markdown results")
    p.add_argument("--model", default=None, help="converted target (default: the embedded pair)")
    p.add_argument("--draft", default=None)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--speculative-num-steps", type=int, default=4, help="K of the speculative mode")
    p.add_argument("--modes", default="spec,base",
                   help="spec (K draft tokens), specN (N draft tokens), base (K = 0), adaptive (K chosen per loop up "
                   "to K), comma-separated")
    p.add_argument("--rounds", type=int, default=1, help="times every level is run on every mode, the modes' order "
                   "rotated each round (the tables give each mode's median over the rounds and its range)")
    p.add_argument("--client-process", action="store_true", help="drive the levels from another Python process, "
                   "so the load generator does not share the server's GIL (default: this process)")
    p.add_argument("--switch-interval-ms", default=None, help="comma-separated Python GIL switch intervals to run "
                   "each level at in turn (default: the server's own)")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated concurrency levels")
    p.add_argument("--requests-per-worker", type=int, default=2, help="requests each worker sends per level")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=None, help="server slots (default: the largest concurrency)")
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--cycles-per-step", type=int, default=4)
    p.add_argument("--no-check", action="store_true", help="skip the comparison with Engine.generate alone")
    p.add_argument("--system-prompt-tokens", type=int, default=0, help="a shared text of about this many tokens "
                   "before every prompt")
    p.add_argument("--prefix-cache-tokens", type=int, default=None, help="the server's (default: its own)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="the server's (default: its own)")
    p.add_argument("--long-prompts", type=int, default=0, help="workers sending long prompts during each level")
    p.add_argument("--long-prompt-tokens", type=int, default=4096)
    p.add_argument("--system-prompt-share", type=float, default=1.0,
                   help="fraction of the requests that carry the shared system prompt")
    p.add_argument("--turns", type=int, default=1, help="turns per conversation (each resends the history)")
    p.add_argument("--cache-pages", type=int, default=None, help="the server's paged cache (default: not paged)")
    a = p.parse_args(argv)
    try:
        a.levels = [int(c) for c in a.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency {a.concurrency!r}: expected comma-separated integers")
    a.mode_list = [m for m in a.modes.split(",") if m]
    try:
        a.switch_intervals = [float(x) for x in a.switch_interval_ms.split(",")] if a.switch_interval_ms else None
    except ValueError:
        p.error(f"--switch-interval-ms {a.switch_interval_ms!r}: expected comma-separated milliseconds")
    if a.switch_intervals is not None and min(a.switch_intervals) <= 0:
        p.error(f"--switch-interval-ms must be > 0, got {a.switch_interval_ms}")
    if not a.levels or min(a.levels) < 1:
        p.error(f"--concurrency levels must be >= 1, got {a.concurrency}")
    known = {"spec", "base", "adaptive"}
    if not a.mode_list or any(m not in known and not (m[:4] == "spec" and m[4:].isdigit() and int(m[4:]) >= 1)
                              for m in a.mode_list) or len(set(a.mode_list)) < len(a.mode_list):
        p.error(f"--modes takes spec, specN (N >= 1), base and/or adaptive, each once, got {a.modes!r}")
    if not 0 <= a.system_prompt_share <= 1:
        p.error(f"--system-prompt-share must be within [0, 1], got {a.system_prompt_share}")
    for flag, v in (("--requests-per-worker", a.requests_per_worker), ("--max-tokens", a.max_tokens),
                    ("--speculative-num-steps", a.speculative_num_steps), ("--turns", a.turns),
                    ("--rounds", a.rounds)):
        if v < 1:
            p.error(f"{flag} must be >= 1, got {v}")
    for flag, v in (("--system-prompt-tokens", a.system_prompt_tokens), ("--long-prompts", a.long_prompts)):
        if v < 0:
            p.error(f"{flag} must be >= 0, got {v}")
    return a


SYSTEM_LINES = ["You are a careful coding assistant. Answer with code only.",
                "Tools: read_file(path), write_file(path, text), run(command), search(query).",
                "Prefer the standard library; keep functions short; name things for what they compute."]


def system_text(tokens: int, encode) -> str:
    """A shared preamble of about `tokens` tokens (whole lines, repeated)."""
    text, i = "", 0
    while tokens and len(encode(text)) < tokens:
        text += SYSTEM_LINES[i % len(SYSTEM_LINES)] + "\n"
        i += 1
    return text


def percentiles(values) -> dict:
    if not values:
        return {str(q): None for q in PERCENTILES}
    return {str(q): float(np.percentile(values, q)) * 1000 for q in PERCENTILES}


async def _one(client, model, prompt, max_tokens):
    """(text, tokens, TTFT s, inter-token s | None) of one streamed greedy completion; raises on failure."""
    t0 = time.perf_counter()
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    first = last = None
    parts, tokens = [], 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.text:
                last = time.perf_counter()
                first = first or last
                parts.append(choice.text)
    ttft = (first or time.perf_counter()) - t0
    itl = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return "".join(parts), tokens, ttft, itl


async def _long_prompts(client, model, length: int, vocab: int, seed: int, stop: asyncio.Event, sent: list):
    """Prompts of `length` new token ids, one token asked, back to back until `stop`."""
    rng = np.random.default_rng(seed)
    while not stop.is_set():
        ids = [int(t) for t in rng.integers(1, vocab - 1, size=length)]
        try:
            await client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0)
            sent.append(True)
        except Exception:  # noqa: BLE001 - counted, not fatal
            sent.append(False)


def _with_preamble(index: int, share: float) -> bool:
    """Whether request `index` carries the shared system prompt: `share` of the requests, spread evenly."""
    return int((index + 1) * share) > int(index * share)


async def run_level(base_url, model, concurrency, per_worker, max_tokens, prompts=PROMPTS, offset=0,
                    long_prompts=0, long_tokens=0, vocab=0, preamble="", share=1.0, turns=1):
    """Every result (prompt, (text, tokens, TTFT, ITL) or the exception) and the level's wall time; with
    `long_prompts`, also how many long prompts were answered and failed beside it. A worker's `per_worker`
    requests are conversations of `turns` turns; request i of the level carries `preamble` as `share` says."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    results, long_sent, stop = [], [], asyncio.Event()
    longs = [asyncio.create_task(_long_prompts(client, model, long_tokens, vocab, offset * 100 + i, stop, long_sent))
             for i in range(long_prompts)]

    async def worker(w):
        for r in range(per_worker):
            i = offset + w * per_worker + r
            history = preamble if _with_preamble(i, share) else ""
            for turn in range(turns):
                prompt = history + prompts[(i + turn) % len(prompts)]
                try:
                    out = await _one(client, model, prompt, max_tokens)
                except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal to the benchmark
                    results.append((prompt, e))
                    break
                results.append((prompt, out))
                history = prompt + out[0] + "\n"

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    wall = time.perf_counter() - t0
    stop.set()
    await asyncio.gather(*longs)
    await client.close()
    if long_prompts:
        return results, wall, (sum(long_sent), len(long_sent) - sum(long_sent))
    return results, wall


def summarize(concurrency, results, wall, solo: dict | None) -> dict:
    ok = [(p, r) for p, r in results if not isinstance(r, Exception)]
    tokens = sum(r[1] for _, r in ok)
    row = {
        "concurrency": concurrency, "sent": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({f"{r.__class__.__name__}: {r}" for _, r in results if isinstance(r, Exception)})[:5],
        "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else None,
        "ttft_ms": percentiles([r[2] for _, r in ok]),
        "itl_ms": percentiles([r[3] for _, r in ok if r[3] is not None]),
    }
    if solo is not None:  # prompts whose solo answer is known (a conversation's later turns are not)
        checked = [(p, r) for p, r in ok if p in solo]
        row["equal_to_solo"] = sum(r[0] == solo[p] for p, r in checked)
        row["checked"] = len(checked)
    return row


def _metrics(base_url) -> dict[str, float]:
    import httpx

    text = httpx.get(base_url.replace("/v1", "/metrics")).text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def _by_k(metrics: dict, name: str) -> dict[str, float]:
    """{K: value} of a metric labelled by K (`name{k="3"}`), as /metrics gave it."""
    head = name + '{k="'
    return {key[len(head):-2]: v for key, v in metrics.items() if key.startswith(head)}


def _metric(base_url, name) -> float:
    return _metrics(base_url).get(name, float("nan"))


class CacheSampler:
    """Samples /metrics' paged-cache gauges every `period_s` in a thread while a level runs: the peak of pages in
    use, and at each sample the positions the pages held per token the running requests held."""

    def __init__(self, base_url: str, period_s: float = 0.25):
        import threading

        self.base_url, self.period_s, self.samples = base_url, period_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.period_s):
            m = _metrics(self.base_url)
            if "jaxspec_cache_pages_in_use" in m:
                self.samples.append((m["jaxspec_cache_pages_in_use"], m["jaxspec_cache_tokens_held"],
                                     m.get("jaxspec_active_slots", float("nan"))))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def summary(self, page_tokens: int) -> dict:
        if not self.samples:
            return {}
        peak = max(self.samples)
        held = [(p * page_tokens) / t for p, t, _ in self.samples if t > 0]
        return {"pages_in_use_peak": peak[0], "tokens_held_at_peak": peak[1], "slots_at_peak": peak[2],
                "positions_per_token_held":
                    {str(q): float(np.percentile(held, q)) for q in PERCENTILES} if held else {}}


def solo_texts(service, k, max_tokens, prompts) -> dict:
    """prompt -> the text Engine.generate gives it alone (greedy), decoded as the server decodes."""
    engine = Engine(service.engine.cfg, service.engine.weights, num_steps=k)
    eos = service.scheduler.eos_ids
    out = {}
    for p in prompts:
        toks = engine.generate([service.encode(p)], max_tokens).tokens[0]
        out[p] = service.tokenizer.decode([t for t in toks if t not in eos])
    return out


def mode_k(a, mode: str) -> int:
    """The K a mode's server runs (`specN`: N; `spec` and `adaptive`: --speculative-num-steps, adaptive's largest;
    `base`: 0)."""
    if mode == "base":
        return 0
    if mode.startswith("spec") and mode[4:]:
        return int(mode[4:])
    return a.speculative_num_steps


class Mode:
    """One mode's server, started in this process, and what its levels measured."""

    def __init__(self, a, mode: str, log):
        self.name, self.k = mode, mode_k(a, mode)
        argv = ["--dtype", a.dtype, "--max-batch", str(a.max_batch or max(a.levels)), "--max-context",
                str(a.max_context), "--speculative-num-steps", str(self.k), "--cycles-per-step",
                str(a.cycles_per_step), "--max-queue", str(max(a.levels) * 2), "--warmup-buckets", "16,32"]
        argv += ["--speculative-adaptive"] if mode == "adaptive" else ["--no-speculative-adaptive"]
        argv += ["--model", a.model] if a.model else []
        argv += ["--draft", a.draft] if a.draft else []
        argv += ["--prefix-cache-tokens", str(a.prefix_cache_tokens)] if a.prefix_cache_tokens is not None else []
        argv += ["--prefill-chunk", str(a.prefill_chunk)] if a.prefill_chunk else []
        argv += ["--cache-pages", str(a.cache_pages)] if a.cache_pages else []
        sa = build_parser().parse_args(argv)
        self.service = service = build_service(sa, *_check(sa), log=log)
        self.preamble = system_text(a.system_prompt_tokens, service.encode)
        self.prompts = [self.preamble + p for p in PROMPTS]
        first_turns = self.prompts + (PROMPTS if a.system_prompt_share < 1 else [])
        self.solo = None if a.no_check else solo_texts(service, self.k, a.max_tokens, first_turns)
        self.vocab = service.engine.cfg.target.vocab_size
        self.rows: list[dict] = []
        self.server = BackgroundServer(service).start()
        url = self.server.base_url
        run_level_here(url, service.model_name, len(PROMPTS), 1, a.max_tokens, PROMPTS, preamble=self.preamble,
                       share=a.system_prompt_share, turns=a.turns)  # warm-up
        if a.long_prompts:  # the long prompts' programs too
            run_level_here(url, service.model_name, 1, 1, 2, self.prompts, 0, 1, a.long_prompt_tokens, self.vocab)

    def level(self, a, c: int, log, drive=None, **labels) -> dict:
        """One level of `c` workers on this mode's server: its row (`labels` added to it). `drive(*args, **kw)`
        runs `run_level` (default: in this process; `LevelProcess`: in another)."""
        url, service = self.server.base_url, self.service
        drive = drive or run_level_here
        before = _metrics(url)
        with CacheSampler(url) as sampler:
            out = drive(url, service.model_name, c, a.requests_per_worker, a.max_tokens, PROMPTS, offset=c,
                        long_prompts=a.long_prompts, long_tokens=a.long_prompt_tokens, vocab=self.vocab,
                        preamble=self.preamble, share=a.system_prompt_share, turns=a.turns)
        results, wall = out[:2]
        row = summarize(c, results, wall, self.solo)
        row.update(labels)
        after = _metrics(url)
        delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
        row["prefix_hit_tokens"] = delta("jaxspec_prefix_cache_hit_tokens_total")
        hits, misses = delta("jaxspec_prefix_cache_hits_total"), delta("jaxspec_prefix_cache_misses_total")
        row["prefix_hit_rate"] = hits / (hits + misses) if hits + misses else None
        row["preemptions"] = delta("jaxspec_preemptions_total")
        loops = _by_k(after, "jaxspec_speculation_loops_total")
        if loops:  # adaptive K: what this level ran and the figures the rule held at its end
            ran = {k: n - _by_k(before, "jaxspec_speculation_loops_total").get(k, 0.0) for k, n in loops.items()}
            row["adaptive"] = dict(loops=ran, cycle_plain_steps=_by_k(after, "jaxspec_cycle_cost_plain_steps"),
                                   expected_tokens=_by_k(after, "jaxspec_expected_tokens_per_slot_cycle"))
        row.update(sampler.summary(PAGE_TOKENS))
        if a.long_prompts:
            row["long_prompts_answered"], row["long_prompts_failed"] = out[2]
        row["cycles"] = cycles = delta("jaxspec_cycles_total")
        # each request's first token comes out of its prefill, not a cycle
        cycle_tokens = delta("jaxspec_generation_tokens_total") - row["completed"]
        row["tokens_per_cycle"] = cycle_tokens / cycles if cycles else None
        log(f"{self.name} concurrency {c}{''.join(f', {k} {v}' for k, v in labels.items())}: "
            f"{row['completed']}/{row['sent']} completed, {fmt(row['tokens_per_s'], 1)} tok/s, "
            f"TTFT p50 {fmt(row['ttft_ms']['50'], 1)} ms")
        self.rows.append(row)
        return row

    def close(self, a) -> dict:
        """Stops the server; what the mode ran."""
        service = self.service
        mal = _metric(self.server.base_url, "jaxspec_mean_acceptance_length")
        policy = service.engine.choose_k
        loop_log = [list(x) for x in getattr(policy, "loop_log", ())]  # adaptive: every loop it timed
        self.server.stop()
        state = service.engine.state
        caches = [state.target_cache.latent, state.target_cache.k_rope, state.draft_cache]
        cache_bytes = sum(x.nbytes for x in jax.tree.leaves(caches))
        positions = (a.cache_pages * PAGE_TOKENS if a.cache_pages else service.engine.max_batch
                     * service.engine.capacity)
        choices = getattr(policy, "choices", None)  # adaptive: loops run at each K
        return {"mode": self.name, "k": self.k, "mean_acceptance_length": None if self.k == 0 else mal,
                "rows": self.rows,
                "k_choices": None if choices is None else {str(kk): n for kk, n in sorted(choices.items())},
                "loop_log": loop_log or None,
                "compile_s": service.engine.compile_s, "prefix_cache_pages": service.engine.prefix.num_pages,
                "prompt_tokens": [len(service.encode(p)) for p in self.prompts], "cache_pages": a.cache_pages,
                "cache_bytes": cache_bytes, "cache_positions": positions, "bytes_per_position": cache_bytes / positions}


def run_level_here(*args, **kw):
    """`run_level` in this process (its load generator shares the server's GIL)."""
    return asyncio.run(run_level(*args, **kw))


def _level_in_child(*args, **kw):
    """`run_level` in a worker process, its failures as plain RuntimeErrors (a client's exception may hold what
    does not pickle)."""
    out = run_level_here(*args, **kw)
    results = [(p, RuntimeError(f"{r.__class__.__name__}: {r}") if isinstance(r, Exception) else r)
               for p, r in out[0]]
    return (results, *out[1:])


class LevelProcess:
    """Drives the levels from one other Python process, started once (spawned: no copy of this one's threads or
    device), so the load generator's Python work does not take the server's GIL: the figures are the server's."""

    def __enter__(self):
        import multiprocessing

        self.pool = multiprocessing.get_context("spawn").Pool(1)
        return self

    def __call__(self, *args, **kw):
        return self.pool.apply(_level_in_child, args, kw)

    def __exit__(self, *exc):
        self.pool.close()
        self.pool.join()


def run_modes(a, log) -> list[dict]:
    """Every mode's server started side by side, then round after round of the levels, the modes' order rotated
    each round and, at each level, each GIL switch interval of --switch-interval-ms in turn, so a mode's figures
    and another's are taken under the same conditions."""
    modes = [Mode(a, m, log) for m in a.mode_list]
    default_switch = sys.getswitchinterval()
    with contextlib.ExitStack() as stack:
        drive = stack.enter_context(LevelProcess()) if a.client_process else None
        stack.callback(sys.setswitchinterval, default_switch)
        for r in range(a.rounds):
            order = modes[r % len(modes):] + modes[: r % len(modes)]
            for c in a.levels:
                for ms in a.switch_intervals or [None]:
                    labels = {"round": r} if a.rounds > 1 else {}
                    if ms is not None:
                        sys.setswitchinterval(ms / 1e3)
                        labels["switch_interval_ms"] = ms
                    for m in order:
                        m.level(a, c, log, drive, **labels)
    return [m.close(a) for m in modes]


def compare(modes: list[dict]) -> list[dict]:
    """Per level (and switch interval): each mode's median tok/s over the rounds with its range, and adaptive's
    median over the best fixed mode's (`spec*`; and over plain `base` where every fixed K loses to it)."""
    groups: dict[tuple, dict[str, list[float]]] = {}
    for m in modes:
        for r in m["rows"]:
            key = (r["concurrency"], r.get("switch_interval_ms"))
            groups.setdefault(key, {}).setdefault(m["mode"], []).append(r["tokens_per_s"] or 0.0)
    out = []
    for (c, ms), by_mode in groups.items():
        med = {name: statistics.median(v) for name, v in by_mode.items()}
        row = {"concurrency": c, "switch_interval_ms": ms, "rounds": max(len(v) for v in by_mode.values()),
               "tokens_per_s": med, "range": {name: [min(v), max(v)] for name, v in by_mode.items()}}
        fixed = {n: v for n, v in med.items() if n.startswith("spec")}
        if "adaptive" in med and fixed:
            best = max(fixed, key=fixed.get)
            row["best_fixed"], row["adaptive_over_best"] = best, med["adaptive"] / fixed[best]
            if "base" in med and med["base"] > fixed[best]:
                row["adaptive_over_base"] = med["adaptive"] / med["base"]
        out.append(row)
    return out


def markdown(result: dict) -> str:
    lines = [f"# Serving under load: {result['device']}, jax {result['jax']}, {result['date']}", "",
             f"Model: {result['model']} ({result['dtype']}); {result['max_tokens']} tokens per request, greedy, "
             f"streamed; {result['requests_per_worker']} requests per worker per level; server: "
             f"{result['cycles_per_step']} cycles per host step, context {result['max_context']}. Throughput = output "
             "tokens / the level's wall time; TTFT and inter-token latency (ITL) in ms, percentiles over requests.",
             f"Shared system prompt: {result.get('system_prompt_tokens', 0)} tokens; prefix cache pages: "
             + ", ".join(f"{m['mode']} {m.get('prefix_cache_pages', '-')}" for m in result["modes"])
             + f"; long prompts beside each level: {result.get('long_prompts', 0)} workers of "
             f"{result.get('long_prompt_tokens', 0)} tokens; system prompt on {result.get('system_prompt_share', 1):g} "
             f"of the requests; {result.get('turns', 1)} turn(s) per conversation; paged cache: "
             f"{result.get('cache_pages') or 'off'} pages; load generator "
             f"{'in its own process' if result.get('client_process') else 'in the server process'}.", "",
             "| mode | K | concurrency | sent | completed | failed | equal to solo (of checked) | tok/s | "
             "tokens/cycle (all slots) | TTFT p50 | p90 | p99 | ITL p50 | p90 | p99 | prompt tokens restored | "
             "prefix hit rate | long prompts answered | pages in use, peak | tokens held then | cache positions per "
             "token held, p50 / p99 | preemptions |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in result["modes"]:
        for r in m["rows"]:
            t, i = r["ttft_ms"], r["itl_ms"]
            h = r.get("positions_per_token_held") or {}
            held = f"{fmt(h['50'], 2)} / {fmt(h['99'], 2)}" if h else "-"
            checked = f" of {r['checked']}" if "checked" in r else ""
            lines.append(
                f"| {m['mode']}{_labels(r)} | {m['k']} | {r['concurrency']} | {r['sent']} | {r['completed']} | "
                f"{r['failed']} | "
                f"{r.get('equal_to_solo', '-')}{checked} | {fmt(r['tokens_per_s'], 1)} | "
                f"{fmt(r['tokens_per_cycle'], 2)} | "
                f"{fmt(t['50'], 1)} | {fmt(t['90'], 1)} | {fmt(t['99'], 1)} | {fmt(i['50'], 2)} | {fmt(i['90'], 2)} | "
                f"{fmt(i['99'], 2)} | {fmt(r.get('prefix_hit_tokens'), 0)} | {fmt(r.get('prefix_hit_rate'), 2)} | "
                f"{r.get('long_prompts_answered', '-')} | {fmt(r.get('pages_in_use_peak'), 0)} | "
                f"{fmt(r.get('tokens_held_at_peak'), 0)} | {held} | {fmt(r.get('preemptions'), 0)} |")
    memory = [f"{m['mode']}: {m['cache_bytes'] / 2**20:.1f} MiB for {m['cache_positions']} positions "
              f"({m['bytes_per_position']:.0f} B each)" for m in result["modes"] if "cache_bytes" in m]
    if memory:
        lines += ["", "Cache allocated (target latent and rope key, draft cache): " + "; ".join(memory) + "."]
    accept = [f"{m['mode']} K={m['k']}: {fmt(m['mean_acceptance_length'], 2)}" for m in result["modes"] if m["k"]]
    if accept:
        lines += ["", "Mean acceptance length over the whole run (tokens per slot-cycle): " + "; ".join(accept) + "."]
    chosen = [f"{m['mode']}: " + ", ".join(f"K={kk} {n}" for kk, n in m["k_choices"].items())
              for m in result["modes"] if m.get("k_choices")]
    if chosen:
        lines += ["", "Device loops run at each K (adaptive, warm-up included): " + "; ".join(chosen) + "."]
    levels = [(m["mode"], r) for m in result["modes"] for r in m["rows"] if r.get("adaptive")]
    if levels:
        lines += ["", "Adaptive K per level: the loops it ran at each K, and at the level's end its cycle cost in "
                  "plain steps and expected tokens a slot-cycle per K (what the rule weighed):", ""]
        for mode, r in levels:
            ad = r["adaptive"]
            lines.append(f"- {mode}{_labels(r)}, concurrency {r['concurrency']}: loops "
                         + ", ".join(f"K={k} {n:.0f}" for k, n in sorted(ad["loops"].items()))
                         + "; cost " + (", ".join(f"K={k} {v:.2f}" for k, v in sorted(ad["cycle_plain_steps"].items()))
                                        or "not measured yet")
                         + "; tokens " + ", ".join(f"K={k} {v:.2f}" for k, v in sorted(ad["expected_tokens"].items())))
    comparison = result.get("comparison") or []
    if any(len(row["tokens_per_s"]) > 1 for row in comparison):
        lines += ["", f"Per level, each mode's median tok/s over {result.get('rounds', 1)} round(s) [min-max], and "
                  "adaptive's median over the best fixed K's (over plain decoding's where that beats every fixed K):",
                  "", "| concurrency | GIL switch interval, ms | tok/s per mode | best fixed | adaptive / best |",
                  "|---|---|---|---|---|"]
        for row in comparison:
            cells = "; ".join(f"{name} {fmt(v, 1)} [{fmt(row['range'][name][0], 0)}-{fmt(row['range'][name][1], 0)}]"
                              for name, v in row["tokens_per_s"].items())
            over = fmt(row.get("adaptive_over_best"), 3)
            if "adaptive_over_base" in row:
                over += f" (over base {fmt(row['adaptive_over_base'], 3)})"
            lines.append(f"| {row['concurrency']} | {fmt(row['switch_interval_ms'], 2)} | {cells} | "
                         f"{row.get('best_fixed', '-')} | {over} |")
    return "\n".join(lines) + "\n"


def _labels(row: dict) -> str:
    """A row's round and switch interval, where the run had more than one."""
    parts = ([f"round {row['round']}"] if "round" in row else []) + (
        [f"switch {row['switch_interval_ms']:g} ms"] if "switch_interval_ms" in row else [])
    return f" ({', '.join(parts)})" if parts else ""


def main(argv=None) -> int:
    a = parse_args(argv)

    def log(msg):
        print(f"[serve_load] {msg}", file=sys.stderr, flush=True)

    modes = run_modes(a, log)
    device = jax.devices()[0]
    result = {
        "device": f"{device.platform}:{device.device_kind}", "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": a.model or "embedded pair", "dtype": a.dtype, "max_tokens": a.max_tokens,
        "requests_per_worker": a.requests_per_worker, "cycles_per_step": a.cycles_per_step,
        "max_context": a.max_context, "modes": modes, "system_prompt_tokens": a.system_prompt_tokens,
        "prefix_cache_tokens": a.prefix_cache_tokens, "long_prompts": a.long_prompts,
        "long_prompt_tokens": a.long_prompt_tokens if a.long_prompts else 0,
        "system_prompt_share": a.system_prompt_share, "turns": a.turns, "cache_pages": a.cache_pages,
        "rounds": a.rounds, "comparison": compare(modes), "client_process": a.client_process,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    stem = f"serve-load-{device.platform}-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M}"
    path = write_report(result, a.out, stem, render=markdown)
    print(markdown(result))
    log(f"wrote {path} and {path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
