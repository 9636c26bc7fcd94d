#!/bin/bash
# One device call on the H200: environment facts, `bench.step` (4 layers), the PyTorch peer at the issue's
# batches and contexts, then the prefill-chunking consistency check of both sides.
# At most 8 files come back: env, 2 logs, step json + md, peer json + md, prefill-consistency json.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/env.txt" 2>&1
python3 -c "import jax, torch, transformers; print(jax.__version__, jax.devices(), torch.__version__, transformers.__version__)" >> "$OUT/env.txt" 2>&1
timeout "${STEP_TIMEOUT:-260}" python3 -m bench.step --layers "${LAYERS:-4}" --budget-s "${STEP_BUDGET:-200}" \
  --iters 10 --out "$OUT" ${STEP_ARGS:-} 2>&1 | tee "$OUT/step.log"
timeout "${PEER_TIMEOUT:-230}" python3 -m bench.peer_hf --out "$OUT" \
  ${PEER_ARGS:---batches 1 8 --contexts 1024 32768 --prefill-scores-gb 8} 2>&1 | tee "$OUT/peer.log"
timeout "${CONSISTENCY_TIMEOUT:-80}" python3 -m bench.prefill_consistency --out "$OUT" 2>&1 | tail -n 5
