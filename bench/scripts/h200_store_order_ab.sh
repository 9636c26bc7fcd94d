#!/bin/bash
# Issues 51/52: moe_wgmma's gate_up writing its rows in the down kernel's column order (`permute_K`), so XLA lays h
# out for down in one kernel instead of two, and the router's top-k kernel in fewer reductions, against the trees
# before them, in one device call: the step's agreement with the plain step (bench.kernel_agreement, 4 layers, INT4
# experts, T = 1 and 4: the experts, the router and the engine's kernels together), then one device holding the
# model (bench.loop_rows at 61 layers: decode, verify T = 4, the K = 3 cycle), then one device of eight
# (bench.per_device at 61 layers, neighbour routing, decode and verify T = 4 with the kernel census of each), each
# arm of ARMS in a fresh process: "after" is this tree, any other the tree in .<arm> (from `git archive`); then
# decode again in each arm while the call's time allows.
#   for arm in mid before; do rm -rf .$arm && mkdir .$arm; done
#   git archive BASE model jaxspec convert bench ':!bench/results' | tar -x -C .before   # before both
#   git archive MID model jaxspec convert bench ':!bench/results' | tar -x -C .mid   # the store order alone
#   ARMS="after mid before" bash bench/scripts/h200_store_order_ab.sh
# Files under $OUT: agreement/, one-<arm>-<n>.json, per-<arm>/, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
here=$(pwd)
export JAXSPEC_AUTOTUNE_CACHE=/tmp/autotune-store-order  # every arm picks from the same GEMM autotuning
ARMS=${ARMS:-after before}
tree() { [ "$1" = after ] && echo "$here" || echo "$here/.$1"; }
rows() {  # arm (of ARMS), n, rows...
  local arm=$1 n=$2; shift 2
  (cd "$(tree "$arm")" && timeout ${ROWS_TIMEOUT:-150} python -m bench.loop_rows --label "$arm" --layers 61 \
      --rows "$@" --iters ${ITERS:-10} --out "$OUT/one-$arm-$n.json") 2>&1 | grep -E "device loop|Error|error" | tail -4
}
per() {  # arm
  (cd "$(tree "$1")" && timeout ${PER_TIMEOUT:-150} python -m bench.per_device --layers 61 --moe-layers repeated \
      --tokens 1 4 --routing neighbour --out "$OUT/per-$1") 2>&1 | grep -E "^\||Error|error" | tail -6
}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  echo "== agreement $(date -u +%T)"
  timeout ${AGREE_TIMEOUT:-120} python -m bench.kernel_agreement --layers 4 --experts int4 --batches 1 \
      --contexts 1024 --tokens 1 4 --variants experts router engine --out "$OUT/agreement" 2>&1 \
      | grep -E "^\||Error|error"
  for arm in $ARMS; do echo "== one device, $arm 1 $(date -u +%T)"; rows "$arm" 1 decode verify4 cycle3; done
  for arm in $ARMS; do echo "== per-device $arm $(date -u +%T)"; per "$arm"; done
  for arm in $ARMS; do
    [ "$SECONDS" -lt "${AGAIN_BEFORE_S:-480}" ] || break
    echo "== one device, $arm 2 $(date -u +%T)"; rows "$arm" 2 decode
  done
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v "gpu_hlo_schedule\|hlo_rematerialization" | tee "$OUT/run.log"
