#!/bin/bash
# The server's step with its results written to host memory (`jaxspec.state.on_host` in run_cycles) against the
# commit before, checked out in .before/ (with this lab copied in): bench.labs.slot_step_read, the embedded pair, 16
# slots, fixed K = 4, alternating before / after / before / after processes. JSON lines in $OUT/run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  for side in before after before after; do
    dir=.; [ "$side" = before ] && dir=.before
    echo "== $side $(date -u +%T)"
    (cd "$dir" && timeout 150 python -m bench.labs.slot_step_read --rounds ${ROUNDS:-6}) 2>&1 | grep "^{\|Error"
  done
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/run.log"
