#!/usr/bin/env bash
# Issue 50, fourth H200 call: a second before/after pair of the 61-layer decode in the device loop (after, before,
# after: the first call's single pair differed by 1.2%, inside what one pair can tell), both trees sharing one
# autotuning cache; then the three 61-layer programs of record (decode, verify T = 4, cycle K = 3) compiled cold in
# one process and loaded from the persistent cache in a later one. .before: the checkout before the layer calls
# (git archive bbc6db0) with bench/loop_rows.py copied in, carried.
set -uo pipefail
nvidia-smi -L
export JAXSPEC_AUTOTUNE_CACHE=/tmp/autotune-ab
rows() { timeout "$1" python -m bench.loop_rows --label "$2" --layers 61 --rows decode --out "$OUT/rows/$2-61-$3.json" \
  2>&1 | grep -E "device loop|Error|error" | tail -3; }
rows 100 after 1
(cd .before && rows 220 before 1)
rows 80 after 2
export JAXSPEC_AUTOTUNE_CACHE=off
timeout 110 python -m bench.compile_depth --layers 61 --programs decode verify4 cycle3 --cache-dir /tmp/cc-3 \
  --out "$OUT/cold" 2>&1 | grep -E "^\| 61" | tail -4
timeout 60 python -m bench.compile_depth --layers 61 --programs decode verify4 cycle3 --cache-dir /tmp/cc-3 --warm \
  --out "$OUT/warm" 2>&1 | grep -E "^\| 61" | tail -4
