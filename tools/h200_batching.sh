#!/usr/bin/env bash
# Session batching on the H200 (issue #20): aggregate decode t/s and TTFT / ITL / TPOT / E2E
# percentiles at N = 1 2 4 8 16 concurrent streams on the 43-layer synthetic V4 Flash, one
# process (the model is built once), the N rows batched (B: default) and, with PERSLOT=1,
# the same with one forward per slot (DS4MLX_BATCHED_DECODE=0) for the before/after.
#   bash tools/h200_batching.sh            # one device call, time-boxed (BUDGET_S, default 560)
# Each row is written to $OUT/batched.json as soon as it is measured.  A fresh machine first
# compiles the step's kernels (minutes, cached in /tmp/mlx); each new row count B compiles its
# trace once, in the warm-up outside the measurement.
set -u
OUT=${OUT:-out/h200}; mkdir -p "$OUT"
args=(--synthetic --layers "${LAYERS:-43}" --slots "${SLOTS:-1,2,4,8,16}" --requests-per-slot "${RPS:-1}"
      --input-len "${INPUT:-256}" --output-len "${GEN:-32}" --ctx "${CTX:-4096}")
timeout "${BUDGET_S:-560}" python3 -u tools/bench_batched.py "${args[@]}" --json "$OUT/batched.json" \
    > "$OUT/batched.txt" 2>&1
echo "rc=$?"; tail -12 "$OUT/batched.txt"
if [ "${PERSLOT:-0}" = 1 ]; then
  DS4MLX_BATCHED_DECODE=0 timeout "${BUDGET_S:-560}" python3 -u tools/bench_batched.py "${args[@]}" \
      --json "$OUT/perslot.json" > "$OUT/perslot.txt" 2>&1
  echo "rc=$?"; tail -12 "$OUT/perslot.txt"
fi
