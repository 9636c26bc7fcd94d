"""`python -m bench.projection_per_device`: Kimi-K2.5 on 8 x H200 at batch 1, projected from one device's program
as measured (bench.per_device on one H200) plus its collectives at assumed latencies (issue 52).

    python -m bench.projection_per_device --per-device bench/results/wave3/per-device-h200/per-device-gpu-*.json \
        --out bench/results/wave3/per-device-h200

A step on 8 devices is taken as one device's measured step (the per-device program, its collectives cut out: it runs
every kernel of every layer at the local shapes, the busiest device's experts) plus its collectives one after another,
each at the latency assumed (`--collective-us`: one figure for an all-reduce or all-gather of a [T, 7168] bf16
activation; 8 us is the class of a one-shot all-reduce over NVLink, 15 and 25 us slower implementations). What the
assumptions leave out: any overlap of a collective with the kernels beside it (none is possible in this program: each
all-reduce's output is the next kernel's input) and the busiest device's wait beyond the measured one.

Rows per routing the per-device run measured: the decode step (T = 1) and tok/s of plain decoding, the verify of
K + 1 tokens, and the K = `--cycle-k` cycle with tok/s at each of `--acceptance-lengths` (tokens a cycle; the public
Kimi-K2.5 drafters' 2.69 / 3.20 / 3.29 by default). Writes projection-per-device-<date>.json and .md to --out.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from bench.projection import load_json
from bench.report import publish

PUBLIC_ACCEPTANCE_LENGTHS = (2.69, 3.20, 3.29)
COLLECTIVE_US = (8.0, 15.0, 25.0)


def collectives(row: dict) -> int:
    """Collectives one step of the row runs on 8 devices (cut out and counted by bench.per_device)."""
    return int(sum((row.get("collectives_cut") or {}).values()))


def project(doc: dict, collective_us: list[float], acceptance_lengths: list[float], cycle_k: int) -> list[dict]:
    """One row per (routing, latency): decode, verify and cycle times on 8 devices and tok/s."""
    by = {(r["kind"], r["tokens"], r["routing"], r.get("k")): r for r in doc["rows"]}
    out = []
    for routing in dict.fromkeys(r["routing"] for r in doc["rows"]):
        decode = by.get(("decode", 1, routing, None))
        cycle = by.get(("cycle", cycle_k + 1, routing, cycle_k))
        verify = by.get(("verify", cycle_k + 1, routing, None))
        if decode is None:
            continue
        for us in collective_us:
            step = lambda r: None if r is None else r["step_ms"] + collectives(r) * us / 1e3  # noqa: E731
            decode_ms, cycle_ms, verify_ms = step(decode), step(cycle), step(verify)
            out.append(dict(routing=routing, collective_us=us, decode_ms=decode_ms, plain_tok_s=1e3 / decode_ms,
                            decode_collectives=collectives(decode), device_decode_ms=decode["step_ms"],
                            verify_ms=verify_ms, cycle_ms=cycle_ms,
                            cycle_collectives=None if cycle is None else collectives(cycle),
                            cycle_tok_s=None if cycle_ms is None else
                            {str(a): a * 1e3 / cycle_ms for a in acceptance_lengths}))
    return out


def markdown(result: dict) -> str:
    k = result["cycle_k"]
    lengths = result["acceptance_lengths"]
    lines = [f"# Kimi-K2.5 on 8 x H200, batch 1, projected from one device's program ({result['date']})", "",
             f"From `{result['per_device']}` ({result['device']}, {result['measured']}, {result['layers']} layers, "
             f"context {result['context']}): one device's measured step plus its collectives one after another at "
             f"the latency assumed (each all-reduce or all-gather of one step; no overlap). Method: "
             "bench/projection_per_device.py.", "",
             "| routing | us a collective (assumed) | collectives a decode step | decode ms | plain tok/s | "
             f"verify T = {k + 1} ms | K = {k} cycle ms | "
             + " | ".join(f"tok/s at {a} a cycle" for a in lengths) + " |",
             "|---" * (6 + len(lengths) + 1) + "|"]
    for r in result["rows"]:
        verify = "-" if r["verify_ms"] is None else f"{r['verify_ms']:.2f}"
        cycle = "-" if r["cycle_ms"] is None else f"{r['cycle_ms']:.2f}"
        tok = (["-"] * len(lengths) if r["cycle_tok_s"] is None
               else [f"{r['cycle_tok_s'][str(a)]:.0f}" for a in lengths])
        # the latency as given (`:g`): a whole-number format showed 2.5 us as "2" and 0.5 us as "0"
        lines.append(f"| {r['routing']} | {r['collective_us']:g} | {r['decode_collectives']} | "
                     f"{r['decode_ms']:.2f} | {r['plain_tok_s']:.0f} | {verify} | {cycle} | " + " | ".join(tok) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.projection_per_device", description=__doc__.split("\n")[0])
    p.add_argument("--per-device", type=Path, required=True, help="a bench.per_device JSON (measured on a GPU)")
    p.add_argument("--collective-us", type=float, nargs="+", default=list(COLLECTIVE_US),
                   help="assumed latency of one all-reduce or all-gather of a step's activation, us")
    p.add_argument("--acceptance-lengths", type=float, nargs="+", default=list(PUBLIC_ACCEPTANCE_LENGTHS),
                   help="tokens a K-cycle yields (the public Kimi-K2.5 drafters' by default)")
    p.add_argument("--cycle-k", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if any(us < 0 for us in a.collective_us) or any(x < 1 for x in a.acceptance_lengths) or a.cycle_k < 1:
        p.error("--collective-us must be >= 0, --acceptance-lengths >= 1 (tokens a cycle), --cycle-k >= 1")
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    doc = load_json("--per-device", a.per_device)
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list) or not doc["rows"]:
        raise SystemExit(f"--per-device {a.per_device}: no rows (not a bench.per_device result)")
    try:
        rows = project(doc, a.collective_us, a.acceptance_lengths, a.cycle_k)
    except (KeyError, TypeError) as e:
        raise SystemExit(f"--per-device {a.per_device}: a row lacks {e} (not a bench.per_device result)") from None
    if not rows:
        raise SystemExit(f"--per-device {a.per_device}: no decode row (T = 1) to project from")
    now = datetime.datetime.now(datetime.timezone.utc)
    first = doc["rows"][0]
    result = dict(date=now.isoformat(timespec="seconds"), per_device=str(a.per_device), device=doc.get("device"),
                  measured=doc.get("date"), layers=first.get("layers"), context=first.get("context"),
                  cycle_k=a.cycle_k, acceptance_lengths=a.acceptance_lengths, collective_us=a.collective_us,
                  rows=rows)
    publish(result, a.out, f"projection-per-device-{now.strftime('%Y%m%d-%H%M')}", markdown, print)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
