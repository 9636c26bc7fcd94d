#!/bin/bash
# Issues 51/52: a layer's RMSNorms at one token inside the kernels beside them (Kernels(norms="on"): norm_gemv's
# projections, q_a + kv_a, q_b and the router's logits, and latent_write's cache write; opt-in until this measures
# them) and the MLA kernel's masked query rows (a device's 8 heads without pad kernels, on since d5107a6), each
# against what ran before, in one device call per stage. Both change only the one-token step, so the rows are
# decode rows (a cycle's verify and draft steps take neither).
#   rm -rf .before && mkdir .before
#   git archive 07541c9 model jaxspec convert bench ':!bench/results' | tar -x -C .before   # before both
#   STAGE=lab bash bench/scripts/h200_norms_ab.sh   # the attention input alone (bench.labs.attention_input_lab:
#       XLA's formulations and norm_gemv at five tilings, 200-step device loops) and the step's agreement with the
#       plain step (bench.kernel_agreement, 4 layers, INT4 experts, B = 1, T = 1 and 4)
#   STAGE=one bash bench/scripts/h200_norms_ab.sh   # one device holding the model: bench.loop_rows 61-layer
#       decode, norms off / on alternating in fresh processes, twice
#   STAGE=per bash bench/scripts/h200_norms_ab.sh   # one device of eight: bench.per_device 61 layers, decode,
#       neighbour routing: the tree before, this tree off, this tree on (the kernel census of each in its JSON)
# Files under $OUT: attention-input/, agreement/, one-<arm>-<n>.json, per-<arm>/, run-<stage>.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
BEFORE=${BEFORE:-.before}
STAGE=${STAGE:-lab}
mkdir -p "$OUT"
here=$(pwd)
export JAXSPEC_AUTOTUNE_CACHE=/tmp/autotune-norms  # every arm picks from the same GEMM autotuning
decode() {  # arm (off, on), n
  timeout ${ROWS_TIMEOUT:-150} python -m bench.loop_rows --label "$1" --layers 61 --rows decode --norms "$1" \
      --iters ${ITERS:-10} --out "$OUT/one-$1-$2.json" 2>&1 | grep -E "device loop|Error|error" | tail -4
}
per() {  # arm (before, off, on)
  local dir=$here flag=(--norms "$1"); [ "$1" = before ] && dir=$here/$BEFORE && flag=()
  (cd "$dir" && timeout ${PER_TIMEOUT:-170} python -m bench.per_device --layers 61 --moe-layers repeated \
      --tokens 1 --cycle-k --routing neighbour "${flag[@]}" --out "$OUT/per-$1") 2>&1 \
      | grep -E "^\||Error|error" | tail -6
}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  if [ "$STAGE" = lab ]; then
    echo "== attention input $(date -u +%T)"
    timeout 200 python -m bench.labs.attention_input_lab --out "$OUT/attention-input"
    echo "== agreement $(date -u +%T)"
    timeout 240 python -m bench.kernel_agreement --layers 4 --experts int4 --batches 1 --contexts 1024 \
        --tokens 1 4 --variants norms attention engine --out "$OUT/agreement" 2>&1 | grep -E "^\||Error|error"
  elif [ "$STAGE" = one ]; then
    for n in 1 2; do
      echo "== on $n $(date -u +%T)"; decode on $n
      echo "== off $n $(date -u +%T)"; decode off $n
    done
  else
    for arm in on before off; do echo "== per-device $arm $(date -u +%T)"; per $arm; done
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v "gpu_hlo_schedule\|hlo_rematerialization" | tee "$OUT/run-$STAGE.log"
