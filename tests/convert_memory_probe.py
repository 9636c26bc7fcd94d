"""Run conversions in a fresh process and print its peak resident memory (JSON on stdout).

    python -m tests.convert_memory_probe WARMUP_SRC BIG_SRC OUT_DIR

The warm-up conversion (a one-layer checkpoint) pays the fixed costs (orbax / tensorstore thread pools,
first-save caches), so `big_peak_kb - rss_before_big_kb` is what the big conversion's data adds.
"""

import json
import resource
import sys
from pathlib import Path


def peak_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux


def rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def main(warm_src: str, big_src: str, out: str) -> None:
    from convert.stream import ConvertOptions, convert_checkpoint

    imports_kb = peak_kb()
    opts = ConvertOptions(progress=False)
    convert_checkpoint(Path(warm_src), Path(out) / "warm", opts, lambda m: None)
    warm_kb, before_big_kb = peak_kb(), rss_kb()
    convert_checkpoint(Path(big_src), Path(out) / "big", opts, lambda m: None)
    print(json.dumps({"imports_peak_kb": imports_kb, "warm_peak_kb": warm_kb, "rss_before_big_kb": before_big_kb,
                      "big_peak_kb": peak_kb()}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
