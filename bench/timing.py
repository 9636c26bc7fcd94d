"""Device-synchronised timing: median milliseconds after warm-up, and the copy bandwidth of this device."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def median_ms(run, warmup: int = 3, iters: int = 20, wait=jax.block_until_ready) -> dict:
    """`run()` launches one step and returns its outputs; each timed call waits for them with `wait(outputs)`
    (JAX's by default; the PyTorch peer passes a CUDA synchronize).

    Returns the median and spread of the synchronised per-call times, plus the mean time per call when
    `iters` calls are queued back to back (what an engine that never waits on the host sees)."""
    for _ in range(warmup):
        wait(run())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        wait(run())
        times.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):  # one device runs them in order: waiting on the last waits on all
        out = run()  # and only the last output stays alive (20 queued 4 GB copies would not fit)
    wait(out)
    queued = (time.perf_counter() - t0) * 1e3 / iters
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "queued_mean_ms": queued,
        "iters": iters,
    }


LOOP_WARMUP = 2  # calls of a device loop before timing


def paired_ratio(rounds: list[float], against: list[float]) -> float | None:
    """Median over rounds of one engine's rate over another's in the same round. A round runs every engine once, in
    a rotated order, so a slow moment of the host or device falls on both of a pair and divides out, where a ratio
    of medians keeps it. None without rounds."""
    ratios = [a / b for a, b in zip(rounds, against) if b > 0]
    return statistics.median(ratios) if ratios else None


def summarize_rounds(row: dict, floor_ms: float) -> str:
    """A lab row timed in round-robin rounds (`row["round_ms"]`): set its median `ms` and `ratio` to `floor_ms`, and
    return "<median> us  floor <floor> us  x<ratio>" for the log line."""
    row["ms"] = statistics.median(row["round_ms"])
    row["ratio"] = row["ms"] / floor_ms
    return f"{row['ms'] * 1e3:8.1f} us  floor {floor_ms * 1e3:6.1f} us  x{row['ratio']:.2f}"


def loop_iters(iters: int) -> int:
    """Timed calls of a device loop (each runs many steps) for a benchmark that times single steps `iters` times."""
    return max(3, iters // 2)


def device_loop_ms(run_loop, steps: int, iters: int) -> dict:
    """Per-step ms of steps inside one jitted loop: `run_loop(n)` runs n steps in one call.

    A loop call also pays a fixed cost (its dispatch, the CUDA graph's launch, its first iteration's start-up)
    that a long generation pays once. So the per-step time is the slope between loops of `steps` and 3 x `steps`
    steps (`device_loop_ms`), and the fixed cost what the short loop took beyond its steps
    (`device_loop_fixed_ms`); `device_loop_chained_ms` is the short loop's time / `steps`, computed as the "device
    loop" figure of runs 1-15 was (which charged each step 1 / `steps` of the fixed cost; their loops had a static
    length, whose fixed cost is smaller). Medians of synchronised calls."""
    short, long = (median_ms(lambda n=n: run_loop(n), warmup=LOOP_WARMUP, iters=loop_iters(iters))["median_ms"]
                   for n in (steps, 3 * steps))
    per_step = (long - short) / (2 * steps)
    return dict(device_loop_ms=per_step, device_loop_fixed_ms=short - steps * per_step,
                device_loop_chained_ms=short / steps)


def device_loop_steps_run(steps: int, iters: int) -> int:
    """Steps (or cycles) that `device_loop_ms` runs in all, warm-up included: what a cache must have room for."""
    return (LOOP_WARMUP + loop_iters(iters)) * 4 * steps


def _stream_tbs(fn, gbytes: float, iters: int, passes: int) -> float:
    """TB/s of jitted `fn` over a `gbytes` bf16 array that it moves `passes` times (best of `iters` calls)."""
    n = int(gbytes * 1e9 / 2)
    x = jnp.ones((n,), jnp.bfloat16)
    run = jax.jit(fn)
    stats = median_ms(lambda: run(x), warmup=3, iters=iters)
    del x
    return passes * n * 2 / (stats["min_ms"] * 1e-3) / 1e12


def copy_bandwidth_tbs(gbytes: float = 4.0, iters: int = 20) -> float:
    """Bytes read + written per second by an XLA elementwise pass over a `gbytes` bf16 array."""
    return _stream_tbs(lambda a: a * jnp.bfloat16(1.5), gbytes, iters, passes=2)


def read_bandwidth_tbs(gbytes: float = 4.0, iters: int = 20) -> float:
    """Bytes read per second by an XLA reduction over a `gbytes` bf16 array (reads only, as a forward step does):
    what plain XLA streams from this device's memory, beside the 4.3 TB/s the issue's floors use."""
    return _stream_tbs(lambda a: jnp.sum(a, dtype=jnp.float32), gbytes, iters, passes=1)
