"""`python -m bench.generate_speedup`: what `python -m jaxspec.generate --baseline` prints, over repeated runs.

Each run is a fresh process, as a user's is: its own compilation and, with adaptive speculation, its own cost table
(a CPU keeps no table on disk). One run's printed speedup is already a median of interleaved rounds, but on a shared
machine it still moves from run to run; the distribution over runs is what a user sees. Arms are flag sets
(`name=--flag value ...`), run in turn so drift in the machine's speed falls on every arm alike. Mode `stream` is
the terminal default (the figure is read from the printed line), `json` times the on-device loop (`--json`).
Writes generate-speedup-<device>-<date>.json and .md to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from bench.report import publish

DEFAULT_ARMS = ["default=", "fixed=--no-speculative-adaptive", "adaptive=--speculative-adaptive"]
SPEEDUP_LINE = re.compile(r"speedup (\d+\.\d+)x \((?:(\d+\.\d+)-(\d+\.\d+)x over \d+ rounds|1 round)\)")
K_LINE = re.compile(r"cycles per K \{([^}]*)\}")


def parse_arm(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--arms {text!r}: expected NAME=FLAGS (FLAGS may be empty)")
    return name, shlex.split(flags)


def add_run_flags(p: argparse.ArgumentParser, default_arms: list[str], runs: int, runs_help: str) -> None:
    """--arms, --runs, --timeout-s and --out, as the benches that run generate in fresh processes take them."""
    p.add_argument("--arms", nargs="+", default=default_arms, help="NAME=FLAGS for generate (FLAGS may be empty)")
    p.add_argument("--runs", type=int, default=runs, help=runs_help)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per process")
    p.add_argument("--out", required=True, help="results folder (JSON, markdown)")


def parsed_arms(p: argparse.ArgumentParser, a) -> list[tuple[str, list[str]]]:
    if a.runs < 1:
        p.error(f"--runs must be >= 1, got {a.runs}")
    return [parse_arm(t) for t in a.arms]


def check_exit(proc: subprocess.CompletedProcess, cmd: list[str], flags: list[str]) -> None:
    """A generate process that failed: status 2 is generate's own one-line refusal of bad input (an arm's flags),
    reported as one line naming them (SystemExit); any other status is a failure of the run (RuntimeError)."""
    if proc.returncode == 0:
        return
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    if proc.returncode == 2:
        raise SystemExit(f"--arms: generate refused the flags {shlex.join(flags)!r}: {last}")
    raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}: {last}")


def run_once(flags: list[str], mode: str, timeout_s: float) -> dict:
    """One `generate --baseline` process; its printed speedup, range and (adaptive) cycles per K."""
    cmd = [sys.executable, "-m", "jaxspec.generate", "--baseline", *flags] + (["--json"] if mode == "json" else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    check_exit(proc, cmd, flags)
    if mode == "json":
        doc = json.loads(proc.stdout)
        b, ad = doc["baseline"], doc.get("adaptive")
        return dict(speedup=b["speedup"], low=b["speedup_min"], high=b["speedup_max"],
                    k_histogram=None if ad is None else {int(k): n for k, n in ad["k_histogram"].items()},
                    costs_ms=None if ad is None else ad["costs_ms"])
    printed = proc.stdout + proc.stderr  # the statistics go to stderr, the generated text to stdout
    m = SPEEDUP_LINE.search(printed)
    if m is None:
        raise RuntimeError(f"{shlex.join(cmd)}: no speedup line in its output")
    speedup = float(m.group(1))
    ks = K_LINE.search(printed)
    hist = None if ks is None else {int(k.split("=")[1]): int(n) for k, n in
                                    (part.strip().split(": ") for part in ks.group(1).split(","))}
    return dict(speedup=speedup, low=float(m.group(2) or speedup), high=float(m.group(3) or speedup),
                k_histogram=hist, costs_ms=None)


def summary(rows: list[dict], floor: float) -> dict:
    s = [r["speedup"] for r in rows]
    return dict(runs=len(s), median=statistics.median(s), low=min(s), high=max(s),
                below=sum(1 for x in s if x < floor))


def markdown(result: dict) -> str:
    lines = [f"# `generate --baseline` over repeated runs: {result['machine']}, jax {result['jax']}, {result['date']}",
             "", f"Each run a fresh process of `python -m jaxspec.generate --baseline` on the embedded model; arms run "
             f"in turn. Cells: the printed speedups (each a median of {result['rounds_note']}).", "",
             f"| arm | flags | mode | runs | median | lowest | highest | below {result['floor']:.2f}x | printed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm in result["arms"]:
        for mode, rows in arm["modes"].items():
            s = summary(rows, result["floor"])
            printed = ", ".join(f"{r['speedup']:.2f}" for r in rows)
            lines.append(f"| {arm['name']} | `{shlex.join(arm['flags']) or '(defaults)'}` | {mode} | {s['runs']} | "
                         f"{s['median']:.3f} | {s['low']:.2f} | {s['high']:.2f} | {s['below']} | {printed} |")
    hists = [(arm["name"], mode, r["k_histogram"]) for arm in result["arms"] for mode, rows in arm["modes"].items()
             for r in rows if r["k_histogram"]]
    if hists:
        lines += ["", "Adaptive cycles per K, run by run:", ""]
        lines += [f"- {name} ({mode}): {h}" for name, mode, h in hists]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.generate_speedup", description=__doc__.split("\n")[0])
    add_run_flags(p, DEFAULT_ARMS, 5, "processes per arm and mode")
    p.add_argument("--modes", nargs="+", choices=["stream", "json"], default=["stream", "json"])
    p.add_argument("--floor", type=float, default=0.95, help="count the runs that print a speedup below this")
    a = p.parse_args(argv)
    arms = parsed_arms(p, a)
    import jax  # noqa: PLC0415 - only for the report's header; the runs are subprocesses

    now = datetime.datetime.now()
    result = dict(machine=f"{jax.devices()[0].device_kind} ({platform.machine()}, {platform.processor() or 'cpu'})",
                  jax=jax.__version__, date=now.astimezone().isoformat(timespec="seconds"), floor=a.floor,
                  rounds_note="generate's default interleaved rounds",
                  arms=[dict(name=n, flags=f, modes={m: [] for m in a.modes}) for n, f in arms])
    for i in range(a.runs):
        for mode in a.modes:
            for arm in result["arms"]:
                row = run_once(arm["flags"], mode, a.timeout_s)
                arm["modes"][mode].append(row)
                print(f"run {i + 1}/{a.runs} {arm['name']:>10s} {mode:6s} {row['speedup']:.2f}x "
                      f"({row['low']:.2f}-{row['high']:.2f}) {row['k_histogram'] or ''}", flush=True)
    publish(result, Path(a.out), f"generate-speedup-{jax.default_backend()}-{now.strftime('%Y%m%d-%H%M')}",
            markdown, print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
