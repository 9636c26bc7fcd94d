"""Run conversions in a fresh process and print its peak resident memory (JSON on stdout).

    python -m tests.convert_memory_probe WARMUP_SRC BIG_SRC OUT_DIR

The warm-up conversion (a one-layer checkpoint) pays the fixed costs (orbax / tensorstore thread pools,
first-save caches). Then the kernel's peak-RSS mark (VmHWM) is reset through /proc/self/clear_refs, so
`big_peak_kb - rss_before_big_kb` is what the big conversion itself adds (ru_maxrss could not be reset:
it would also hold whatever peak importing the libraries reached).
"""

import json
import sys
from pathlib import Path


def status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # "5": reset VmHWM to the current RSS (Linux >= 4.0)


def main(warm_src: str, big_src: str, out: str) -> None:
    from convert.stream import ConvertOptions, convert_checkpoint, release_host_memory

    opts = ConvertOptions(progress=False)
    convert_checkpoint(Path(warm_src), Path(out) / "warm", opts, lambda m: None)
    release_host_memory()
    reset_peak()
    before_kb = status_kb("VmRSS")
    assert status_kb("VmHWM") <= before_kb + 1024, "VmHWM reset did not take"
    convert_checkpoint(Path(big_src), Path(out) / "big", opts, lambda m: None)
    print(json.dumps({"rss_before_big_kb": before_kb, "big_peak_kb": status_kb("VmHWM")}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
