#!/usr/bin/env bash
# Issue 50: the 61-layer decode after the layer calls, against a lab variant carrying the residual stream between
# layers in float32 (.variant: the tree with bench/labs/residual_f32_across_layer_calls.patch applied; the old unrolled program got that from XLA's
# excess precision, the layer calls round it to bfloat16 at every layer's end), after / variant / after / variant in
# the device loop, both programs dumped and compared after optimisation (bench.labs.hlo_compare). Issue 54: the
# shared-system-prompt TTFT with the prefix cache on and off, and concurrency 16 beside 4096-token prompts.
set -uo pipefail
nvidia-smi -L
export JAXSPEC_AUTOTUNE_CACHE=/tmp/autotune-res
rows() { timeout "$1" python -m bench.loop_rows --label "$2" --layers 61 --rows decode --out "$OUT/rows/$2-$3.json" \
  2>&1 | grep -E "device loop|Error" | tail -2; }
XLA_FLAGS="--xla_dump_to=/tmp/hlo-after --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$" rows 90 after 1
(cd .variant && XLA_FLAGS="--xla_dump_to=/tmp/hlo-variant --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$" \
  rows 90 variant 1)
rows 70 after 2
(cd .variant && rows 70 variant 2)
python -m bench.labs.hlo_compare /tmp/hlo-after /tmp/hlo-variant > "$OUT/hlo-compare.txt" 2>&1; head -16 "$OUT/hlo-compare.txt"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
load() { timeout "$1" python -m bench.serve_load --modes spec --max-tokens 64 --requests-per-worker 2 ${@:3} \
  --out "$OUT/$2" 2>&1 | grep -E "^\| spec|Error|error" | tail -4; }
load 80 shared-on --concurrency 16 --system-prompt-tokens 1024 --max-context 2048
load 80 shared-off --concurrency 16 --system-prompt-tokens 1024 --max-context 2048 --prefix-cache-tokens 0
load 90 long --concurrency 16 --long-prompts 1 --long-prompt-tokens 4096 --max-context 8192
