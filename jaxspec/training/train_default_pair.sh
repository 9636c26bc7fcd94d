#!/usr/bin/env bash
# The recipe that produced jaxspec/default_model: tokenizer + target, then the draft, in one sitting on
# one GPU, finishing within WALL_S seconds. Results land in $OUT (logs, run.tar with configs, metrics and
# plots, and the .npz weight shards); `python -m jaxspec.training.export RUN_DIR DEST` converts them.
#   OUT=/tmp/out bash jaxspec/training/train_default_pair.sh
#   OUT=/tmp/out CORPUS_TGZ=stdlib.tar.gz bash ...   # train on an unpacked tree of *.py files instead of this stdlib
#   OUT=/tmp/out TARGET_ARGS="--preset smoke ..." DRAFT_ARGS="--preset smoke ..." bash jaxspec/training/train_default_pair.sh
set -u
: "${OUT:?set OUT}"
WALL_S=${WALL_S:-540}
TARGET_BUDGET_S=${TARGET_BUDGET_S:-230}
RUN=${RUN:-/tmp/jaxspec_run}
PY=${PY:-python3}
END=$(( $(date +%s) + WALL_S ))
export PYTHONUNBUFFERED=1
rm -rf "$RUN"; mkdir -p "$RUN" "$OUT"
CORPUS=()
if [ -n "${CORPUS_TGZ:-}" ]; then
  mkdir -p "$RUN.corpus" && tar xzf "$CORPUS_TGZ" -C "$RUN.corpus" && CORPUS=(--corpus-root "$RUN.corpus")
fi
$PY -m jaxspec.train_target --out "$RUN" --time-budget "$TARGET_BUDGET_S" ${CORPUS[@]+"${CORPUS[@]}"} ${TARGET_ARGS:-} 2>&1 | tee "$OUT/target_log.txt"
if [ -f "$RUN/target/config.json" ]; then
  timeout -s INT $(( END - $(date +%s) + ${GRACE_S:-40} )) \
    $PY -m jaxspec.train_draft --target "$RUN/target" --tokenizer "$RUN/tokenizer.json" --out "$RUN/draft" \
      --finish-by "$END" ${CORPUS[@]+"${CORPUS[@]}"} ${DRAFT_ARGS:-} 2>&1 | tee "$OUT/draft_log.txt"
fi
tar cf "$OUT/run.tar" -C "$RUN" --exclude='*.npz' .
for d in target draft; do
  if [ -d "$RUN/$d" ]; then mkdir -p "$OUT/$d"; cp "$RUN/$d"/*.npz "$OUT/$d/"; fi
done
ls -la "$OUT" "$OUT"/*/
