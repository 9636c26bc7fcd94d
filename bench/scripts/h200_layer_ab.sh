#!/bin/bash
# Issues 51/52: a change to the layer's kernels against the tree before it, in device calls of STAGES: the step's
# agreement with the plain step (bench.kernel_agreement, 4 layers, INT4 experts, T = 1 and 4: the experts, the
# router and the engine's kernels together), one device holding the model (bench.loop_rows at 61 layers: decode,
# verify T = 4, the K = 3 cycle; and at 4 layers), one device of eight (bench.per_device at 61 layers, neighbour
# routing, decode and verify T = 4 and the K = 3 cycle, with the kernel census of each), a profile of 6 layers at
# T = 1 (bench.labs.step_profile: each kernel's time in launch order), each arm of ARMS in a fresh
# process: "after" is this tree, any other the tree in .<arm> (from `git archive`); then decode again in each arm
# while the call's time allows. Run as the store-order A/B (2026-12-05 04:46) under its earlier name
# h200_store_order_ab.sh, with ARMS="after mid before", every stage in one call and per-device all cycle K.
#   for arm in mid before; do rm -rf .$arm && mkdir .$arm; done
#   git archive BASE model jaxspec convert bench ':!bench/results' ':!jaxspec/default_model' | tar -x -C .before
#   STAGES="agreement rows again" bash bench/scripts/h200_layer_ab.sh; STAGES=per bash bench/scripts/h200_layer_ab.sh
# The factored norms (docs/performance.md; the code at fd3edca), each kernel's time against this tree's:
#   git archive fd3edca model jaxspec convert bench ':!bench/results' ':!jaxspec/default_model' | tar -x -C .factored
#   the same into .attention, then (cd .attention && patch -p1 < ../bench/labs/norm_factors_attention_only.patch),
#   which leaves the router's norm as before; ARMS="factored attention after" STAGES="profile again"
# The device's choices taken by moe_wgmma itself and the local choices' filler slot by slot (kept after this A/B,
# 2026-12-05 12:33) against both in XLA as before, one device of eight (bench.per_device holds the engine's per-step
# local choices since then):
#   git archive HEAD model jaxspec convert bench ':!bench/results' ':!jaxspec/default_model' | tar -x -C .xla
#   (cd .xla && patch -p1 < ../bench/labs/local_choices_in_xla.patch); ARMS="after xla" STAGES="per"
# The LoRA norms' sums over the whole row (bench/labs/lora_norm_sums_whole_row.patch; timed 12:38, not kept):
#   git archive HEAD model jaxspec convert bench ':!bench/results' ':!jaxspec/default_model' | tar -x -C .sums
#   (cd .sums && patch -p1 < ../bench/labs/lora_norm_sums_whole_row.patch); ARMS="sums after" STAGES="rows per again"
# Files under $OUT: agreement/, one-<arm>-<n>.json, small-<arm>.json, profile-<arm>/, per-<arm>/, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
here=$(pwd)
export JAXSPEC_AUTOTUNE_CACHE=/tmp/autotune-layer-ab  # every arm picks from the same GEMM autotuning
ARMS=${ARMS:-after before}
STAGES=${STAGES:-agreement rows per again}
tree() { [ "$1" = after ] && echo "$here" || echo "$here/.$1"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
rows() {  # arm (of ARMS), file, layers, rows...
  local arm=$1 file=$2 layers=$3; shift 3
  (cd "$(tree "$arm")" && timeout ${ROWS_TIMEOUT:-150} python -m bench.loop_rows --label "$arm" --layers "$layers" \
      --rows "$@" --iters ${ITERS:-10} --out "$OUT/$file.json") 2>&1 | grep -E "device loop|Error|error" | tail -6
}
per() {  # arm
  (cd "$(tree "$1")" && timeout ${PER_TIMEOUT:-200} python -m bench.per_device --layers 61 --moe-layers repeated \
      --tokens 1 4 --cycle-k 3 --routing neighbour --out "$OUT/per-$1") 2>&1 | grep -E "^\||Error|error" | tail -8
}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  if has agreement; then
    echo "== agreement $(date -u +%T)"
    timeout ${AGREE_TIMEOUT:-120} python -m bench.kernel_agreement --layers 4 --experts int4 --batches 1 \
        --contexts 1024 --tokens 1 4 --variants experts router engine --out "$OUT/agreement" 2>&1 \
        | grep -E "^\||Error|error"
  fi
  if has rows; then
    for arm in $ARMS; do
      echo "== one device, $arm 1 $(date -u +%T)"; rows "$arm" "one-$arm-1" 61 decode verify4 cycle3
    done
  fi
  if has small; then
    for arm in $ARMS; do echo "== 4 layers, $arm $(date -u +%T)"; rows "$arm" "small-$arm" 4 decode verify4 cycle3; done
  fi
  if has profile; then  # where a layer's time goes, kernel by kernel (6 layers, T = 1, the JAX profiler)
    for arm in $ARMS; do
      echo "== profile $arm $(date -u +%T)"
      (cd "$(tree "$arm")" && timeout ${PROFILE_TIMEOUT:-120} python -m bench.labs.step_profile --layers 6 --tokens 1 \
          --steps 10 --out "$OUT/profile-$arm") 2>&1 | grep -E "Error|error" | tail -3
    done
  fi
  if has per; then
    for arm in $ARMS; do echo "== per-device $arm $(date -u +%T)"; per "$arm"; done
  fi
  if has again; then
    for arm in $ARMS; do
      [ "$SECONDS" -lt "${AGAIN_BEFORE_S:-480}" ] || break
      echo "== one device, $arm 2 $(date -u +%T)"; rows "$arm" "one-$arm-2" 61 decode
    done
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v "gpu_hlo_schedule\|hlo_rematerialization" | tee "$OUT/run.log"
