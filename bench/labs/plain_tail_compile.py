"""`python -m bench.labs.plain_tail_compile`: what the plain tails of adaptive by call cost to build (issue 53). A K
loop with a plain tail (`jaxspec.adaptive_calls.spec_loop(plain_tail=True)`) goes on with plain decoding in its own
call where its test leaves for it, so that switch costs no call; each tail compiles a plain decode step into that
K's program. This lab compiles cold, each in a fresh process (XLA keeps what it autotuned in a process, so a later
compile in the same one would be cheaper), the fixed engine's loop and the by-call set with the plain tails of each
`--tails` choice, side by side as `bench.compile_adaptive` and the engine do. Kimi-K2.5 shapes from shapes alone.
Prints one line a depth and writes plain-tail-compile-<device>-<date>.json to --out.

    python -m bench.labs.plain_tail_compile --layers 61 --tails none 1 1,2,3,4 --out /tmp/ptc
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import jax

from bench.compile_adaptive import abstract_pair, fixed_loop_spec, per_call_specs, timed_compile
from bench.step import bench_config
from jaxspec.adaptive_calls import PerCallPolicy


def tails_of(text: str) -> tuple[int, ...]:
    return () if text == "none" else tuple(int(k) for k in text.split(","))


def one(layers: int, k: int, what: str, tiny: bool) -> float:
    """Seconds to compile `what` ("fixed", or a `--tails` choice for the by-call set) cold in this process."""
    jax.config.update("jax_enable_compilation_cache", False)
    spec_cfg, sw, state = abstract_pair(bench_config(layers, tiny), tiny)
    if what == "fixed":
        return timed_compile([fixed_loop_spec(spec_cfg, sw, state, k)])
    policy = PerCallPolicy(plain_tails=tails_of(what)).validate(k)
    steps, window, tails = policy.compiled(k)
    return timed_compile(per_call_specs(spec_cfg, sw, state, steps, window, tails, policy.probe_every))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.labs.plain_tail_compile", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[61])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--tails", nargs="+", default=["none", "1", "1,2,3,4"],
                   help='plain-tail choices for the by-call set: "none" or K,K,...')
    p.add_argument("--tiny", action="store_true", help="small dimensions (a CPU smoke run)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: compile this and print seconds
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.k < 1 or min(args.layers) < 3:
        p.error("--k must be >= 1 and --layers >= 3 (the draft taps three distinct target layers)")
    if args.one is not None:
        print(json.dumps(dict(seconds=one(args.layers[0], args.k, args.one, args.tiny))), flush=True)
        return
    for t in args.tails:
        try:
            PerCallPolicy(plain_tails=tails_of(t)).validate(args.k)
        except ValueError as e:
            p.error(f"--tails {t}: {e}")
    if args.out is None:
        p.error("--out is required")
    rows = []
    for layers in args.layers:
        row = dict(layers=layers, seconds={})
        for what in ["fixed", *args.tails]:
            cmd = [sys.executable, "-m", "bench.labs.plain_tail_compile", "--one", what, "--layers", str(layers),
                   "--k", str(args.k)] + (["--tiny"] if args.tiny else [])
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            if done.returncode or not lines:
                raise SystemExit(f"{layers} layers, {what}: the compile failed: {done.stderr[-2000:]}")
            row["seconds"][what] = json.loads(lines[-1])["seconds"]
        rows.append(row)
        fixed = row["seconds"]["fixed"]
        print(f"{layers} layers: fixed K={args.k} {fixed:.2f} s; by call, plain tails "
              + "; ".join(f"{t}: {row['seconds'][t]:.2f} s ({row['seconds'][t] / fixed:.2f}x)" for t in args.tails),
              flush=True)
    dev = jax.devices()[0]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"plain-tail-compile-{dev.platform}-{date}.json").write_text(json.dumps(dict(
        device=dev.device_kind, jax=jax.__version__, k=args.k, cpus=os.cpu_count(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
