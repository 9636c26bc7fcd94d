#!/usr/bin/env bash
# Issue 50, third H200 call: start-up at 61 layers with random weights, generate (first streamed token) and serve
# (end of warm-up), cold (empty compile and autotuning caches) then warm (what the cold run wrote).
set -uo pipefail
export JAXSPEC_AUTOTUNE_CACHE=/tmp/autotune-startup
nvidia-smi -L
timeout 560 python -m bench.startup_depth --layers 61 --modes generate serve --timeout 280 --out "$OUT/startup" 2>&1 \
  | grep -E "^(generate|serve)|^\||error" | tail -12
