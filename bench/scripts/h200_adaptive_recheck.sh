#!/bin/bash
# Issue 53, after the server's rule got cheaper and reports per level: the embedded pair served at concurrency
# LEVELS (default 16,64; 8 requests a worker) with fixed K = 4 and adaptive K in one server process, then fixed K = 3;
# and the 4-layer K2.5-shaped model against acceptance ACCEPTANCE (default 0 0.95; the first choice computed outside
# the timed decode, as Engine.generate computes it beside the prefill). Needs uvicorn and its peers on the path.
# Files under $OUT/serve-k4-adaptive/, $OUT/serve-k3/, $OUT/adaptive-acceptance/ and $OUT/run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
common=(--dtype bfloat16 --max-tokens 128 --requests-per-worker "${RPW:-8}" --concurrency "${LEVELS:-16,64}"
        --max-context 512 --no-check)
{
  echo "== serve: K = 4 and adaptive $(date -u +%T)"
  timeout 200 python -m bench.serve_load "${common[@]}" --modes spec,adaptive --speculative-num-steps 4 \
      --out "$OUT/serve-k4-adaptive"
  echo "== serve: K = 3 $(date -u +%T)"
  timeout 120 python -m bench.serve_load "${common[@]}" --modes spec --speculative-num-steps 3 --out "$OUT/serve-k3"
  echo "== against acceptance, 4 layers $(date -u +%T)"
  timeout 150 python -m bench.adaptive_acceptance --layers 4 --target chained --max-new-tokens 128 --repeats 3 \
      --acceptance ${ACCEPTANCE:-0 0.95} --out "$OUT/adaptive-acceptance"
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v -E "^[EWI][0-9]{4} |gpu_hlo_schedule" | tee "$OUT/run.log"
