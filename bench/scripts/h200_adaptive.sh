#!/bin/bash
# Adaptive speculation on the H200 in one device call: against acceptance on the K2.5-shaped model, then on the
# embedded pair's prompts, then the prompts again with XLA's CUDA-graph conditionals and loops (a flag experiment).
# Files under $OUT: adaptive-acceptance/, adaptive-prompts/, adaptive-prompts-condgraph/, run-adaptive.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  echo "== adaptive against acceptance"; timeout 300 python -m bench.adaptive_acceptance --layers 4 \
      --max-new-tokens 128 --repeats 3 --out "$OUT/adaptive-acceptance"
  echo "== adaptive on the embedded pair's prompts"; timeout 150 python -m bench.adaptive_prompts --repeats 5 \
      --out "$OUT/adaptive-prompts"
  echo "== the same with conditionals and loops in CUDA graphs"
  XLA_FLAGS="--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE" timeout 120 python -m bench.adaptive_prompts --repeats 5 \
      --out "$OUT/adaptive-prompts-condgraph"
} 2>&1 | tee "$OUT/run-adaptive.log"
