#!/usr/bin/env bash
# Issue 54 on one H200, the embedded pair in bfloat16, every run through bench.serve_load (greedy, streamed, every
# output compared with Engine.generate alone):
# 1. the load table at concurrency 1 / 16 / 64 / 256 (nothing may be lost);
# 2. a shared ~1k-token system prompt before every prompt, concurrency 16, the prefix cache on then off (TTFT);
# 3. concurrency 16 while one worker sends 4096-token prompts back to back (inter-token latency p50 / p99).
set -uo pipefail
nvidia-smi -L
export XLA_PYTHON_CLIENT_PREALLOCATE=false
load() { timeout "$1" python -m bench.serve_load --modes spec --max-tokens 64 --requests-per-worker 2 ${@:3} \
  --out "$OUT/$2" 2>&1 | grep -E "^\| spec|serve_load\] spec|Error|error" | tail -8; }
load 170 load --concurrency 1,16,64,256 --max-context 512
load 110 shared-on --concurrency 16 --system-prompt-tokens 1024 --max-context 2048
load 110 shared-off --concurrency 16 --system-prompt-tokens 1024 --max-context 2048 --prefix-cache-tokens 0
load 150 long --concurrency 16 --long-prompts 1 --long-prompt-tokens 4096 --max-context 8192
