#!/bin/bash
# One lab (python -m bench.labs.$LAB $LAB_ARGS, printing a JSON line) on the commit before and on this tree, in
# processes alternating before / after / before / after (the spread between processes shows beside the change).
# .before/ holds the earlier commit's code (`git archive <commit> jaxspec model convert bench pyproject.toml | tar -x
# -C .before`, without bench/results) with this lab copied in. Used for the reads from host memory:
#   LAB=slot_step_read LAB_ARGS="--rounds 6" bash bench/scripts/h200_lab_ab.sh
#   LAB=stream_read LAB_ARGS="--prompts 2 --rounds 5" RUN_TIMEOUT=60 bash bench/scripts/h200_lab_ab.sh
# JSON lines in $OUT/run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
LAB=${LAB:?set LAB to a module of bench/labs}
mkdir -p "$OUT"
{
  for side in before after before after; do
    dir=.; [ "$side" = before ] && dir=.before
    echo "== $side $(date -u +%T)"
    (cd "$dir" && timeout "${RUN_TIMEOUT:-150}" python -m "bench.labs.$LAB" ${LAB_ARGS:-}) 2>&1 | grep "^{\|Error"
  done
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/run.log"
