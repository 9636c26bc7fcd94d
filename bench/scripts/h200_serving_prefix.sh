#!/usr/bin/env bash
# Issue 54 on one H200, the embedded pair in bfloat16 through bench.serve_load (the server's Python packages carried
# as wheels in .whl: the image has no uvicorn, starlette or openai): a shared ~1k-token system prompt before every
# prompt at concurrency 16, the prefix cache on then off (TTFT); then concurrency 16 while one worker sends 4096-token
# prompts back to back (3968 tokens: the embedded
# target has 4096 positions; inter-token latency p50 / p99).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit
nvidia-smi -L
export XLA_PYTHON_CLIENT_PREALLOCATE=false
load() { timeout "$1" python -m bench.serve_load --modes spec --max-tokens 64 --requests-per-worker 2 --no-check \
  ${@:3} --out "$OUT/$2" 2>&1 | grep -E "^\| spec|Error|error" | tail -4; }
load 75 shared-on --concurrency 16 --system-prompt-tokens 1024 --max-context 2048
load 75 shared-off --concurrency 16 --system-prompt-tokens 1024 --max-context 2048 --prefix-cache-tokens 0
load 85 long --concurrency 16 --long-prompts 1 --long-prompt-tokens 3968 --max-context 4096
