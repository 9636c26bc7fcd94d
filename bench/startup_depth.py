"""`python -m bench.startup_depth`: start-up at a model's depth with random weights, as the entry points start.

- `generate`: a fresh process draws a Kimi-K2.5-shaped target of --layers layers (INT4 experts; one MoE layer's
  arrays run by every MoE layer, so drawing stays short) and its EAGLE-3 draft, builds `jaxspec.engine.Engine` as
  `python -m jaxspec.generate` does (fixed K, streamed) and streams until the first token of a 64-token prompt.
- `serve`: a fresh process builds `jaxspec.serving.slot_engine.SlotEngine` as `python -m jaxspec.serve` does (its
  default prefix cache of --max-context tokens included) and
  runs its warm-up (every program the server compiles before it listens).

Each is timed from the parent's launch of the process to the child's line saying it got there, twice: with an
empty compile cache (cold), then with the cache the first run wrote (warm), the way `jaxspec.compile_cache` keeps
programs between runs. The child also reports how long drawing the weights took, which a real checkpoint replaces
by loading. Writes startup-depth-<device>-<date>.json and .md to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT_TOKENS = 64


def child(mode: str, layers: int, k: int) -> None:
    """Runs in the timed process: prints 'drawn <seconds>' then 'ready' (serve) or 'first token' (generate)."""
    import jax

    from jaxspec import compile_cache

    compile_cache.enable()
    from bench.cycle import spec_pair
    from bench.step import bench_config, draw_weights

    t0 = time.perf_counter()
    cfg = bench_config(layers, tiny=jax.default_backend() != "gpu")
    w = draw_weights(cfg, cfg.hidden_size < 1024, moe_layers="repeated")
    spec_cfg, _, sw = spec_pair(w, cfg, cfg.hidden_size < 1024)
    sw = jax.block_until_ready(sw)
    print(f"drawn {time.perf_counter() - t0:.2f}", flush=True)
    prompt = [int(t) for t in jax.random.randint(jax.random.PRNGKey(0), (PROMPT_TOKENS,), 0, cfg.vocab_size)]
    if mode == "generate":
        from jaxspec.engine import Engine

        engine = Engine(spec_cfg, sw, num_steps=k, max_context=4096)
        next(iter(engine.stream([prompt], 32)))
        print("first token", flush=True)
    else:
        from jaxspec.serving.slot_engine import SlotEngine

        engine = SlotEngine(spec_cfg, sw, num_steps=k, max_batch=8, max_context=4096, prefix_cache_tokens=4096)
        engine.warm_up([16, 32, 64])
        print("ready", flush=True)


def timed_child(mode: str, layers: int, k: int, cache: Path, timeout_s: float) -> dict:
    env = dict(os.environ, JAXSPEC_COMPILE_CACHE=str(cache))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "bench.startup_depth", "--child", mode, "--layers", str(layers), "--k", str(k)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    wall = time.perf_counter() - t0
    lines = proc.stdout.splitlines()
    if proc.returncode != 0 or not lines or lines[-1] not in ("first token", "ready"):
        raise RuntimeError(f"{mode} at {layers} layers exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    drawn = float(next(line.split()[1] for line in lines if line.startswith("drawn ")))
    return dict(wall_s=wall, draw_s=drawn)


def markdown(result: dict) -> str:
    lines = [f"# Start-up at depth: {result['device']}, {result['date']}", "",
             "Random Kimi-K2.5-shaped weights; seconds from the process's launch to the first streamed token "
             "(generate) or to the end of the server's warm-up (serve), with an empty compile cache (cold) and with "
             "the one the cold run wrote (warm); drawing the weights is inside the wall time and shown apart.", "",
             "| entry point | layers | K | run | wall | drawing weights | wall less drawing |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['mode']} | {r['layers']} | {r['k']} | {r['run']} | {r['wall_s']:.1f} | {r['draw_s']:.1f} | "
                     f"{r['wall_s'] - r['draw_s']:.1f} |")
    lines += [f"\nerror: {e}" for e in result["errors"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.startup_depth", description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", choices=("generate", "serve"), default=["generate", "serve"])
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--k", type=int, default=3, help="draft tokens per cycle")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one process may take")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--child", choices=("generate", "serve"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.layers, args.k)
    import jax

    from bench.report import publish

    result = dict(device=jax.devices()[0].device_kind, date=datetime.date.today().isoformat(), rows=[], errors=[])
    stem = f"startup-depth-{jax.devices()[0].platform}-{result['date']}"
    for mode in args.modes:
        with tempfile.TemporaryDirectory() as cache:
            for run in ("cold", "warm"):
                try:
                    row = timed_child(mode, args.layers, args.k, Path(cache), args.timeout)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    result["errors"].append(f"{mode} {run}: {e}"[:1200])
                    print(result["errors"][-1], flush=True)
                    break
                result["rows"].append(dict(mode=mode, layers=args.layers, k=args.k, run=run, **row))
                print(f"{mode} {run}: {row['wall_s']:.1f} s (drawing {row['draw_s']:.1f} s)", flush=True)
    publish(result, args.out, stem, markdown, print)
    return result


if __name__ == "__main__":
    main()
