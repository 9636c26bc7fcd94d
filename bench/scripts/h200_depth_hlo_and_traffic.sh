#!/usr/bin/env bash
# Issue 50: is the 61-layer decode the same program after optimisation before and after the layer calls (the device
# loop measured 1-2% slower after in two pairs)? Both trees' loop programs dumped (bench.loop_rows, the old tree in
# .before) and compared (bench.labs.hlo_compare). Issue 54: then the shared-system-prompt TTFT with the prefix
# cache on and off, and concurrency 16 beside 4096-token prompts (bench/scripts/h200_serving_traffic.sh's runs 2-3).
set -uo pipefail
nvidia-smi -L
export JAXSPEC_AUTOTUNE_CACHE=/tmp/autotune-hlo
dump() { XLA_FLAGS="--xla_dump_to=/tmp/hlo-$2 --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$" timeout "$1" \
  python -m bench.loop_rows --label "$2" --layers 61 --rows decode --iters 3 --out "/tmp/rows-$2.json" 2>&1 \
  | grep -E "device loop|Error" | tail -2; }
dump 80 after
(cd .before && dump 200 before)
python -m bench.labs.hlo_compare /tmp/hlo-before /tmp/hlo-after 2>&1 | tee "$OUT/hlo-compare.txt" | head -40
export XLA_PYTHON_CLIENT_PREALLOCATE=false
load() { timeout "$1" python -m bench.serve_load --modes spec --max-tokens 64 --requests-per-worker 2 ${@:3} \
  --out "$OUT/$2" 2>&1 | grep -E "^\| spec|Error|error" | tail -4; }
load 90 shared-on --concurrency 16 --system-prompt-tokens 1024 --max-context 2048
load 90 shared-off --concurrency 16 --system-prompt-tokens 1024 --max-context 2048 --prefix-cache-tokens 0
load 110 long --concurrency 16 --long-prompts 1 --long-prompt-tokens 4096 --max-context 8192
