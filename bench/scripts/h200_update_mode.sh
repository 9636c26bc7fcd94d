#!/bin/bash
# XLA's command-buffer update modes on the H200: the update modes this jaxlib knows, then bench.labs.adaptive_call
# (fixed K = 3, adaptive forced to K = 3, the rule) on one prompt under each mode named in MODES (default: XLA's
# default and the modes that keep command-buffer addresses stable). Files under $OUT: update-mode/<mode>/, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT/update-mode"
{
  jaxlib_dir=$(python -c "import jaxlib, os; print(os.path.dirname(jaxlib.__file__))")
  plugin_dir=$(python -c "import jax_plugins, os; print(os.path.dirname(list(jax_plugins.__path__)[0]))" 2>/dev/null)
  echo "== update modes this jaxlib knows"
  find "$jaxlib_dir" ${plugin_dir:+"$plugin_dir"/jax_plugins} -name "*.so" -print0 2>/dev/null | xargs -0 strings -n 6 \
      | grep -x "ALWAYS_UPDATE\|SKIP_TEMP\|SKIP_PROFILED\|NEVER_UPDATE\|VMM_PERSISTENT_TEMP\|DYNAMIC_ALLOCATE\|CAPTURE_CMD_NEVER_UPDATE" | sort -u
  for mode in ${MODES:-default NEVER_UPDATE SKIP_TEMP}; do
    echo "== mode $mode $(date -u +%T)"
    flags=""
    [ "$mode" != default ] && flags="--xla_gpu_command_buffer_update_mode=$mode"
    XLA_FLAGS="$flags" timeout ${MODE_TIMEOUT:-150} python -m bench.labs.adaptive_call --prompts 8 \
        --variants ${VARIANTS:-fixed3 forced3 rule} --repeats 5 --out "$OUT/update-mode/$mode" 2>&1 \
        | grep -v "^      gap" | tail -40
  done
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/update-mode/run.log"
