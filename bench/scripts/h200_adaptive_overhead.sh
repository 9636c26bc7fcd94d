#!/bin/bash
# Where the adaptive program's extra time per cycle goes (bench.labs.adaptive_overhead), under XLA's default
# command buffers, with command buffers off, and with conditionals and loops recorded into them; one process each.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  for variant in default nographs condgraphs; do
    case $variant in
      default) flags="" ;;
      nographs) flags="--xla_gpu_enable_command_buffer=" ;;
      condgraphs) flags="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE" ;;
    esac
    echo "== $variant: XLA_FLAGS=$flags"
    XLA_FLAGS="$flags" timeout 175 python -m bench.labs.adaptive_overhead --layers 4 --label "$variant" \
        --out "$OUT/adaptive-overhead"
  done
} 2>&1 | tee "$OUT/run-adaptive-overhead.log"
