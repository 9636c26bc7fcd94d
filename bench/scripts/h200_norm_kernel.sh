#!/bin/bash
# Issue 36, the decode layer at depth with the fused RMSNorm kernel (model/kernels/rms_norm.py), most important first
# (each step under its own timeout, all inside one 10-minute call): the kernel held to the plain step on the device
# (bench.kernel_agreement, variants norm and engine), a 4-layer step traced kernel by kernel with the norm kernel
# and without (bench.labs.step_profile, with the optimized HLO that names what each fusion computes), then one MoE
# layer at depth with it (bench.step: the 10-layer step minus its 5-layer prefix, device loop) at T = 1 (weights
# and the two programs' compiles take ~4 minutes).
# Files under $OUT: kernel-agreement/, profile-norm-auto/, profile-norm-off/, step-depth/, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT/kernel-agreement" "$OUT/profile-norm-auto" "$OUT/profile-norm-off" "$OUT/step-depth"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  echo "== kernel_agreement $(date -u +%T)"
  timeout ${AGREEMENT_TIMEOUT:-120} python -m bench.kernel_agreement --layers 4 --experts int4 --batches 1 \
      --contexts 1024 --tokens 1 4 --variants norm engine --out "$OUT/kernel-agreement"
  for norm in auto off; do
    echo "== step_profile norm=$norm $(date -u +%T)"
    timeout ${PROFILE_TIMEOUT:-100} python -m bench.labs.step_profile --layers 4 --tokens 1 4 --norm-kernel $norm \
        --hlo --out "$OUT/profile-norm-$norm"
  done
  echo "== depth $(date -u +%T)"
  timeout ${STEP_TIMEOUT:-270} python -m bench.step --layers 10 --prefix-layers 5 --batches 1 --contexts 1024 \
      --tokens ${TOKENS:-1} --cycle-k --skip-moe-layer --skip-reference --iters 10 --routing independent \
      --norm-kernel auto --budget-s ${BUDGET_S:-200} --out "$OUT/step-depth"
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/run.log"
