"""`python -m bench.labs.hlo_compare DIR_A DIR_B`: whether two XLA dumps (`--xla_dump_to`, text) of one program
compiled from two trees are the same program after optimisation.

For each dump the largest module after optimisations is taken (the program of interest dwarfs the weight draws
beside it). Its instructions are counted by opcode and by custom-call target, and its lines are compared with the
names, metadata and ids taken out, so only what would run differently shows: opcodes, shapes, layouts, fusion
kinds, backend configs. Prints the counts side by side and the lines only one side has (most frequent first).
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

_INSTR = re.compile(r"^\s*(ROOT )?%?[\w.\-]+ = (.+?) ([a-z][\w\-]*)\(")
_NAMES = re.compile(r"%[\w.\-]+")
_META = re.compile(r", metadata=\{[^}]*\}|, backend_config=\{.*\}$|, frontend_attributes=\{[^}]*\}")


def largest_module(folder: Path) -> Path:
    files = sorted(folder.glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    if not files:
        raise SystemExit(f"{folder}: no *after_optimizations.txt (dump with --xla_dump_hlo_as_text)")
    return files[-1]


def summary(path: Path) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
    ops, targets, lines = collections.Counter(), collections.Counter(), collections.Counter()
    for line in path.read_text().splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        ops[m.group(3)] += 1
        t = re.search(r'custom_call_target="([^"]+)"', line)
        if t:
            targets[t.group(1)] += 1
        lines[_NAMES.sub("%", _META.sub("", line.strip()))] += 1
    return ops, targets, lines


def main(argv=None):
    a, b = (Path(x) for x in (argv or sys.argv[1:]))
    (pa, pb) = largest_module(a), largest_module(b)
    (oa, ta, la), (ob, tb, lb) = summary(pa), summary(pb)
    print(f"A {pa.name} ({pa.stat().st_size} B), B {pb.name} ({pb.stat().st_size} B)")
    print("opcode counts that differ (A, B):")
    for op in sorted(set(oa) | set(ob)):
        if oa[op] != ob[op]:
            print(f"  {op}: {oa[op]} {ob[op]}")
    print(f"instructions: {sum(oa.values())} {sum(ob.values())}; custom calls: {dict(ta)} | {dict(tb)}")
    only_a, only_b = la - lb, lb - la
    print(f"normalised lines only in A: {sum(only_a.values())}, only in B: {sum(only_b.values())}")
    for name, only in (("A", only_a), ("B", only_b)):
        for line, n in only.most_common(8):
            print(f"  {name} x{n}: {line[:300]}")


if __name__ == "__main__":
    main()
