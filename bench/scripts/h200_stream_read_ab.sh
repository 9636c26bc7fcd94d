#!/bin/bash
# Streaming's progress written to host memory (`jaxspec.state.with_progress` through `on_host`) against the commit
# before, checked out in .before/ (with this lab copied in): bench.labs.stream_read, the embedded pair streamed with
# fixed K = 4 and the default adaptive kind, alternating before / after / before / after processes. JSON lines in
# $OUT/run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  for side in before after before after; do
    dir=.; [ "$side" = before ] && dir=.before
    echo "== $side $(date -u +%T)"
    (cd "$dir" && timeout ${RUN_TIMEOUT:-70} python -m bench.labs.stream_read --prompts ${PROMPTS:-2} \
        --rounds ${ROUNDS:-5}) 2>&1 | grep "^{\|Error"
  done
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/run.log"
