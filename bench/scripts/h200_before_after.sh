#!/bin/bash
# The step of record on an older tree and on this one, in one device call, then the kernel agreement on this one:
# a change that should not move performance (a refactor) is held to the same figures on the same machine.
#   OLD=.old bash bench/scripts/h200_before_after.sh
# OLD is a checkout of the earlier commit's code (e.g. `git archive <commit> model jaxspec convert bench | tar -x -C
# .old`, carried to the device). Files under $OUT: step-{before,after}-*.json / .md, agreement .json / .md, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
OLD=${OLD:?set OLD to the earlier tree}
STEP_ARGS=${STEP_ARGS:-"--layers 4 --batches 1 --contexts 1024 --tokens 1 4 --cycle-k 3 --iters 10 --budget-s 160"}
mkdir -p "$OUT/before" "$OUT/after" "$OUT/agree"
here=$(pwd)
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python -c "import jax; print('jax', jax.__version__, jax.devices())"
  echo "== before ($OLD)"; (cd "$OLD" && timeout 215 python -m bench.step $STEP_ARGS --out "$OUT/before")
  echo "== after"; (cd "$here" && timeout 215 python -m bench.step $STEP_ARGS --out "$OUT/after")
  echo "== kernel agreement"; timeout 130 python -m bench.kernel_agreement --experts int4 --layers 4 --batches 1 8 \
      --contexts 1024 --tokens 1 4 --out "$OUT/agree"
} 2>&1 | tee "$OUT/run.log"
