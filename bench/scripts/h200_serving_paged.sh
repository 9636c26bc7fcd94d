#!/usr/bin/env bash
# Issue 54 on one H200, the embedded pair in bfloat16 through bench.serve_load (the server's Python packages carried
# as wheels in .whl: the image has no uvicorn, starlette or openai). Mixed chat traffic at concurrency 1 / 16 / 64 /
# 256: a shared ~2k-token system prompt on 3 requests of 4, conversations of 2 turns resending their history, and
# one worker sending 3072-token prompts back to back beside each level. First the paged cache (--cache-pages:
# about 60% of the positions the unpaged cache allocates at 256 slots x 4096), every first turn checked against
# Engine.generate alone; then the same traffic unpaged (throughput and latency beside it).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit
nvidia-smi -L
export XLA_PYTHON_CLIENT_PREALLOCATE=false
traffic=(--modes spec --max-tokens 64 --requests-per-worker 1 --turns 2 --system-prompt-tokens 2048
         --system-prompt-share 0.75 --long-prompts 1 --long-prompt-tokens 3072 --max-context 4096
         --concurrency "${LEVELS:-1,16,64,256}")
load() { timeout "$1" python -m bench.serve_load "${traffic[@]}" ${@:3} --out "$OUT/$2" 2>&1 \
  | grep -E "^\| spec|serve_load\] spec|^Cache|Error|error" | tail -12; }
[ "${PAGED:-1}" = 1 ] && load "${PAGED_S:-330}" paged --cache-pages 10240
[ "${UNPAGED:-1}" = 1 ] && LEVELS=${UNPAGED_LEVELS:-${LEVELS:-1,16,64,256}} && traffic[-1]=$LEVELS \
  && load "${UNPAGED_S:-250}" unpaged --no-check
exit 0
