"""`python -m bench.labs.adaptive_call`: where a whole adaptive generation's time goes on the embedded pair (issue 37).

The cost table prices each K of the adaptive program near the fixed-K program, yet whole adaptive runs of the
embedded pair cost 15-30% more per cycle than the table says (runs 2323 and 2332 found why: a branch's first run
in a call makes the host update its command buffers). This lab takes one prompt at a time and, for plain decoding
(also in counted chunks), fixed K = 3, adaptive forced to K = 3 or 0 and adaptive variants (the rule; shorter runs;
no exploration; K = 3 alone),
times the engine's decode loop call (median of --repeats fresh prefilled states, the prefill not timed) and traces
one call with the JAX profiler: kernel busy time against the call's wall time, the idle gaps between kernels and
the host events (the executor's thunks, the driver's graph launches, updates and copies) of at least 20 us.
Writes adaptive-call-<device>-<date>.json to --out.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import collections  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.adaptive_prompts import PROMPTS, encode, load_pair  # noqa: E402
from bench.labs.adaptive_overhead import _timed  # noqa: E402
from bench.labs.step_profile import _traced, busy_ns, host_events, idle_gaps, kernel_events  # noqa: E402
from jaxspec.adaptive import AdaptivePolicy  # noqa: E402
from jaxspec.engine import Engine  # noqa: E402
from jaxspec.sampling import SamplingParams  # noqa: E402

INT32_MAX = np.iinfo(np.int32).max

VARIANTS = {  # name: (K, adaptive policy or None, cycles per counted chunk of the plain / fixed-K loop or 1)
    "plain": (0, None, 1),
    "plain_chunk4": (0, None, 4),  # a loop of known trip count reads no predicate (slower all the same: run 2250)
    "fixed3": (3, None, 1),
    "fixed3_chunk4": (3, None, 4),
    "forced3": (3, AdaptivePolicy(steps=(0, 1, 2, 3), schedule=(3,)), 1),
    "forced0": (3, AdaptivePolicy(steps=(0, 1, 2, 3), schedule=(0,)), 1),
    "forced0_backlog64": (3, AdaptivePolicy(steps=(0, 1, 2, 3), schedule=(0,), backlog=64), 1),
    "rule": (3, AdaptivePolicy(), 1),
    "rule_stretch4": (3, AdaptivePolicy(stretch=4, explore_every=16), 1),
    "rule_no_explore": (3, AdaptivePolicy(explore_every=1 << 20), 1),
    "rule_k3_only": (3, AdaptivePolicy(steps=(0, 3)), 1),
}
# fixed-K loops of at most `cycles` cycles a call, the host reading `done` between calls and running the next K of
# the list (a K change made by the host between programs, not by a conditional inside one)
SPLITS = {
    "split3_once": ((3,), 1 << 20),
    "split3_16": ((3,), 16),
    "split34_16": ((3, 4), 16),
    "split3_8": ((3,), 8),
    "split34_8": ((3, 4), 8),
}


def loop_call(engine: Engine, prompt: list[int], max_new: int, chunk: int = 1):
    """(fresh prefilled state, run(state) -> state): the decode loop call `Engine.generate` times; `chunk` > 1: the
    plain / fixed-K loop runs its cycles in counted chunks of that many (no predicate read inside a chunk)."""
    sampling = SamplingParams()
    sp = sampling.validate().as_arrays()
    speculative = engine.k > 0
    if speculative and engine.adaptive is not None:
        def start():
            state = engine._prefill([prompt], max_new, sampling, 0, True)[0]
            return engine._adaptive_start(state, True)[0]

        compiled, _ = engine._adaptive_loop(start(), sp, True, max_new)
        return start, lambda s: compiled(engine.weights, s, sp, jnp.int32(INT32_MAX))

    def start():
        return engine._prefill([prompt], max_new, sampling, 0, speculative)[0]

    step = engine._step_fn(speculative, True, max_new)
    def body(w, s, sp):
        if chunk == 1:
            return step(w, s, sp)
        return jax.lax.fori_loop(0, chunk, lambda i, s: step(w, s, sp), s)

    loop = lambda w, s, sp: jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: body(w, s, sp), s)  # noqa: E731
    compiled, _ = engine._compile("loop_spec" if speculative else "loop_base", loop, {}, (engine.weights, start(), sp),
                                  (1,), baked=(True, max_new, chunk))
    return start, lambda s: compiled(engine.weights, s, sp)


def split_call(engine: Engine, prompt: list[int], max_new: int, ks: tuple[int, ...], cycles: int):
    """(fresh prefilled state, run(state) -> state): fixed-K loops of at most `cycles` cycles per call on one state
    (sized for K = 4), K taken in turn from `ks`, the host reading `done` after each call."""
    from jaxspec.spec_step import speculative_cycle  # noqa: PLC0415
    sampling = SamplingParams()
    sp = sampling.validate().as_arrays()

    def start():
        return engine._prefill([prompt], max_new, sampling, 0, True)[0]

    def loop(w, s, sp, limit, k):
        first = s.cycles
        step = lambda s: speculative_cycle(w, s, sp, cfg=engine.cfg, k=k, greedy=True,  # noqa: E731
                                           max_new_tokens=max_new, drafter=engine.drafter)
        return jax.lax.while_loop(lambda s: ~jnp.all(s.done) & (s.cycles - first < limit), step, s)

    progs = {k: engine._compile(f"split_{k}", loop, dict(k=k), (engine.weights, start(), sp, jnp.int32(0)), (1,),
                                baked=(max_new,))[0] for k in set(ks)}

    def run(s):
        i = 0
        while True:
            s = progs[ks[i % len(ks)]](engine.weights, s, sp, jnp.int32(cycles))
            i += 1
            if bool(jnp.all(s.done)):
                return s
    return start, run


def profile(start, run, repeats: int) -> dict:
    """The median (min, max) of `repeats` timed calls after a warm-up, then one traced call."""
    med, lo, hi, out = _timed(start, run, repeats)
    s = start()
    jax.block_until_ready(s)
    (kernels, host), wall_ms = _traced(lambda: run(s), lambda p: (kernel_events(p), host_events(p)))
    first = min(e["start_ns"] for e in kernels)
    last = max(e["start_ns"] + e["duration_ns"] for e in kernels)
    gaps = idle_gaps(kernels, 5.0)
    groups = collections.defaultdict(lambda: [0.0, 0])
    for e in host:
        groups[e["name"][:70]][0] += e["duration_ns"] / 1e6
        groups[e["name"][:70]][1] += 1
    gap_after = collections.defaultdict(lambda: [0.0, 0])
    for g in gaps:
        gap_after[f"{g['before'][:40]} -> {g['after'][:40]}"][0] += g["us"] / 1e3
        gap_after[f"{g['before'][:40]} -> {g['after'][:40]}"][1] += 1
    cycles = int(out.cycles) if hasattr(out, "cycles") else int(out.steps)
    row = dict(
        ms=1e3 * med, ms_min=1e3 * lo, ms_max=1e3 * hi, cycles=cycles,
        generated=int(out.generated[0]), traced_wall_ms=wall_ms, kernels=len(kernels),
        busy_ms=busy_ns(kernels) / 1e6, span_ms=(last - first) / 1e6, gaps_over_5us=len(gaps),
        gaps_ms=sum(g["us"] for g in gaps) / 1e3,
        gap_kinds=sorted(([k, round(v[0], 3), v[1]] for k, v in gap_after.items()), key=lambda r: -r[1])[:10],
        host=sorted(([k, round(v[0], 3), v[1]] for k, v in groups.items()), key=lambda r: -r[1])[:20],
    )
    row["tokens"] = np.asarray(out.out_tokens)[0, :row["generated"]].tolist()  # what the call emitted
    if hasattr(out, "k_log"):
        ks = np.asarray(out.k_log)
        row["k_histogram"] = {str(k): int(n) for k, n in zip(*np.unique(ks[ks >= 0], return_counts=True))}
    return row


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.adaptive_call", description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, nargs="+", default=[6, 8], help="indices into bench.adaptive_prompts")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS) + list(SPLITS))
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    log = lambda *x: print(*x, flush=True)  # noqa: E731
    spec_cfg, weights, tok = load_pair(jnp.dtype(a.dtype))
    result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  xla_flags=os.environ.get("XLA_FLAGS", ""), rows=[])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"adaptive-call-{jax.devices()[0].platform}-{datetime.datetime.now().strftime('%Y%m%d-%H%M')}.json"
    for i in a.prompts:
        kind, text = PROMPTS[i]
        prompt = encode(tok, text)
        for name in a.variants:
            if name in SPLITS:
                engine = Engine(spec_cfg, weights, num_steps=4)
                calls = split_call(engine, prompt, a.max_new_tokens, *SPLITS[name])
            else:
                k, policy, chunk = VARIANTS[name]
                engine = Engine(spec_cfg, weights, num_steps=k, adaptive=policy)
                engine.generate([prompt], a.max_new_tokens)  # compile; adaptive: measure the cost table
                calls = loop_call(engine, prompt, a.max_new_tokens, chunk)
            row = dict(prompt=text, kind=kind, variant=name, **profile(*calls, a.repeats))
            result["rows"].append(row)
            path.write_text(json.dumps(result, indent=1))  # after every row: a run cut short keeps what it measured
            log(f"{text[:14]!r:18s} {name:16s} {row['ms']:7.3f} ms ({row['ms_min']:.3f}-{row['ms_max']:.3f}) "
                f"{row['cycles']:4d} cycles {row['ms'] / row['cycles']:.4f} ms/cycle {1e3 * row['ms'] / row['generated']:.1f} "
                f"us/token | traced {row['traced_wall_ms']:.3f}"
                f" busy {row['busy_ms']:.3f} span {row['span_ms']:.3f} gaps {row['gaps_over_5us']} "
                f"({row['gaps_ms']:.3f} ms) {row.get('k_histogram', '')} tokens {hash(tuple(row['tokens'])) & 0xffff:04x}")
            for g in row["gap_kinds"][:4]:
                log(f"      gap {g[1]:7.3f} ms {g[2]:4d}x  {g[0]}")
            for h in row["host"][:8]:
                log(f"      host {h[1]:7.3f} ms {h[2]:4d}x  {h[0]}")


if __name__ == "__main__":
    main()
