#!/bin/bash
# Issues 51/52: o_proj's leading rows read into L2 while the attention runs (`Kernels.prefetch`, not kept: the
# stages rows / small / per need the tree of commit 2d1ca24, run from DIR after
#   git archive 2d1ca24 model jaxspec convert bench ':!bench/results' ':!jaxspec/default_model' | tar -x -C DIR
# `lab` runs in this tree), against none. STAGES: `lab` (bench.labs.l2_prefetch: the kernel on a lab layer of
# K2.5's shapes, 16 / 32 / 48 MB read ahead, and whether the outputs stay bit-identical), `rows` (bench.loop_rows,
# one device holding the model, 61 layers: decode, verify T = 4, the K = 3 cycle, each choice of ARMS in a fresh
# process), `per` (bench.per_device, one device of eight, 61 layers, neighbour routing: its o_proj block is 14.7 MB,
# read whole by o_proj16), `small` (the same rows at 4 layers), `again` (decode once more per arm while the call's
# time allows).
#   STAGES="lab rows again" bash bench/scripts/h200_prefetch_ab.sh; STAGES="per" ARMS="off o_proj16" ...
# Files under $OUT: lab/, one-<arm>-<n>.json, small-<arm>.json, per-<arm>/, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
export JAXSPEC_AUTOTUNE_CACHE=/tmp/autotune-prefetch-ab  # every arm picks from the same GEMM autotuning
ARMS=${ARMS:-off o_proj32 o_proj16}
STAGES=${STAGES:-lab rows again}
has() { [[ " $STAGES " == *" $1 "* ]]; }
rows() {  # arm, file, layers, rows...
  local arm=$1 file=$2 layers=$3; shift 3
  timeout ${ROWS_TIMEOUT:-150} python -m bench.loop_rows --label "$arm" --prefetch-kernel "$arm" --layers "$layers" \
      --rows "$@" --iters ${ITERS:-10} --out "$OUT/$file.json" 2>&1 | grep -E "device loop|Error|error" | tail -6
}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  if has lab; then
    echo "== lab $(date -u +%T)"
    timeout ${LAB_TIMEOUT:-150} python -m bench.labs.l2_prefetch --out "$OUT/lab" 2>&1 | grep -vE "^\s*$" | tail -8
  fi
  if has rows; then
    for arm in $ARMS; do
      echo "== one device, $arm 1 $(date -u +%T)"; rows "$arm" "one-$arm-1" 61 decode verify4 cycle3
    done
  fi
  if has small; then
    for arm in $ARMS; do echo "== 4 layers, $arm $(date -u +%T)"; rows "$arm" "small-$arm" 4 decode verify4 cycle3; done
  fi
  if has per; then
    for arm in $ARMS; do
      echo "== per-device $arm $(date -u +%T)"
      timeout ${PER_TIMEOUT:-200} python -m bench.per_device --prefetch-kernel "$arm" --layers 61 \
          --moe-layers repeated --tokens 1 4 --cycle-k 3 --routing neighbour --out "$OUT/per-$arm" 2>&1 \
          | grep -E "^\||Error|error" | tail -8
    done
  fi
  if has again; then
    for arm in $ARMS; do
      [ "$SECONDS" -lt "${AGAIN_BEFORE_S:-480}" ] || break
      echo "== one device, $arm 2 $(date -u +%T)"; rows "$arm" "one-$arm-2" 61 decode
    done
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v "gpu_hlo_schedule\|hlo_rematerialization" | tee "$OUT/run.log"
