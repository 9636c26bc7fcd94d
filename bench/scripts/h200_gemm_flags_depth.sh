#!/bin/bash
# Issues 51/53: what XLA's GEMM autotuning options do to the 61-layer steps (bench.loop_rows: decode, verify T = 4,
# the K = 3 cycle in the device loop, one device holding the model): each arm of ARMS (flag sets of
# bench/labs/xla_flag_sets.py, default "default no-triton-gemm") in a fresh process with an autotuning directory of
# its own, ROUNDS (default 2) rounds alternating, so the first round of each arm autotunes cold and the later ones
# reuse its picks (each row's compile_s says which). Files under $OUT: <arm>-<round>.json, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for arm in ${ARMS:-default no-triton-gemm}; do
      flags=$(python3 -m bench.labs.xla_flag_sets "$arm") || exit 2
      echo "== $arm, round $round $(date -u +%T): $flags"
      XLA_FLAGS="$flags" JAXSPEC_AUTOTUNE_CACHE="/tmp/autotune-$arm" timeout "${ROWS_TIMEOUT:-170}" \
          python -m bench.loop_rows --label "$arm" --layers "${LAYERS:-61}" --rows decode verify4 cycle3 \
          --iters "${ITERS:-10}" --out "$OUT/$arm-$round.json" 2>&1 | grep -E "device loop|compile|Error|error" | tail -8
    done
  done
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v -E "^[EWI][0-9]{4} |gpu_hlo_schedule" | tee "$OUT/run.log"
