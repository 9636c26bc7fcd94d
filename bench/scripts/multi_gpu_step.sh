#!/bin/bash
# Issue 52 on a multi-GPU host (nvidia-h100-x2 .. -x8, nvidia-h200-x2 ..): the engine's steps sharded over every GPU
# of the host as `generate --mesh N` shards them (bench.step --mesh), at Kimi-K2.5's width and 61 layers (one MoE
# layer's arrays run by every MoE layer, so the weights fit on two cards): decode and verify T = 4 at 1k context, a
# K = 3 cycle, each in the device loop, and one bf16 all-reduce of [T, 7168] through the engine's psum
# (`allreduce_us`: T = 1 and 4). First the collectives the programs run, from the compiler on this host
# (bench.labs.sharded_census needs no GPU; here it checks this jax's XLA as well). BUDGET_S stops new timings.
# Files under $OUT/multi-gpu/: step-*.json and .md, sharded-census-*.json and .md, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT/multi-gpu"
N=${DEVICES:-$(nvidia-smi -L | wc -l)}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  nvidia-smi topo -m
  echo "== sharded census over $N GPUs $(date -u +%T)"
  timeout ${CENSUS_TIMEOUT:-180} python -m bench.labs.sharded_census --devices "$N" --serve-batch 0 \
      --out "$OUT/multi-gpu"
  echo "== bench.step --mesh $N $(date -u +%T)"
  timeout ${STEP_TIMEOUT:-480} python -m bench.step --mesh "$N" --layers ${LAYERS:-61} --moe-layers repeated \
      --batches 1 --contexts 1024 --tokens 1 4 --cycle-k 3 --iters ${ITERS:-10} --loop-steps 10 \
      --skip-reference --budget-s ${BUDGET_S:-360} --out "$OUT/multi-gpu"
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v "gpu_hlo_schedule\|hlo_rematerialization" | tee "$OUT/multi-gpu/run.log"
