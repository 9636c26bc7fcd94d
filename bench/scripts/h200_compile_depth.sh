#!/usr/bin/env bash
# Issue 50, first H200 call: what each program costs to build at 4, 10 and 61 layers with every layer a call of one
# jitted function (trace / lower / XLA compile apart, cold then from JAX's persistent cache; XLA's compile of the
# 61-layer decode profiled pass by pass), and the 61-layer decode step timed as bench.step times it.
# Cold means cold: the autotuner keeps no results between programs (JAXSPEC_AUTOTUNE_CACHE=off).
set -uo pipefail
export JAXSPEC_AUTOTUNE_CACHE=off
nvidia-smi -L
python -m bench.compile_depth --layers 4 61 --programs decode verify4 cycle3 --cache-dir /tmp/cc-a \
  --profile decode --profile-top 60 --out "$OUT/depth" 2>&1 | grep -v "^|" | tail -20
python -m bench.compile_depth --layers 10 --programs decode --cache-dir /tmp/cc-b --out "$OUT/depth10" 2>&1 \
  | grep -v "^|" | tail -5
python -m bench.step --layers 61 --moe-layers repeated --batches 1 --contexts 1024 --tokens 1 --iters 10 \
  --skip-moe-layer --skip-reference --out "$OUT/step61" 2>&1 | grep -E "^step|compile|weights|error" | tail -10
