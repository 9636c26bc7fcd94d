#!/bin/bash
# One device call on the H200: the decode / 4-token verify steps (B=1, 1k, 4 layers) and a K=3 cycle under XLA
# command-buffer settings, each in its own process (XLA reads XLA_FLAGS once). Logs go to $OUT/flags-<name>.log.
#   bash bench/h200_xla_flags.sh
#   CONFIGS="pdl-off pdl-on" bash bench/h200_xla_flags.sh     (only these settings)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
declare -A FLAGS=(
  [default]=""  # the engine's own (jaxspec.xla_flags, applied on import of bench): CONCURRENT, autotune cache
  [no-command-buffers]="--xla_gpu_enable_command_buffer="
  [while-in-command-buffers]="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
  # programmatic dependent launch (Hopper): a kernel may start while the previous one drains
  [pdl-off]="--xla_gpu_enable_pdl=false --xla_gpu_enable_pdl_launch=false"
  [pdl-on]="--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true"
  # the CUDA graph's scheduling: LHS (XLA's default) orders the kernels as the latency-hiding scheduler did, CONCURRENT
  # (the engine's since run 16) lets independent ones (a layer's shared expert beside its routed experts) overlap
  [lhs]="--xla_gpu_command_buffer_scheduling_mode=LHS"
  [concurrent]="--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
)
for name in ${CONFIGS:-default no-command-buffers while-in-command-buffers}; do
  XLA_FLAGS="${FLAGS[$name]}" timeout "${FLAG_TIMEOUT:-150}" python3 -m bench.step --layers 4 --skip-moe-layer \
    --batches 1 --contexts 1024 --tokens 1 4 --cycle-k 3 --iters 10 --out "$OUT/flags-$name" 2>&1 \
    | grep -v -i warn > "$OUT/flags-$name.log"
  echo "== $name: ${FLAGS[$name]}"; grep -E "^step|^cycle|Error|error" "$OUT/flags-$name.log" | head -8
done
