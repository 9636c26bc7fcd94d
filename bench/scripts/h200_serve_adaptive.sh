#!/bin/bash
# Issue 53 on the H200: the embedded pair served at concurrency LEVELS (default 1,16,64) with fixed K = 4, plain
# decoding and adaptive K (one K per device loop up to 4), then fixed K = 3 (KS3=0 skips it), each through
# bench.serve_load (greedy, streamed, bf16, 128 tokens a request, 4 requests a worker). Needs uvicorn and its peers
# on the path (the device image lacks them: carry their wheels). Results under $OUT/serve-adaptive/ and
# $OUT/serve-k3/, the log in $OUT/serve.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
common=(--dtype bfloat16 --max-tokens 128 --requests-per-worker 4 --concurrency "${LEVELS:-1,16,64}" --max-context 512
        --no-check)
{
  echo "== spec K=4, plain, adaptive $(date -u +%T)"
  timeout "${SERVE_TIMEOUT:-300}" python -m bench.serve_load "${common[@]}" --modes spec,base,adaptive \
      --speculative-num-steps 4 --out "$OUT/serve-adaptive"
  if [ "${KS3:-1}" = 1 ]; then
    echo "== spec K=3 $(date -u +%T)"
    timeout "${K3_TIMEOUT:-120}" python -m bench.serve_load "${common[@]}" --modes spec --speculative-num-steps 3 \
        --out "$OUT/serve-k3"
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/serve.log"
