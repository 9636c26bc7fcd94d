"""`python -m bench.startup`: how long `python -m jaxspec.generate` takes from start to exit, the first time and
again, with the compiled programs kept on disk between runs (`jaxspec.compile_cache`).

Each arm (`name=--flag value ...`) runs `--runs` fresh processes of `python -m jaxspec.generate --json` in turn, all
pointed at one new, empty cache directory under --out (JAXSPEC_COMPILE_CACHE), so every arm's first run compiles
and its later runs load. Per run: the wall time of the process, and from its JSON the compile seconds, the adaptive
cost table's measurement seconds and the decode seconds. Writes startup-<device>-<date>.json and .md to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.generate_speedup import add_run_flags, check_exit, parsed_arms
from bench.report import publish

DEFAULT_ARMS = ["default=", "fixed=--no-speculative-adaptive"]


def run_once(flags: list[str], cache: Path, timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "jaxspec.generate", "--json", *flags]
    env = dict(os.environ, JAXSPEC_COMPILE_CACHE=str(cache))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a cache given to JAX itself would take precedence
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    wall = time.perf_counter() - t0
    check_exit(proc, cmd, flags)
    doc = json.loads(proc.stdout)
    t, ad = doc["timings"], doc.get("adaptive")
    return dict(wall_s=wall, compile_s=t["compile_s"], measure_s=ad["measure_s"] if ad else 0.0,
                decode_s=t["decode_s"])


def markdown(result: dict) -> str:
    lines = [f"# `generate` start to exit: {result['machine']}, jax {result['jax']}, {result['date']}", "",
             "Fresh processes of `python -m jaxspec.generate --json` on the embedded model, one empty compile cache "
             "for the whole run (`jaxspec.compile_cache`): run 1 of an arm compiles, later runs load. Seconds.", "",
             "| arm | flags | run | wall | compile | cost table | decode |", "|---|---|---|---|---|---|---|"]
    for arm in result["arms"]:
        for i, r in enumerate(arm["runs"], 1):
            lines.append(f"| {arm['name']} | `{shlex.join(arm['flags']) or '(defaults)'}` | {i} | {r['wall_s']:.1f} | "
                         f"{r['compile_s']:.1f} | {r['measure_s']:.1f} | {r['decode_s']:.3f} |")
        later = arm["runs"][1:]
        if later:
            lines.append(f"| {arm['name']} | | runs 2-{len(arm['runs'])}, median | "
                         f"{statistics.median(r['wall_s'] for r in later):.1f} | "
                         f"{statistics.median(r['compile_s'] for r in later):.1f} | "
                         f"{statistics.median(r['measure_s'] for r in later):.1f} | "
                         f"{statistics.median(r['decode_s'] for r in later):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n")[0])
    add_run_flags(p, DEFAULT_ARMS, 3, "processes per arm (the first compiles)")
    a = p.parse_args(argv)
    arms = parsed_arms(p, a)
    import jax  # noqa: PLC0415 - only for the report's header; the runs are subprocesses

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now()
    result = dict(machine=jax.devices()[0].device_kind, jax=jax.__version__,
                  date=now.astimezone().isoformat(timespec="seconds"),
                  arms=[dict(name=n, flags=f, runs=[]) for n, f in arms])
    with tempfile.TemporaryDirectory(prefix="compile-cache-", dir=out) as cache:
        for i in range(a.runs):
            for arm in result["arms"]:
                row = run_once(arm["flags"], Path(cache), a.timeout_s)
                arm["runs"].append(row)
                print(f"run {i + 1}/{a.runs} {arm['name']:>10s} wall {row['wall_s']:.1f} s compile "
                      f"{row['compile_s']:.1f} s table {row['measure_s']:.1f} s decode {row['decode_s']:.3f} s",
                      flush=True)
    publish(result, out, f"startup-{jax.default_backend()}-{now.strftime('%Y%m%d-%H%M')}", markdown, print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
