"""`python -m bench.labs.sass_mix REPORT.csv`: instruction mix per kernel from Nsight Compute's SASS source page.

Input: `ncu -i R.ncu-rep --page source --print-source sass --csv > R.csv` of a report taken with the
SourceCounters section (bench/labs/moe_kernel_lab.py --profile, see bench/results/README.md). Prints, per kernel,
the executed warp instructions by opcode and each opcode's share of the warp-stall samples.
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys


def _int(text: str) -> int | None:
    try:
        return int(text.replace(",", ""))
    except ValueError:
        return None


def opcode_mix(path: str) -> dict[str, dict]:
    kernels: dict[str, dict] = {}
    header, name = None, None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":
                name, header = row[1], None
                kernels[name] = {"executed": collections.Counter(), "stalls": collections.Counter()}
            elif row and row[0] == "Address":
                header = row
            elif name and header and len(row) == len(header):
                words = row[header.index("Source")].split()
                executed = _int(row[header.index("Instructions Executed")])
                if not words or executed is None:
                    continue
                opcode = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
                kernels[name]["executed"][opcode] += executed
                kernels[name]["stalls"][opcode] += _int(row[header.index("Warp Stall Sampling (All Samples)")]) or 0
    return kernels


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="+")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    for path in args.csv:
        for name, mix in opcode_mix(path).items():
            total, stalls = sum(mix["executed"].values()), max(1, sum(mix["stalls"].values()))
            print(f"{path}: {name}: {total:,} warp instructions executed")
            for op, n in mix["executed"].most_common(args.top):
                print(f"  {op:10s} {n:13,d} {100 * n / total:5.1f}%   stall samples {100 * mix['stalls'][op] / stalls:4.0f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
