"""`python -m bench.labs.adaptive_overhead`: where the adaptive program's extra time per cycle goes (issue 37).

On a Kimi-K2.5-shaped model of --layers layers (random INT4 experts, the controllable drafter of
`bench.adaptive_acceptance` at acceptance 0, greedy, one prompt), each program decodes --max-new-tokens tokens in one
on-device loop and is timed as a whole (median of --repeats after a warm-up); ms per cycle:

- plain: `baseline_step` in a `while_loop` (what plain decoding costs);
- direct: the adaptive K = 0 step without its catch-up (no conditional at all) on the adaptive state: what the larger
  carried state and `commit` cost;
- switch1: the same step behind a two-branch `lax.switch` over the adaptive state: what a conditional costs;
- forced0 / forced1: the adaptive loop with K forced to 0 / 1 (the rule's work, the catch-up conditionals, the
  switch over every branch);
- forced0_backlog64: forced K = 0 with a 64-entry backlog (catch-ups 8x rarer);
- fixed1: the fixed K = 1 loop (what forced1 imitates).

Then the cost table as `jaxspec.adaptive_costs.measure` takes it (16-cycle calls) beside slopes between loops of 16
and 48 cycles (a call's fixed cost cancels). Prints the optimised HLO's top-level op counts of the adaptive loop and
writes it gzipped with the JSON to --out. XLA_FLAGS set outside select command-buffer variants.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import collections  # noqa: E402
import functools  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.adaptive_acceptance import controlled_drafter, programs  # noqa: E402
from bench.cycle import spec_pair  # noqa: E402
from bench.step import random_model  # noqa: E402
from jaxspec.adaptive import AdaptivePolicy, init_adaptive_state, plain_decode  # noqa: E402
from jaxspec.prefill import prompt_bucket  # noqa: E402
from model.kv_cache import round_capacity  # noqa: E402

INT32_MAX = np.iinfo(np.int32).max


def _timed(start, run, repeats):
    times, out = [], None
    for rep in range(repeats + 1):
        s = start()
        jax.block_until_ready(s)
        t0 = time.perf_counter()
        out = run(s)
        jax.block_until_ready(out)
        if rep:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times), max(times), out


def _hlo_counts(text: str) -> dict:
    counts, comp = collections.Counter(), ""
    for line in text.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            comp = line.split()[0]
        if "fused" in comp or "fusion" in comp:
            continue
        m = re.search(r" = .*?\s([a-z][\w-]*)\((?:%|\))", line)
        if m:
            counts[m.group(1)] += 1
    return dict(counts.most_common(25))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.adaptive_overhead", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--label", default="default")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.max_new_tokens < 64:
        p.error("--max-new-tokens must be >= 64 (the cost table's slope runs 48 cycles)")
    log = lambda *x: print(*x, flush=True)  # noqa: E731
    cfg, w = random_model(a.layers, a.tiny)
    spec_cfg, _, sw = spec_pair(w, cfg, a.tiny)
    steps = (0, 1)
    policy = AdaptivePolicy(steps=steps, probe=False)
    n_prompt, max_new = 64, a.max_new_tokens
    bucket = prompt_bucket(n_prompt)
    capacity = round_capacity(max(bucket, n_prompt + max_new + 2))
    base_prefill, sprefill, base_loop, fixed, adaptive = programs(spec_cfg, [1], steps, policy, max_new, capacity)
    rng = np.random.default_rng(0)
    tokens = np.zeros((1, bucket), np.int32)
    tokens[:, :n_prompt] = rng.integers(3, cfg.vocab_size, (1, n_prompt))
    prompt = (sw, jnp.asarray(tokens), jnp.full((1,), n_prompt, jnp.int32), jax.random.key(0), {})
    aux_width = len(spec_cfg.target.aux_layer_ids) * spec_cfg.target.hidden_size
    zero = jnp.float32(0.0)
    rows = {}

    med, lo, hi, plain = _timed(lambda: base_prefill(*prompt), lambda s: base_loop(sw, s), a.repeats)
    cont = plain.out_tokens
    rows["plain"] = (med, lo, hi, int(plain.steps))

    def adaptive_start(schedule, backlog=8):
        pol = AdaptivePolicy(steps=steps, probe=False, backlog=backlog, schedule=schedule)
        return lambda: init_adaptive_state(sprefill(*prompt), aux_width, steps, pol, (1.0, 1.0))

    def no_flush_step(w_, st):
        # the adaptive K = 0 step without its catch-up: the backlog is emptied instead of run through the draft
        spec, backlog = plain_decode(w_, spec_cfg, st.spec, st.backlog, {}, greedy=True, max_new_tokens=max_new)
        return st.replace(spec=spec, backlog=backlog.replace(count_B=jnp.zeros_like(backlog.count_B)))

    direct = jax.jit(lambda w_, s: jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: no_flush_step(w_, s), s),
                     donate_argnums=1)
    switch1 = jax.jit(lambda w_, s: jax.lax.while_loop(
        lambda s: ~jnp.all(s.done),
        # two equal branches behind an index XLA cannot fold (a one-branch switch is traced as a plain call)
        lambda s: jax.lax.switch((s.spec.cycles < 0).astype(jnp.int32), [lambda s: no_flush_step(w_, s)] * 2, s),
        s), donate_argnums=1)
    for name, prog in (("direct", direct), ("switch1", switch1)):
        med, lo, hi, out = _timed(adaptive_start((0,)), lambda s: prog(sw, s), a.repeats)
        rows[name] = (med, lo, hi, int(out.spec.cycles))
    for name, sched, backlog in (("forced0", (0,), 8), ("forced1", (1,), 8), ("forced0_backlog64", (0,), 64)):
        med, lo, hi, out = _timed(adaptive_start(sched, backlog),
                                  lambda s: adaptive(sw, s, zero, cont, jnp.int32(INT32_MAX)), a.repeats)
        rows[name] = (med, lo, hi, int(out.spec.cycles))
    med, lo, hi, out = _timed(lambda: sprefill(*prompt), lambda s: fixed[1](sw, s, zero, cont), a.repeats)
    rows["fixed1"] = (med, lo, hi, int(out.cycles))
    per_cycle = {}
    for name, (med, lo, hi, cycles) in rows.items():
        per_cycle[name] = dict(ms_per_cycle=1e3 * med / cycles, min_ms=1e3 * lo / cycles, max_ms=1e3 * hi / cycles,
                               cycles=cycles)
        log(f"{a.label} {name:18s} {1e3 * med / cycles:.3f} ms/cycle (min {1e3 * lo / cycles:.3f}, "
            f"max {1e3 * hi / cycles:.3f}, {cycles} cycles)")

    # the cost table: whole 16-cycle calls (as measure() does) and slopes between 16- and 48-cycle calls
    table = {}
    for branch, k in enumerate(steps):
        t = {}
        for n in (16, 48):
            med, _, _, out = _timed(lambda: adaptive_start((k,))(),
                                    lambda s: adaptive(sw, s, zero, cont, jnp.int32(n)), a.repeats)
            t[n] = (med, int(out.spec.cycles) - 1)
        (t16, c16), (t48, c48) = t[16], t[48]
        table[k] = dict(call16_ms=1e3 * t16 / c16, slope_ms=1e3 * (t48 - t16) / (c48 - c16),
                        fixed_ms=1e3 * (t16 - c16 * (t48 - t16) / (c48 - c16)))
        log(f"{a.label} cost K={k}: 16-cycle call {table[k]['call16_ms']:.3f} ms/cycle, slope "
            f"{table[k]['slope_ms']:.3f} ms/cycle, call fixed {table[k]['fixed_ms']:.3f} ms")

    text = adaptive.lower(sw, adaptive_start((0,))(), zero, cont, jnp.int32(16)).compile().as_text()
    counts = _hlo_counts(text)
    log(f"{a.label} adaptive HLO top-level ops: {counts}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(out / f"adaptive-loop-{a.label}.hlo.gz", "wt") as f:
        f.write(text)
    (out / f"adaptive-overhead-{a.label}.json").write_text(json.dumps(dict(
        label=a.label, xla_flags=os.environ.get("XLA_FLAGS", ""), device=jax.devices()[0].device_kind,
        jax=jax.__version__, layers=a.layers, tiny=a.tiny, per_cycle=per_cycle, cost_table=table, hlo_ops=counts),
        indent=1))


if __name__ == "__main__":
    main()
