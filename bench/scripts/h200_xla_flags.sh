#!/bin/bash
# One device call on the H200: the decode / 4-token verify steps (B=1, 1k, 4 layers) and a K=3 cycle under XLA
# command-buffer settings, each in its own process (XLA reads XLA_FLAGS once). Logs go to $OUT/flags-<name>.log.
#   bash bench/scripts/h200_xla_flags.sh
#   CONFIGS="pdl-off pdl-on" bash bench/scripts/h200_xla_flags.sh     (only these settings)
#   CONFIGS="default exclusive-lock trace-cache-64 concurrent-regions" bash bench/scripts/h200_xla_flags.sh
#                                                             (the synchronised step's graph launch; run 17: no gain)
# The named sets are in bench/labs/xla_flag_sets.py, each on top of the engine's own flags (jaxspec/xla_flags.py).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
for name in ${CONFIGS:-default no-command-buffers while-in-command-buffers}; do
  flags=$(python3 -m bench.labs.xla_flag_sets "$name") || exit 2  # the named sets: bench/labs/xla_flag_sets.py
  XLA_FLAGS="$flags" timeout "${FLAG_TIMEOUT:-150}" python3 -m bench.step --layers 4 --skip-moe-layer \
    --batches 1 --contexts 1024 --tokens 1 4 --cycle-k 3 --iters 10 --out "$OUT/flags-$name" 2>&1 \
    | grep -v -i warn > "$OUT/flags-$name.log"
  echo "== $name: $flags"; grep -E "^step|^cycle|Error|error" "$OUT/flags-$name.log" | head -8
done
