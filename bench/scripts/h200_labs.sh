#!/bin/bash
# One device call on the H200 for tuning (not the reported run, which is bench/scripts/h200_run.sh):
#   the MLA attention kernel's tilings by shape (one shape x 12 tilings is ~100 s of compiles: name a few),
#   the MoE kernel candidates, and the PyTorch peer at the batches and contexts.
#   At most 8 files come back: 3 logs + their json / md.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
timeout "${ATTN_TIMEOUT:-200}" python3 -m bench.labs.attention_lab --sweep --out "$OUT" \
  ${ATTN_ARGS:---configs q16_s64_x8_w4 q32_s64_x16_w4 --batches 1 8 --contexts 1024 4096 --tokens 1 4} > "$OUT/attn.log" 2>&1
timeout "${LAB_TIMEOUT:-120}" python3 -m bench.labs.moe_kernel_lab --out "$OUT" \
  ${LAB_ARGS:---tokens 1 4 --only pairs_32_s8,pairs_64_s8,pairs_32_s4,pairs_16_k32_s8} > "$OUT/lab.log" 2>&1
timeout "${PEER_TIMEOUT:-240}" python3 -m bench.peer_hf --out "$OUT" \
  ${PEER_ARGS:---batches 1 8 --contexts 1024 32768 --no-compile --prefill-scores-gb 8} > "$OUT/peer.log" 2>&1
tail -n 3 "$OUT"/*.log
