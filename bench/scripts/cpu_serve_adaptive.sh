#!/usr/bin/env bash
# Issue 53 on this machine's CPU: the embedded pair in float32 served at concurrency 1 / 16 / 64 with fixed K = 1..4,
# plain (K = 0) and adaptive (K chosen per device loop up to 4), each through bench.serve_load (greedy, streamed,
# 64 tokens a request). Results under ${OUT:-/tmp/serve-adaptive}/k<K>/ and adaptive/.
set -uo pipefail
OUT=${OUT:-/tmp/serve-adaptive}
common=(--dtype float32 --max-tokens 64 --requests-per-worker 2 --concurrency "${LEVELS:-1,16,64}" --max-context 512
        --no-check)
for k in 1 2 3 4; do python -m bench.serve_load "${common[@]}" --modes spec --speculative-num-steps $k --out "$OUT/k$k"; done
python -m bench.serve_load "${common[@]}" --modes base,adaptive --speculative-num-steps 4 --out "$OUT/adaptive"
