#!/bin/bash
# Issue 53: what the by-call set's cold build spends on GEMM autotuning, at LAYERS (default 61) layers: the fixed
# loop and the by-call set, each cold in a fresh process (bench.compile_adaptive --autotune cold), under XLA's
# default autotuning and each of VARIANTS (XLA flags, one variant a word, commas between flags). With PROBES=1 first
# the fresh-engine table and the prompt bench (bash bench/scripts/h200_plain_probes.sh, no build). Only JSON files
# and run.log are kept (the device returns few files).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
if [ "${PROBES:-0}" = 1 ]; then
  OUT=$OUT MISMATCHED=0 COMPILE_LAYERS="" bash bench/scripts/h200_plain_probes.sh
  mv "$OUT/run.log" "$OUT/run-probes.log"
fi
{
  for variant in default ${VARIANTS:---xla_gpu_autotune_level=1 --xla_gpu_enable_triton_gemm=false}; do
    flags=$([ "$variant" = default ] && echo "" || echo "${variant//,/ }")
    label=$(echo "$variant" | sed 's/[^a-z0-9]\{1,\}/-/g; s/^-//; s/-$//')
    echo "== $variant $(date -u +%T)"
    timeout "${VARIANT_TIMEOUT:-200}" python -m bench.compile_adaptive --layers "${LAYERS:-61}" --autotune cold \
        --xla-flags="$flags" --label "$label" --out "$OUT/compile"
  done
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v -E "^[EWI][0-9]{4} |gpu_hlo_schedule" | tee "$OUT/run.log"
find "$OUT" -name '*.md' -delete
