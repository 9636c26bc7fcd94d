#!/bin/bash
# The second wave's H200 runs, in two device calls of under ten minutes each (each part's pieces capped by timeout):
#   PART=A bash bench/scripts/h200_wave2.sh   # drafter kinds' cycles (bench.step --draft-kinds), adaptive vs acceptance
#   PART=B bash bench/scripts/h200_wave2.sh   # adaptive on the embedded pair's prompts, the server under load
# Files under $OUT: one folder per benchmark (its JSON / markdown / PNG) and run-<PART>.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
PART=${PART:?set PART to A or B}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python -c "import jax; print('jax', jax.__version__, jax.devices())"
  if [ "$PART" = A ]; then
    echo "== drafter kinds"; timeout 200 python -m bench.step --layers 4 --batches 1 --contexts 1024 --tokens 1 \
        --cycle-k 1 2 3 4 --draft-kinds llama mla --iters 20 --loop-steps 0 --skip-moe-layer --budget-s 150 \
        --out "$OUT/drafters"
    echo "== adaptive against acceptance"; timeout 330 python -m bench.adaptive_acceptance --layers 4 \
        --max-new-tokens 128 --repeats 3 --out "$OUT/adaptive-acceptance"
  else
    echo "== adaptive on the embedded pair's prompts"; timeout 250 python -m bench.adaptive_prompts \
        --out "$OUT/adaptive-prompts"
    echo "== the server under load"; timeout 290 python -m bench.serve_load --out "$OUT/serve-load" --dtype float32 \
        --concurrency 1,4,16,64 --max-tokens 128 --requests-per-worker 2 --max-batch 64 --max-context 512
  fi
} 2>&1 | tee "$OUT/run-$PART.log"
