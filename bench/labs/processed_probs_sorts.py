"""`python -m bench.labs.processed_probs_sorts`: `jaxspec.sampling.processed_probs` (one sort over the vocabulary)
against its earlier form, which sorted the logits for top-k and then the probabilities for top-p.

Both are timed jitted on the same rows (median of --iters synchronized calls after a warm-up) at a few row counts
(one row: plain sampling's step; the positions a cycle or a catch-up samples) and vocabularies (the embedded model's
4096; Kimi's 163840), and their results compared. Prints a table; writes processed-probs-sorts-<device>-<date>.json
to --out.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.report import write_json
from jaxspec.sampling import SamplingParams, processed_probs


def two_sorts(logits_XV, temperature, top_k, top_p):
    """The earlier form: a sort of the logits for the k-th, a second of the probabilities for the nucleus."""
    scaled = logits_XV.astype(jnp.float32) / temperature
    v = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(sorted_desc, jnp.broadcast_to(k - 1, scaled.shape[:-1])[..., None], axis=-1)
    scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
    probs = jax.nn.softmax(scaled, axis=-1)
    sorted_probs = -jnp.sort(-probs, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = (mass_before < top_p) | (top_p >= 1.0)
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_probs, jnp.inf), axis=-1, keepdims=True)
    probs = jnp.where(probs >= cutoff, probs, 0.0)
    return probs / probs.sum(-1, keepdims=True)


def median_ms(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.labs.processed_probs_sorts", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--vocab", type=int, nargs="+", default=[4096, 163840])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    sp = SamplingParams(0.8, top_k=0, top_p=0.9).as_arrays()
    one, two = jax.jit(processed_probs), jax.jit(two_sorts)
    rows = []
    print(f"{'rows':>5} {'vocab':>7} {'one sort ms':>11} {'two sorts ms':>12} {'ratio':>6} {'max abs diff':>12}")
    for v in a.vocab:
        for n in a.rows:
            logits = jnp.asarray(np.random.default_rng(n).standard_normal((n, v)) * 3.0, jnp.float32)
            args = (logits, sp["temperature"], sp["top_k"], sp["top_p"])
            t_one, t_two = median_ms(one, args, a.iters), median_ms(two, args, a.iters)
            diff = float(jnp.max(jnp.abs(one(*args) - two(*args))))
            rows.append(dict(rows=n, vocab=v, one_sort_ms=t_one, two_sorts_ms=t_two, max_abs_diff=diff))
            print(f"{n:5d} {v:7d} {t_one:11.3f} {t_two:12.3f} {t_one / t_two:6.2f} {diff:12.2e}", flush=True)
    dev = jax.devices()[0]
    stem = f"processed-probs-sorts-{dev.platform}-{datetime.datetime.now().strftime('%Y%m%d-%H%M')}"
    path = write_json(dict(device=dev.device_kind, jax=jax.__version__, sampling="t0.8 top_p0.9", rows=rows),
                      Path(a.out), stem)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
