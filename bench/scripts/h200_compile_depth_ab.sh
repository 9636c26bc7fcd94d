#!/usr/bin/env bash
# Issue 50, second H200 call: the rows of record before and after every layer became a call of one jitted function,
# in one call: the 4-layer decode / verify T = 4 / cycle K = 3 and the 61-layer decode in the device loop, the old
# tree first (.before: the checkout before the change, carried, with bench/loop_rows.py copied in), both sharing one
# autotuning cache so they run the same kernels. Then the 61-layer decode compiled cold in one process and loaded
# from the persistent cache in a fresh one, the load profiled.
set -uo pipefail
nvidia-smi -L
rows() { timeout "$1" python -m bench.loop_rows --label "$2" --layers "$3" --rows ${@:4} --out "$OUT/rows/$2-$3.json" \
  2>&1 | grep -E "device loop|Error|error" | tail -5; }
(cd .before && rows 100 before 4 decode verify4 cycle3)
rows 90 after 4 decode verify4 cycle3
(cd .before && rows 210 before 61 decode)
rows 80 after 61 decode
export JAXSPEC_AUTOTUNE_CACHE=off
timeout 60 python -m bench.compile_depth --layers 61 --programs decode --cache-dir /tmp/cc-w --out "$OUT/cold" 2>&1 \
  | grep -E "^ *61|^\| 61" | tail -3
timeout 60 python -m bench.compile_depth --layers 61 --programs decode --cache-dir /tmp/cc-w --warm --profile decode \
  --profile-top 40 --out "$OUT/warm" 2>&1 | grep -E "^ *61|^\| 61" | tail -3
