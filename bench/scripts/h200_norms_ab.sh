#!/bin/bash
# Run 2026-12-05 01:40 at commit d5078cb (bench/results/wave3/norms-ab-0140/). The norms family lost and left the
# code after it: its --norms flags exist only at that commit; run it there (git worktree add ... d5078cb).
# Issues 51/52: a layer's RMSNorms inside the kernels beside them for up to 8 tokens (Kernels(norms="on"):
# norm_gemv's projections, q_a + kv_a, q_b, the router's logits and the shared expert's gate and up, and
# latent_write's cache writes; opt-in until this measures them) and the MLA kernel's masked query rows (a device's
# 8 heads at one token without pad kernels, on since d5107a6), against what ran before, in one device call per
# stage. Decode, verify and the cycle all take them.
#   rm -rf .before && mkdir .before
#   git archive 07541c9 model jaxspec convert bench ':!bench/results' | tar -x -C .before   # before both
#   STAGE=lab bash bench/scripts/h200_norms_ab.sh   # the attention input alone (bench.labs.attention_input_lab:
#       XLA's formulations and norm_gemv at five tilings, 200-step device loops) and the step's agreement with the
#       plain step (bench.kernel_agreement, 4 layers, INT4 experts, B = 1, T = 1 and 4), and the MLA kernels'
#       masked query rows against XLA (bench.labs.mla_query_rows)
#   STAGE=one bash bench/scripts/h200_norms_ab.sh   # one device holding the model: bench.loop_rows at 61 layers,
#       decode, verify T = 4 and the K = 3 cycle, norms on then off in fresh processes; then decode again, on and
#       off, while the call's time allows
#   STAGE=per bash bench/scripts/h200_norms_ab.sh   # one device of eight: bench.per_device at 61 layers, decode,
#       verify T = 4 and the K = 3 cycle, neighbour routing, for each of ARMS (default "on off"; "before": the tree
#       in $BEFORE), the kernel census of each in its JSON
# Files under $OUT: attention-input/, agreement/, one-<arm>-<n>.json, per-<arm>/, run-<stage>.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
BEFORE=${BEFORE:-.before}
STAGE=${STAGE:-lab}
mkdir -p "$OUT"
here=$(pwd)
export JAXSPEC_AUTOTUNE_CACHE=/tmp/autotune-norms  # every arm picks from the same GEMM autotuning
rows() {  # arm (off, on), n, rows...
  local arm=$1 n=$2; shift 2
  timeout ${ROWS_TIMEOUT:-180} python -m bench.loop_rows --label "$arm" --layers 61 --rows "$@" --norms "$arm" \
      --iters ${ITERS:-10} --out "$OUT/one-$arm-$n.json" 2>&1 | grep -E "device loop|Error|error" | tail -4
}
per() {  # arm (before, off, on)
  local dir=$here flag=(--norms "$1"); [ "$1" = before ] && dir=$here/$BEFORE && flag=()
  (cd "$dir" && timeout ${PER_TIMEOUT:-250} python -m bench.per_device --layers 61 --moe-layers repeated \
      --tokens 1 4 --cycle-k 3 --routing neighbour "${flag[@]}" --out "$OUT/per-$1") 2>&1 \
      | grep -E "^\||Error|error" | tail -6
}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  if [ "$STAGE" = lab ]; then
    echo "== attention input $(date -u +%T)"
    timeout 200 python -m bench.labs.attention_input_lab --out "$OUT/attention-input"
    echo "== MLA kernels at a device's 8 heads (masked query rows) $(date -u +%T)"
    timeout 120 python -m bench.labs.mla_query_rows
    echo "== agreement $(date -u +%T)"
    timeout 240 python -m bench.kernel_agreement --layers 4 --experts int4 --batches 1 --contexts 1024 \
        --tokens 1 4 --variants norms attention engine --out "$OUT/agreement" 2>&1 | grep -E "^\||Error|error"
  elif [ "$STAGE" = one ]; then
    echo "== on 1 $(date -u +%T)"; rows on 1 decode verify4 cycle3
    echo "== off 1 $(date -u +%T)"; rows off 1 decode verify4 cycle3
    if [ "$SECONDS" -lt "${AGAIN_BEFORE_S:-400}" ]; then
      echo "== on 2 $(date -u +%T)"; rows on 2 decode
      echo "== off 2 $(date -u +%T)"; rows off 2 decode
    fi
  else
    for arm in ${ARMS:-on off}; do echo "== per-device $arm $(date -u +%T)"; per "$arm"; done
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v "gpu_hlo_schedule\|hlo_rematerialization" | tee "$OUT/run-$STAGE.log"
