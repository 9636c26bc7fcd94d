#!/bin/bash
# Issue 36's two labs written without a GPU, in one 10-minute call, most important first: the group kernels with
# one wgmma per token (bench/labs/moe_grouped_tokens.py, through h200_grouped_tokens.sh), then the attention
# input's formulations (bench/labs/attention_input_lab.py). Files under $OUT: moe-grouped-tokens/,
# attention-input/, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT/attention-input"
{
  echo "== moe_grouped_tokens $(date -u +%T)"
  LAB_TIMEOUT=${LAB_TIMEOUT:-420} bash bench/scripts/h200_grouped_tokens.sh
  echo "== attention_input_lab $(date -u +%T)"
  timeout ${INPUT_TIMEOUT:-120} python -m bench.labs.attention_input_lab --out "$OUT/attention-input"
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/run.log"
